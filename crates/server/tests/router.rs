//! Replicas behind an existing router: the real `sglang-router` (the
//! version `.ci/run` installs) in front of two `vellum serve` processes,
//! driven through it by the official `openai` client
//! (`python/router.py`). The router registers the workers from what they
//! serve (`/health`, `/server_info`, `/model_info`, `/v1/models`), routes
//! requests with a shared prefix to one replica (cache-aware policy),
//! retries the requests in flight to a replica killed mid-run on the live
//! one (none lost; a stream cut mid-answer ends with a connection error),
//! reports the dead replica unhealthy within seconds, and takes a restarted
//! replica back.

mod common;

use common::{python_with_openai, run_python, Server};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = "smol";

/// A free local port (bound, then released for the router to take).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

/// The router process; killed on drop.
struct Router(Child);

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn replica() -> Server {
    Server::start(&["--kv-cache-memory", "32MiB", "--max-model-len", "1024", "--served-model-name", MODEL])
}

#[test]
fn sglang_router_routes_fails_over_and_takes_a_replica_back() {
    let python = python_with_openai();
    let has_router = Command::new(&python).args(["-c", "import sglang_router"]).status().is_ok_and(|s| s.success());
    assert!(has_router, "the router test needs sglang-router: {python} -m pip install sglang-router==0.3.2 (CI does this in .ci/run)");
    let (a, b) = (replica(), replica());
    let (port, metrics_port) = (free_port(), free_port());
    let router = Router(
        Command::new(&python)
            .args(["-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--prometheus-port", &metrics_port.to_string(), "--policy", "cache_aware"])
            .args(["--health-check-interval-secs", "1", "--health-failure-threshold", "2", "--log-level", "warn"])
            // A failed request is retried for ~5 s (300 ms, ×1.5, at most
            // 1 s apart), longer than two failed health checks take to mark
            // a dead replica: a retry then reaches a live one. (The default,
            // 5 tries from 50 ms, gives up within ~0.7 s.)
            .args(["--retry-max-retries", "8", "--retry-initial-backoff-ms", "300", "--retry-max-backoff-ms", "1000"])
            .arg("--worker-urls")
            .args([a.base_url(), b.base_url()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting sglang-router"),
    );
    let url = format!("http://127.0.0.1:{port}");
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(started.elapsed() < Duration::from_secs(60), "the router did not listen within 60 s");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (a_url, b_url) = (a.base_url(), b.base_url());
    let script = |phase: &str, extra: &[String]| {
        let mut args = vec![phase.to_string(), url.clone(), MODEL.to_string(), a_url.clone(), b_url.clone()];
        args.extend_from_slice(extra);
        run_python(&python, "router.py", &args);
    };
    script("route", &[]);
    // The script kills the replica that holds the shared prefix, mid-run.
    script("failover", &[a.child.id().to_string(), b.child.id().to_string()]);
    let restarted = replica();
    script("rejoin", &[restarted.base_url()]);
    drop(router);
}
