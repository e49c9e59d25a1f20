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
    let mut first: Option<Instant> = None;
    let mut last: Option<Instant> = None;
    let mut itl = Vec::new();
    let mut chunks = 0usize;
    let mut usage_tokens = None;
    let mut error = String::new();
    let fut = http(&target.host, target.port, "POST", &target.path, Some(body), target.api_key.as_deref(), |data, at| {
        buf.extend_from_slice(data);
        // Complete SSE events end with a blank line.
        while let Some(pos) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(payload) = line.strip_prefix("data:").map(str::trim) else { continue };
                if payload == "[DONE]" || payload.is_empty() {
                    continue;
                }
                let Ok(v) = serde_json::from_str::<Value>(payload) else { continue };
                if let Some(e) = v.get("error") {
                    error = e.to_string();
                }
                if let Some(n) = v.get("usage").and_then(|u| u.get("completion_tokens")).and_then(Value::as_u64) {
                    usage_tokens = Some(n as usize);
                }
                let has_text = v
                    .get("choices")
                    .and_then(Value::as_array)
                    .is_some_and(|cs| cs.iter().any(|c| c.get("text").and_then(Value::as_str).is_some_and(|t| !t.is_empty())));
                if has_text {
                    chunks += 1;
                    match last {
                        None => first = Some(at),
                        Some(l) => itl.push(at.duration_since(l).as_secs_f64()),
                    }
                    last = Some(at);
                }
            }
        }
    });
    let status = match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Outcome { error: e.to_string(), prompt_len: prompt.len(), ..Default::default() },
        Err(_) => return Outcome { error: "timed out".into(), prompt_len: prompt.len(), ..Default::default() },
    };
    let end = Instant::now();
    let ok = status == 200 && error.is_empty() && first.is_some();
    if status != 200 && error.is_empty() {
        error = format!("HTTP {status}");
    }
    Outcome {
        ok,
        error,
        prompt_len: prompt.len(),
        output_tokens: usage_tokens.unwrap_or(chunks),
        ttft: first.map_or(0.0, |f| f.duration_since(start).as_secs_f64()),
        itl,
        e2e: end.duration_since(start).as_secs_f64(),
    }
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
