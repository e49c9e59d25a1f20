//! `vellum bench serve`: online serving benchmark in the shape of vLLM's
//! benchmark_serving, against any OpenAI-compatible `/v1/completions`
//! endpoint (Vellum, llama.cpp's `llama-server`, vLLM).
//!
//! Requests (fixed or ShareGPT-like synthetic lengths, prompts as random
//! token ids) are sent with Poisson arrivals at `--request-rate` (or all at
//! once) and at most `--max-concurrency` in flight, each streamed, so that
//! time to first token and the gaps between tokens are seen as a client
//! sees them. Reports request and token throughput, TTFT, TPOT, ITL,
//! end-to-end latency (mean, median, p99) and the paper's normalized latency
//! (end-to-end latency / output tokens, §6.1).

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vellum_base::SeededRng;
use vellum_simulator::{generate_trace, Workload};

/// Arguments of `vellum bench serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeBenchArgs {
    /// Base URL of the server.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// Completions endpoint path.
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    /// Model name sent in requests (default: the first of /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// API key sent as a bearer token.
    #[arg(long)]
    pub api_key: Option<String>,
    /// `random` (fixed --input-len/--output-len) or `sharegpt` (synthetic
    /// ShareGPT-like lengths, long-tailed).
    #[arg(long, default_value = "random")]
    pub dataset: String,
    /// Prompt tokens per request (random dataset).
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Output tokens per request (random dataset; EOS ignored).
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Longest prompt + output kept in the sharegpt dataset.
    #[arg(long, default_value_t = 1024)]
    pub max_len: usize,
    /// Requests to send.
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Mean requests per second (Poisson arrivals); `inf` sends all at
    /// once. Several comma-separated rates run one after the other.
    #[arg(long, default_value = "inf")]
    pub request_rate: String,
    /// Most requests in flight at once (default: unbounded).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Smallest token id drawn for prompts (skips special tokens).
    #[arg(long, default_value_t = 100)]
    pub min_token_id: u32,
    /// Largest token id drawn for prompts, exclusive.
    #[arg(long, default_value_t = 49000)]
    pub max_token_id: u32,
    /// Seed of the trace and the arrivals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A label stored in the JSON result (e.g. the server's name).
    #[arg(long, default_value = "")]
    pub label: String,
    /// Print one JSON object per rate instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Append the JSON result lines to this file too.
    #[arg(long)]
    pub save_result: Option<PathBuf>,
    /// Seconds before one request is given up (counted as failed).
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
}

struct Target {
    host: String,
    port: u16,
    path: String,
    model: String,
    api_key: Option<String>,
}

fn parse_base(url: &str) -> Result<(String, u16)> {
    let rest = url.strip_prefix("http://").ok_or_else(|| anyhow!("--base-url must start with http:// (got {url:?})"))?;
    let hostport = rest.split('/').next().unwrap_or("");
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) => (h.to_string(), p.parse::<u16>().map_err(|_| anyhow!("--base-url: bad port in {url:?}"))?),
        None => (hostport.to_string(), 80),
    };
    if host.is_empty() {
        bail!("--base-url: no host in {url:?}");
    }
    Ok((host, port))
}

/// One HTTP/1.1 request on a fresh connection; the response body is read
/// frame by frame and `on_frame` sees each with its arrival time.
async fn http(
    host: &str,
    port: u16,
    method: &str,
    path: &str,
    body: Option<Value>,
    api_key: Option<&str>,
    mut on_frame: impl FnMut(&[u8], Instant),
) -> Result<u16> {
    let stream = tokio::net::TcpStream::connect((host, port)).await.with_context(|| format!("connecting to {host}:{port}"))?;
    stream.set_nodelay(true)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = hyper::Request::builder().method(method).uri(path).header("host", format!("{host}:{port}"));
    if let Some(k) = api_key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let bytes = match body {
        Some(b) => {
            req = req.header("content-type", "application/json");
            Bytes::from(b.to_string())
        }
        None => Bytes::new(),
    };
    let resp = sender.send_request(req.body(Full::new(bytes))?).await?;
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        if let Some(data) = frame.data_ref() {
            on_frame(data, Instant::now());
        }
    }
    Ok(status)
}

/// What one request measured.
#[derive(Clone, Debug, Default)]
struct Outcome {
    ok: bool,
    error: String,
    prompt_len: usize,
    output_tokens: usize,
    ttft: f64,
    itl: Vec<f64>,
    e2e: f64,
}

/// What a request's event stream said so far: counted by the response's
/// completion (a `finish_reason`, or `[DONE]`), not by whether it carried
/// text — a model emitting only special tokens streams choices with empty
/// text and still completes.
#[derive(Default)]
struct StreamTally {
    /// The first choice with text, and the first choice of any kind.
    first_text: Option<Instant>,
    first_choice: Option<Instant>,
    last: Option<Instant>,
    itl: Vec<f64>,
    chunks: usize,
    usage_tokens: Option<usize>,
    finished: bool,
    error: String,
}

impl StreamTally {
    /// One SSE `data:` payload, arrived at `at`.
    fn event(&mut self, payload: &str, at: Instant) {
        if payload == "[DONE]" {
            self.finished = true;
            return;
        }
        if payload.is_empty() {
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(payload) else { return };
        if let Some(e) = v.get("error") {
            self.error = e.to_string();
        }
        if let Some(n) = v.get("usage").and_then(|u| u.get("completion_tokens")).and_then(Value::as_u64) {
            self.usage_tokens = Some(n as usize);
        }
        let Some(choices) = v.get("choices").and_then(Value::as_array) else { return };
        if choices.is_empty() {
            return;
        }
        self.first_choice.get_or_insert(at);
        if choices.iter().any(|c| c.get("finish_reason").is_some_and(|f| !f.is_null())) {
            self.finished = true;
        }
        if choices.iter().any(|c| c.get("text").and_then(Value::as_str).is_some_and(|t| !t.is_empty())) {
            self.chunks += 1;
            match self.last {
                None => self.first_text = Some(at),
                Some(l) => self.itl.push(at.duration_since(l).as_secs_f64()),
            }
            self.last = Some(at);
        }
    }

    /// The request's outcome once its response (HTTP `status`) ended.
    fn outcome(self, status: u16, start: Instant, end: Instant, prompt_len: usize) -> Outcome {
        let error = if !self.error.is_empty() {
            self.error
        } else if status != 200 {
            format!("HTTP {status}")
        } else if !self.finished {
            "the stream ended before the completion did (no finish_reason, no [DONE])".to_string()
        } else {
            String::new()
        };
        // Time to the first token: its text, or for a completion that
        // streamed none, its first choice.
        let first = self.first_text.or(self.first_choice);
        Outcome {
            ok: error.is_empty(),
            error,
            prompt_len,
            output_tokens: self.usage_tokens.unwrap_or(self.chunks),
            ttft: first.map_or(0.0, |f| f.duration_since(start).as_secs_f64()),
            itl: self.itl,
            e2e: end.duration_since(start).as_secs_f64(),
        }
    }
}

async fn send_one(target: Arc<Target>, prompt: Vec<u32>, output_len: usize, timeout: Duration) -> Outcome {
    let body = json!({
        "model": target.model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let mut buf = Vec::new();
    let mut tally = StreamTally::default();
    let fut = http(&target.host, target.port, "POST", &target.path, Some(body), target.api_key.as_deref(), |data, at| {
        buf.extend_from_slice(data);
        // Complete SSE events end with a blank line.
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                if let Some(payload) = line.strip_prefix("data:") {
                    tally.event(payload.trim(), at);
                }
            }
        }
    });
    let status = match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Outcome { error: e.to_string(), prompt_len: prompt.len(), ..Default::default() },
        Err(_) => return Outcome { error: "timed out".into(), prompt_len: prompt.len(), ..Default::default() },
    };
    tally.outcome(status, start, Instant::now(), prompt.len())
}

fn stats(v: &mut [f64]) -> Value {
    if v.is_empty() {
        return json!({"mean": null, "median": null, "p99": null});
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    json!({"mean": mean, "median": super::percentile(v, 50.0), "p99": super::percentile(v, 99.0)})
}

fn trace(args: &ServeBenchArgs) -> Result<Vec<(usize, usize)>> {
    if args.num_prompts == 0 {
        bail!("--num-prompts must be positive");
    }
    match args.dataset.as_str() {
        "random" => {
            if args.input_len == 0 || args.output_len == 0 {
                bail!("--input-len and --output-len must be positive");
            }
            Ok(vec![(args.input_len, args.output_len); args.num_prompts])
        }
        "sharegpt" => {
            let mut duration = args.num_prompts as f64 / 100.0 * 2.0 + 1.0;
            loop {
                let t = generate_trace(Workload::ShareGpt, 100.0, duration, args.max_len, args.seed);
                if t.len() >= args.num_prompts {
                    return Ok(t.into_iter().take(args.num_prompts).map(|r| (r.prompt_len, r.output_len)).collect());
                }
                duration *= 2.0;
            }
        }
        other => bail!("--dataset must be random or sharegpt, got {other:?}"),
    }
}

fn parse_rates(s: &str) -> Result<Vec<f64>> {
    s.split(',')
        .map(|r| {
            let r = r.trim();
            if r == "inf" {
                return Ok(f64::INFINITY);
            }
            match r.parse::<f64>() {
                Ok(v) if v > 0.0 => Ok(v),
                _ => bail!("--request-rate: {r:?} is not a positive number or inf"),
            }
        })
        .collect()
}

/// Runs `vellum bench serve`.
pub fn run(args: ServeBenchArgs) -> Result<()> {
    let rates = parse_rates(&args.request_rate)?;
    if args.max_concurrency == Some(0) {
        bail!("--max-concurrency must be at least 1");
    }
    if args.min_token_id >= args.max_token_id {
        bail!("--min-token-id must be below --max-token-id");
    }
    let lengths = trace(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async {
        let (host, port) = parse_base(&args.base_url)?;
        let model = match &args.model {
            Some(m) => m.clone(),
            None => first_model(&host, port, args.api_key.as_deref()).await?,
        };
        let target = Arc::new(Target { host, port, path: args.endpoint.clone(), model, api_key: args.api_key.clone() });
        for &rate in &rates {
            let result = run_rate(&args, target.clone(), &lengths, rate).await?;
            if let Some(path) = &args.save_result {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("opening {}", path.display()))?;
                writeln!(f, "{result}")?;
            }
            if args.json {
                println!("{result}");
            } else {
                print_table(&result);
            }
        }
        Ok(())
    })
}

async fn first_model(host: &str, port: u16, api_key: Option<&str>) -> Result<String> {
    let mut body = Vec::new();
    let status = http(host, port, "GET", "/v1/models", None, api_key, |d, _| body.extend_from_slice(d)).await?;
    if status != 200 {
        bail!("GET /v1/models answered HTTP {status}");
    }
    let v: Value = serde_json::from_slice(&body).context("GET /v1/models: not JSON")?;
    v["data"][0]["id"].as_str().map(str::to_string).ok_or_else(|| anyhow!("GET /v1/models lists no model; pass --model"))
}

async fn run_rate(args: &ServeBenchArgs, target: Arc<Target>, lengths: &[(usize, usize)], rate: f64) -> Result<Value> {
    let mut rng = SeededRng::new(args.seed);
    let span = (args.max_token_id - args.min_token_id) as usize;
    let prompts: Vec<Vec<u32>> =
        lengths.iter().map(|&(i, _)| (0..i).map(|_| args.min_token_id + rng.below(span) as u32).collect()).collect();
    let semaphore = args.max_concurrency.map(|c| Arc::new(tokio::sync::Semaphore::new(c)));
    let timeout = Duration::from_secs_f64(args.timeout.max(0.001));
    let start = Instant::now();
    let mut next_at = 0.0f64;
    let mut handles = Vec::with_capacity(prompts.len());
    for (prompt, &(_, out)) in prompts.into_iter().zip(lengths) {
        if rate.is_finite() {
            next_at += rng.exponential(rate);
            let due = start + Duration::from_secs_f64(next_at);
            tokio::time::sleep_until(due.into()).await;
        }
        let permit = match &semaphore {
            Some(s) => Some(s.clone().acquire_owned().await?),
            None => None,
        };
        let t = target.clone();
        handles.push(tokio::spawn(async move {
            let o = send_one(t, prompt, out, timeout).await;
            drop(permit);
            o
        }));
    }
    let mut outcomes = Vec::with_capacity(handles.len());
    for h in handles {
        outcomes.push(h.await?);
    }
    let duration = start.elapsed().as_secs_f64();
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.ok).collect();
    if let Some(f) = failed.first() {
        tracing::warn!(failed = failed.len(), first_error = %f.error, "some requests failed");
    }
    let output_tokens: usize = ok.iter().map(|o| o.output_tokens).sum();
    let input_tokens: usize = ok.iter().map(|o| o.prompt_len).sum();
    let mut ttft: Vec<f64> = ok.iter().map(|o| o.ttft).collect();
    let mut tpot: Vec<f64> = ok.iter().filter(|o| o.output_tokens > 1).map(|o| (o.e2e - o.ttft) / (o.output_tokens - 1) as f64).collect();
    let mut itl: Vec<f64> = ok.iter().flat_map(|o| o.itl.iter().copied()).collect();
    let mut e2e: Vec<f64> = ok.iter().map(|o| o.e2e).collect();
    let mut norm: Vec<f64> = ok.iter().filter(|o| o.output_tokens > 0).map(|o| o.e2e / o.output_tokens as f64).collect();
    // Why requests failed: each distinct reason with its count.
    let mut reasons = std::collections::BTreeMap::<&str, usize>::new();
    for f in &failed {
        *reasons.entry(f.error.as_str()).or_default() += 1;
    }
    Ok(json!({
        "label": args.label,
        "base_url": args.base_url,
        "model": target.model,
        "dataset": args.dataset,
        "request_rate": if rate.is_finite() { json!(rate) } else { json!("inf") },
        "max_concurrency": args.max_concurrency,
        "num_prompts": lengths.len(),
        "completed": ok.len(),
        "failed": failed.len(),
        "failure_reasons": reasons,
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": ok.len() as f64 / duration,
        "output_throughput": output_tokens as f64 / duration,
        "total_token_throughput": (input_tokens + output_tokens) as f64 / duration,
        "ttft_s": stats(&mut ttft),
        "tpot_s": stats(&mut tpot),
        "itl_s": stats(&mut itl),
        "e2el_s": stats(&mut e2e),
        "normalized_latency_s_per_token": stats(&mut norm),
    }))
}

fn print_table(r: &Value) {
    let f = |v: &Value| v.as_f64().map_or("-".to_string(), |x| format!("{x:.4}"));
    println!("============ Serving Benchmark Result ({}) ============", r["label"].as_str().unwrap_or(""));
    println!("{:<40}{}", "Request rate (req/s):", r["request_rate"]);
    println!("{:<40}{}", "Max concurrency:", r["max_concurrency"]);
    println!("{:<40}{}", "Successful requests:", r["completed"]);
    println!("{:<40}{}", "Failed requests:", r["failed"]);
    if let Some(reasons) = r["failure_reasons"].as_object() {
        for (why, n) in reasons {
            println!("  {n} × {why}");
        }
    }
    println!("{:<40}{}", "Benchmark duration (s):", f(&r["duration_s"]));
    println!("{:<40}{}", "Total input tokens:", r["total_input_tokens"]);
    println!("{:<40}{}", "Total generated tokens:", r["total_output_tokens"]);
    println!("{:<40}{}", "Request throughput (req/s):", f(&r["request_throughput"]));
    println!("{:<40}{}", "Output token throughput (tok/s):", f(&r["output_throughput"]));
    println!("{:<40}{}", "Total token throughput (tok/s):", f(&r["total_token_throughput"]));
    for (name, key) in [
        ("Time to First Token (s)", "ttft_s"),
        ("Time per Output Token (s)", "tpot_s"),
        ("Inter-token Latency (s)", "itl_s"),
        ("End-to-end Latency (s)", "e2el_s"),
        ("Normalized latency (s/token)", "normalized_latency_s_per_token"),
    ] {
        println!("---------------{name:-^40}");
        for stat in ["mean", "median", "p99"] {
            println!("{:<40}{}", format!("{} {}:", stat, key), f(&r[key][stat]));
        }
    }
}

/// Arguments of `vellum bench serve-plot`.
#[derive(Args, Debug)]
pub struct ServePlotArgs {
    /// JSON-lines files written by `vellum bench serve --save-result`;
    /// each distinct label becomes one line of the chart.
    #[arg(required = true)]
    pub results: Vec<PathBuf>,
    /// Output SVG.
    #[arg(long)]
    pub out: PathBuf,
    /// Clip the y axis here (s/token), as the paper's Fig. 12.
    #[arg(long, default_value_t = 1.0)]
    pub y_max: f64,
}

/// Runs `vellum bench serve-plot`: median normalized latency against
/// request rate, one line per label (the paper's Fig. 12).
pub fn plot(args: ServePlotArgs) -> Result<()> {
    let mut series: Vec<super::plot::Series> = Vec::new();
    for path in &args.results {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let v: Value = serde_json::from_str(line).with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
            let (Some(rate), Some(lat)) = (v["request_rate"].as_f64(), v["normalized_latency_s_per_token"]["median"].as_f64()) else {
                continue;
            };
            let label = v["label"].as_str().unwrap_or("").to_string();
            match series.iter_mut().find(|s| s.name == label) {
                Some(s) => s.points.push((rate, lat)),
                None => series.push(super::plot::Series { name: label, points: vec![(rate, lat)] }),
            }
        }
    }
    if series.is_empty() {
        bail!("no result with a finite request rate in the given files");
    }
    for s in &mut series {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    super::plot::line_chart(
        &args.out,
        "Normalized latency vs request rate",
        "Request rate (req/s)",
        "Median normalized latency (s/token)",
        &series,
        args.y_max,
    )?;
    println!("wrote {}", args.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// A parser around the arguments, as the real command line has.
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ServeBenchArgs,
    }

    impl ServeBenchArgs {
        fn parse_from<const N: usize>(argv: [&str; N]) -> Self {
            Cli::parse_from(argv).args
        }
    }

    #[test]
    fn base_urls_and_rates_parse() {
        assert_eq!(parse_base("http://127.0.0.1:8080").unwrap(), ("127.0.0.1".to_string(), 8080));
        assert_eq!(parse_base("http://localhost/").unwrap(), ("localhost".to_string(), 80));
        assert!(parse_base("https://x").is_err());
        assert!(parse_base("http://h:notaport").is_err());
        assert_eq!(parse_rates("1, 2.5,inf").unwrap(), vec![1.0, 2.5, f64::INFINITY]);
        assert!(parse_rates("0").is_err());
        assert!(parse_rates("x").is_err());
    }

    #[test]
    fn sharegpt_trace_has_the_asked_count_within_the_length_cap() {
        let args = ServeBenchArgs::parse_from(["x", "--dataset", "sharegpt", "--num-prompts", "300", "--max-len", "512"]);
        let t = trace(&args).unwrap();
        assert_eq!(t.len(), 300);
        assert!(t.iter().all(|&(i, o)| i >= 1 && o >= 1 && i + o <= 512), "{t:?}");
        let mean_out = t.iter().map(|l| l.1).sum::<usize>() as f64 / 300.0;
        assert!(mean_out > 50.0, "long-tailed outputs, mean {mean_out}");
        let fixed = ServeBenchArgs::parse_from(["x", "--num-prompts", "3", "--input-len", "7", "--output-len", "5"]);
        assert_eq!(trace(&fixed).unwrap(), vec![(7, 5); 3]);
        let bad = ServeBenchArgs::parse_from(["x", "--dataset", "alpaca"]);
        assert!(trace(&bad).is_err());
    }

    /// A request counts by its completion: a stream of special tokens only
    /// (empty text) that finishes is a success with its usage's tokens; a
    /// stream cut before any finish, an HTTP error or an error event fails
    /// with a reason that says which.
    #[test]
    fn requests_count_by_their_completion_and_failures_give_a_reason() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let chunk = |text: &str, finish: Value| json!({"choices": [{"index": 0, "text": text, "finish_reason": finish}]}).to_string();
        // Text, then the finish and the usage.
        let mut t = StreamTally::default();
        t.event(&chunk("Hello", Value::Null), at(30));
        t.event(&chunk(" world", Value::Null), at(40));
        t.event(&chunk("", json!("length")), at(41));
        t.event(&json!({"choices": [], "usage": {"completion_tokens": 3}}).to_string(), at(42));
        t.event("[DONE]", at(43));
        let o = t.outcome(200, t0, at(50), 7);
        assert!(o.ok, "{}", o.error);
        assert_eq!((o.output_tokens, o.itl.len()), (3, 1));
        assert!((o.ttft - 0.030).abs() < 1e-9);
        // Special tokens only: every choice's text is empty, and it completes.
        let mut t = StreamTally::default();
        for ms in [20, 25, 30] {
            t.event(&chunk("", Value::Null), at(ms));
        }
        t.event(&chunk("", json!("length")), at(35));
        t.event(&json!({"choices": [], "usage": {"completion_tokens": 4}}).to_string(), at(36));
        let o = t.outcome(200, t0, at(40), 7);
        assert!(o.ok, "a completion with no text is not a failure: {}", o.error);
        assert_eq!(o.output_tokens, 4);
        assert!((o.ttft - 0.020).abs() < 1e-9, "time to its first choice");
        // Cut off mid-stream: no finish_reason, no [DONE].
        let mut t = StreamTally::default();
        t.event(&chunk("Hel", Value::Null), at(10));
        let o = t.outcome(200, t0, at(20), 7);
        assert!(!o.ok && o.error.contains("no finish_reason"), "{}", o.error);
        // [DONE] alone completes a stream whose last chunk had no finish_reason.
        let mut t = StreamTally::default();
        t.event(&chunk("x", Value::Null), at(10));
        t.event("[DONE]", at(11));
        assert!(t.outcome(200, t0, at(12), 7).ok);
        // The server's errors keep their words.
        let o = StreamTally::default().outcome(503, t0, at(1), 7);
        assert_eq!(o.error, "HTTP 503");
        let mut t = StreamTally::default();
        t.event(&json!({"error": {"message": "model overloaded"}}).to_string(), at(5));
        t.event("[DONE]", at(6));
        let o = t.outcome(200, t0, at(7), 7);
        assert!(!o.ok && o.error.contains("model overloaded"), "{}", o.error);
    }

    #[test]
    fn percentiles() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = stats(&mut v);
        // numpy's (and vLLM's benchmark_serving's) interpolated definition.
        assert_eq!(s["median"], json!(50.5));
        assert!((s["p99"].as_f64().unwrap() - 99.01).abs() < 1e-9);
        assert_eq!(s["mean"], json!(50.5));
    }
}
