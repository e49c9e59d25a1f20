//! README.md's own examples, run as a new user would run them, on the
//! default model: `generate --chat`, `chat` piped, and the `curl` requests
//! against `serve` started with no flags. Each answer must be sensible (the
//! France question is answered "Paris"), and the default server must idle
//! under 1 GiB resident. The commands are read from README.md itself, so
//! the examples cannot drift from what is tested.

mod common;

use common::Server;
use std::io::Write;
use std::process::{Command, Stdio};

/// What precedes the subcommand in README's commands.
const CARGO_RUN: &str = "cargo run --release -p vellum-server -- ";

/// The README's shell blocks, one command per entry (continuation lines
/// joined).
fn readme_commands() -> Vec<String> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).expect("README.md");
    let mut commands = Vec::new();
    let mut in_sh = false;
    let mut current = String::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_sh = !in_sh && line.trim() == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(head) => current.push_str(head),
            None => {
                current.push_str(line);
                commands.push(std::mem::take(&mut current).trim().to_string());
            }
        }
    }
    commands
}

/// The one README command containing `needle`.
fn readme_command(needle: &str) -> String {
    let found: Vec<String> = readme_commands().into_iter().filter(|c| c.contains(needle)).collect();
    assert_eq!(found.len(), 1, "README.md should have exactly one command containing {needle:?}: {found:?}");
    found.into_iter().next().unwrap_or_default()
}

/// Splits a shell command line into words: whitespace, single and double
/// quotes (no expansions; README's examples need none).
fn shell_words(line: &str) -> Vec<String> {
    let (mut words, mut word, mut quote, mut started) = (Vec::new(), String::new(), None, false);
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                started = true;
            }
            (None, c) if c.is_whitespace() => {
                if started || !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
                started = false;
            }
            (None, c) => word.push(c),
        }
    }
    if started || !word.is_empty() {
        words.push(word);
    }
    words
}

/// The `vellum` arguments of a README command (what follows [`CARGO_RUN`]).
fn vellum_args(command: &str) -> Vec<String> {
    let at = command.find(CARGO_RUN).unwrap_or_else(|| panic!("{command:?} does not run vellum through {CARGO_RUN:?}"));
    shell_words(&command[at + CARGO_RUN.len()..])
}

fn vellum() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vellum"));
    c.env("NO_COLOR", "1");
    c
}

#[test]
fn readme_generate_example_answers_paris() {
    let args = vellum_args(&readme_command("generate --chat"));
    let out = vellum().args(&args).output().expect("vellum generate runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "vellum {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("Paris"), "README's generate example answered {stdout:?}");
}

#[test]
fn readme_chat_piped_answers_paris() {
    let command = readme_command("| cargo run --release -p vellum-server -- chat");
    let (echo, _) = command.split_once('|').unwrap_or_default();
    let said = shell_words(echo).into_iter().skip(1).collect::<Vec<_>>().join(" ");
    let args = vellum_args(&command);
    let mut child =
        vellum().args(&args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("vellum chat runs");
    child.stdin.take().expect("stdin").write_all(format!("{said}\n").as_bytes()).expect("writes the question");
    let out = child.wait_with_output().expect("vellum chat ends at end of input");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "vellum {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("Paris"), "README's piped chat answered {stdout:?}");
}

/// The `curl` requests of README's first block, against `serve` as README
/// starts it (no flags but a free port).
#[test]
fn readme_curl_requests_against_the_default_server() {
    let serve = vellum_args(&readme_command("-- serve"));
    assert_eq!(serve, ["serve"], "README's serve command takes no flags; this test starts it the same way");
    let server = Server::start(&[]);
    // The default server idles small: its KV pool is mapped as blocks are used.
    let rss_kib: u64 = std::fs::read_to_string(format!("/proc/{}/status", server.child.id()))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0);
    assert!(rss_kib < 1 << 20, "the default server holds {rss_kib} KiB resident when idle");
    let curls: Vec<String> = readme_commands().into_iter().filter(|c| c.starts_with("curl ")).collect();
    assert!(curls.len() >= 4, "README shows the curl requests: {curls:?}");
    for curl in curls {
        let words = shell_words(&curl);
        let url = words.iter().find(|w| w.starts_with("http://127.0.0.1:8000")).expect("a URL on the default port");
        let path = &url["http://127.0.0.1:8000".len()..];
        let body = words.iter().position(|w| w == "-d").map(|i| words[i + 1].clone());
        let headers: Vec<(&str, &str)> =
            words.windows(2).filter(|w| w[0] == "-H").filter_map(|w| w[1].split_once(':')).map(|(k, v)| (k.trim(), v.trim())).collect();
        let (status, text) = match &body {
            Some(b) => server.request("POST", path, &headers, b),
            None => server.get(path),
        };
        assert_eq!(status, 200, "{curl}: {text}");
        match path {
            "/v1/chat/completions" => assert!(text.contains("Paris"), "the chat example answered {text}"),
            "/v1/completions" if curl.contains("\"stream\": true") => {
                assert!(text.contains("data: {") && text.contains("data: [DONE]"), "the streamed example sent {text}")
            }
            "/v1/completions" => assert!(text.contains("Paris"), "the completion example answered {text}"),
            "/metrics" => assert!(text.contains("vllm:num_requests_running"), "metrics: {text}"),
            other => panic!("README requests {other}, which this test does not check"),
        }
    }
}

#[test]
fn shell_words_splits_like_a_shell() {
    assert_eq!(shell_words(r#"a "b c" 'd "e"' f''"#), ["a", "b c", "d \"e\"", "f"]);
    assert_eq!(shell_words("x ''"), ["x", ""]);
}
