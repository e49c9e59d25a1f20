//! Starts the real `vellum serve` binary on a free port and waits for it.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A running server; killed on drop.
pub struct Server {
    pub child: Child,
    pub port: u16,
    pub log: mpsc::Receiver<String>,
    /// What the server logged before it listened (ANSI codes stripped).
    pub startup_log: Vec<String>,
}

impl Server {
    /// `vellum serve` with `args` on port 0; returns once /health answers.
    pub fn start(args: &[&str]) -> Server {
        Self::start_with_env(args, &[])
    }

    /// [`Server::start`] with extra environment variables.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vellum"))
            .arg("serve")
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .envs(env.iter().copied())
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting vellum serve");
        let stderr = child.stderr.take().expect("stderr is piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[server] {line}");
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(180);
        let mut startup_log = Vec::new();
        let port = loop {
            let line = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).unwrap_or_else(|_| {
                let _ = child.kill();
                panic!("vellum serve did not log its address within 180 s (exit: {:?})", child.try_wait())
            });
            let plain = strip_ansi(&line);
            startup_log.push(plain.clone());
            if let Some(at) = plain.find("http://127.0.0.1:") {
                let digits: String = plain[at + 17..].chars().take_while(char::is_ascii_digit).collect();
                if let Ok(p) = digits.parse::<u16>() {
                    break p;
                }
            }
        };
        let server = Server { child, port, log: rx, startup_log };
        let start = Instant::now();
        while server.get("/health").0 != 200 {
            assert!(start.elapsed() < Duration::from_secs(30), "/health did not answer 200");
            std::thread::sleep(Duration::from_millis(100));
        }
        server
    }

    /// Whether a line logged before the server listened contains `needle`.
    pub fn log_contains(&self, needle: &str) -> bool {
        self.startup_log.iter().any(|l| l.contains(needle))
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A plain HTTP/1.1 request; returns (status, body).
    pub fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
        self.try_request(method, path, headers, body).expect("connecting")
    }

    /// [`Server::request`], or `None` when nothing listens any more (a
    /// server that is shutting down may have closed its socket already).
    pub fn try_request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Option<(u16, String)> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(120))).ok();
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(body);
        if s.write_all(req.as_bytes()).is_err() {
            return Some((0, String::new()));
        }
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let text = String::from_utf8_lossy(&out).to_string();
        let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        Some((status, body))
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        self.request("GET", path, &[], "")
    }

    /// The process's exit status, waiting up to 20 s for it (`what` says
    /// what should have made it exit).
    pub fn wait_for_exit(&mut self, what: &str) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("waiting") {
                return status;
            }
            assert!(start.elapsed() < Duration::from_secs(20), "no exit within 20 s after {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c2 in chars.by_ref() {
                if c2.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `python3`, with the official `openai` package importable; panics with
/// how to install it otherwise.
pub fn python_with_openai() -> String {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python).args(["-c", "import openai"]).status().map(|s| s.success()).unwrap_or(false);
    assert!(
        ok,
        "the integration tests drive the server with the official `openai` Python package, which `{python} -c 'import openai'` \
         cannot import: install it with `{python} -m pip install openai` (CI does this in .ci/run)"
    );
    python
}

/// Path of a script in tests/python.
pub fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests").join("python").join(name)
}

/// Runs a python script; panics with its output unless it exits 0.
pub fn run_python(python: &str, script_name: &str, args: &[String]) {
    let started = Instant::now();
    let out = Command::new(python).arg(script(script_name)).args(args).output().expect("running python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("--- {script_name} ({:.1}s)\n{stdout}\n{stderr}", started.elapsed().as_secs_f64());
    assert!(out.status.success(), "{script_name} failed:\n{stdout}\n{stderr}");
}
