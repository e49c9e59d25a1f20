//! Load and disconnects on the real `vellum serve`: 64 concurrent streaming
//! clients on loopback, a fifth of them hanging up mid-stream; afterwards
//! every KV block is free and the metrics add up. A two-minute soak of
//! mixed traffic. A graceful shutdown that lets an in-flight stream
//! finish, and an engine that dies under a stream (an injected panic).

mod common;

use common::{python_with_openai, run_python, Server};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

#[test]
fn sixty_four_streams_with_hangups_free_every_block() {
    let python = python_with_openai();
    let server = Server::start(&["--kv-cache-memory", "128MiB", "--max-model-len", "512", "--api-key", "k", "--served-model-name", "smol"]);
    let started = Instant::now();
    run_python(&python, "load_disconnect.py", &["127.0.0.1".into(), server.port.to_string(), "k".into(), "smol".into()]);
    assert!(started.elapsed() < Duration::from_secs(300), "the load test took {:?}", started.elapsed());
}

/// The soak of `benchmarks/soak.py`, two minutes of it (docs/reliability.md
/// has the 30-minute run): mixed load with hang-ups and invalid requests;
/// then nothing runs or waits, every KV block is free, no request got an
/// unexpected answer, and the server's RSS stopped growing after warm-up.
#[test]
fn two_minute_soak_leaks_nothing() {
    let python = python_with_openai();
    let server = Server::start(&["--kv-cache-memory", "128MiB", "--max-model-len", "512", "--api-key", "k", "--served-model-name", "smol"]);
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../benchmarks/soak.py");
    let pid = server.child.id().to_string();
    let args =
        ["--port", &server.port.to_string(), "--key", "k", "--model", "smol", "--pid", &pid, "--duration", "120", "--concurrency", "12"];
    let out = std::process::Command::new(&python).arg(&script).args(args).output().expect("running soak.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("--- soak.py\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("SOAK PASSED"), "the soak failed:\n{stdout}");
}

#[test]
fn sigterm_lets_an_in_flight_stream_finish_then_exits_zero() {
    let mut server = Server::start(&["--kv-cache-memory", "32MiB", "--max-model-len", "256", "--shutdown-timeout", "30"]);
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).expect("connecting");
    s.set_read_timeout(Some(Duration::from_secs(60))).ok();
    let body = r#"{"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": true, "stream": true, "temperature": 0}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("sending");
    // Wait for the first token, then signal.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("\"text\"") {
        let n = s.read(&mut buf).expect("reading");
        assert!(n > 0, "connection closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    let pid = server.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    // New connections are refused or answered 503 while draining.
    let _ = s.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("\"finish_reason\":\"length\""), "the stream should finish normally:\n{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    let status = server.wait_for_exit("the stream finished");
    assert!(status.success(), "exit status {status:?}");
}

/// The engine thread panics mid-stream (the test-only hook
/// `VELLUM_FAULT_INJECTION`): the client's stream ends with an error event
/// instead of hanging, the server stops looking healthy, and the process
/// exits with a non-zero status for a supervisor to restart it.
#[test]
fn an_engine_panic_ends_the_stream_with_an_error_and_the_server_exits_nonzero() {
    let mut server =
        Server::start_with_env(&["--kv-cache-memory", "32MiB", "--max-model-len", "256"], &[("VELLUM_FAULT_INJECTION", "panic-at-step:4")]);
    let body = r#"{"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": true, "stream": true, "temperature": 0}"#;
    let started = Instant::now();
    let (status, text) = server.request("POST", "/v1/completions", &[("Content-Type", "application/json")], body);
    assert!(started.elapsed() < Duration::from_secs(30), "the stream hung for {:?}", started.elapsed());
    assert_eq!(status, 200, "the stream had started: {text}");
    assert!(text.contains("\"error\"") && text.contains("engine failed"), "the stream must end with an error event:\n{text}");
    assert!(!text.contains("\"finish_reason\":\"length\""), "{text}");
    // Not healthy, or (the server closing on its own) not listening at all.
    let health = server.try_request("GET", "/health", &[], "").map(|(status, _)| status);
    assert_ne!(health, Some(200), "a dead engine must not look healthy");
    let status = server.wait_for_exit("the engine died");
    assert!(!status.success(), "exit status {status:?}: a dead engine must exit non-zero");
}

/// A client that stops reading its stream, through a real socket with a
/// small receive buffer (`python/stalled_reader.py`): other requests are
/// answered meanwhile, the stalled request is aborted once its buffers are
/// full (a small `--max-stream-buffer-events` here, so that the kernel's
/// and hyper's buffers dominate), every block is freed with the socket still
/// open, and the stream ends with an error event saying why.
#[test]
fn a_client_that_stops_reading_is_aborted_and_others_go_on() {
    let python = python_with_openai();
    let server = Server::start(&[
        "--kv-cache-memory",
        "512MiB",
        "--max-model-len",
        "512",
        "--max-stream-buffer-events",
        "32",
        "--served-model-name",
        "smol",
    ]);
    run_python(&python, "stalled_reader.py", &["127.0.0.1".into(), server.port.to_string(), "smol".into()]);
}

/// A backend fault in one forward pass (the test-only hook
/// `VELLUM_FAULT_INJECTION=error-at-step:N`): the stream that step carried
/// ends with an error event naming the fault, the server stays healthy,
/// nothing is left running or holding blocks, and the next request is
/// answered in full. Then two security basics on the same server: a
/// request's model name is never opened as a path (404), and the log at the
/// default level carries no prompt or completion text.
#[test]
fn a_backend_error_fails_its_request_and_the_server_goes_on() {
    let server =
        Server::start_with_env(&["--kv-cache-memory", "32MiB", "--max-model-len", "256"], &[("VELLUM_FAULT_INJECTION", "error-at-step:4")]);
    let json = [("Content-Type", "application/json")];
    let body = r#"{"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": true, "stream": true, "temperature": 0}"#;
    let (status, text) = server.request("POST", "/v1/completions", &json, body);
    assert_eq!(status, 200, "the stream had started: {text}");
    assert!(text.contains("\"error\"") && text.contains("injected fault"), "the stream must end with an error event:\n{text}");
    assert!(!text.contains("\"finish_reason\":\"length\""), "{text}");
    assert_eq!(server.get("/health").0, 200, "a backend error is not an engine death");
    let plain = r#"{"prompt": "Zebra canary 7431 once upon a time", "max_tokens": 8, "ignore_eos": true, "temperature": 0}"#;
    let (status, text) = server.request("POST", "/v1/completions", &json, plain);
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("\"completion_tokens\":8"), "{text}");
    // A model name from a request is a name, never a path that is opened.
    let path = r#"{"model": "/etc/passwd", "prompt": "x", "max_tokens": 1}"#;
    let (status, text) = server.request("POST", "/v1/completions", &json, path);
    assert_eq!(status, 404, "{text}");
    assert!(!text.contains("root:"), "{text}");
    // At the default level no prompt or completion text reaches the log.
    let completion = text_of_choice(&server.request("POST", "/v1/completions", &json, plain).1);
    let logged: Vec<String> = server.log.try_iter().collect();
    assert!(!logged.is_empty(), "the server logged its requests");
    for line in &logged {
        assert!(!line.contains("Zebra canary") && !line.contains(&completion), "request text in the log: {line}");
    }
    // Nothing runs or holds blocks (the gauges refresh after each step).
    let idle = |metrics: &str| {
        ["vllm:num_requests_running", "vllm:kv_cache_usage_perc"]
            .iter()
            .all(|gauge| metrics.lines().find(|l| l.starts_with(gauge)).is_some_and(|l| l.ends_with(" 0") || l.ends_with(" 0.0")))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, metrics) = server.get("/metrics");
        if idle(&metrics) {
            break;
        }
        assert!(Instant::now() < deadline, "still running or holding blocks:\n{metrics}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The `text` of the first choice in a completion response body.
fn text_of_choice(body: &str) -> String {
    let at = body.find("\"text\":\"").expect("a choice with text") + 8;
    body[at..].split('"').next().unwrap_or_default().to_string()
}
