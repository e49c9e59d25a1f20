//! `vellum bench throughput`: offline throughput in the shape of vLLM's
//! benchmark_throughput (fixed input/output lengths or the ShareGPT-like
//! synthetic lengths; every request is submitted at once).

use super::engine_flags::{EngineDefaults, EngineFlags};
use anyhow::{anyhow, bail, Result};
use clap::{Args, Subcommand};
use serde_json::json;
use vellum_base::{SamplingParams, SeededRng};
use vellum_simulator::{generate_trace, Workload};

/// `vellum bench ...`
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Requests/s and tokens/s of a batch of requests submitted at once.
    Throughput(ThroughputArgs),
    /// Latency of one batch (mean, p50/p90/p99), prefill and decode speed.
    Latency(super::bench_latency::LatencyArgs),
    /// Online serving: Poisson (or fixed-concurrency) load on any
    /// OpenAI-compatible endpoint; TTFT, TPOT, ITL, latency, throughput.
    Serve(super::bench_serve::ServeBenchArgs),
    /// Plots `bench serve --save-result` files: normalized latency against
    /// request rate (the paper's Fig. 12).
    ServePlot(super::bench_serve::ServePlotArgs),
}

/// Arguments of `vellum bench throughput`.
#[derive(Args, Debug)]
pub struct ThroughputArgs {
    /// Model: a .gguf file, a Hugging Face directory, or a short name
    /// (smollm2-135m, the default; gemma3-270m).
    #[arg(long)]
    pub model: Option<String>,
    /// Prompt tokens per request (random ids), unless --dataset is given.
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Generated tokens per request (EOS ignored).
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Requests.
    #[arg(long, default_value_t = 64)]
    pub num_prompts: usize,
    /// `sharegpt` for ShareGPT-like synthetic lengths instead of fixed ones.
    #[arg(long)]
    pub dataset: Option<String>,
    /// Trace seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub engine: EngineFlags,
}

/// Runs `vellum bench ...`.
pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Throughput(args) => throughput(args),
        BenchCommand::Latency(args) => super::bench_latency::run(args),
        BenchCommand::Serve(args) => super::bench_serve::run(args),
        BenchCommand::ServePlot(args) => super::bench_serve::plot(args),
    }
}

fn throughput(args: ThroughputArgs) -> Result<()> {
    let lengths: Vec<(usize, usize)> = match args.dataset.as_deref() {
        None => vec![(args.input_len, args.output_len); args.num_prompts],
        Some("sharegpt") => generate_trace(Workload::ShareGpt, 1e6, f64::MAX, 2048, args.seed)
            .into_iter()
            .take(args.num_prompts)
            .map(|r| (r.prompt_len, r.output_len))
            .collect(),
        Some(other) => bail!("--dataset must be sharegpt, got {other:?}"),
    };
    if lengths.is_empty() || lengths.iter().any(|&(i, o)| i == 0 || o == 0) {
        bail!("--num-prompts, --input-len and --output-len must be positive");
    }
    let engine_args = args.engine.engine_args(args.model.clone(), EngineDefaults::default())?;
    let mut llm = super::load_with_progress(engine_args)?;
    let vocab = llm.tokenizer().vocab_size();
    let mut rng = SeededRng::new(args.seed);
    let started = std::time::Instant::now();
    for &(input, output) in &lengths {
        let prompt = super::random_prompt(&mut rng, vocab, input);
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(output) };
        llm.engine().add_request(prompt, params).map_err(|e| anyhow!("{e}"))?;
    }
    let bar = indicatif::ProgressBar::new(lengths.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} requests {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut outs = Vec::with_capacity(lengths.len());
    let engine = llm.engine();
    while engine.has_unfinished_requests() {
        outs.extend(engine.step().map_err(|e| anyhow!("{e}"))?);
        bar.set_position(outs.len() as u64);
        bar.set_message(format!("{:.0} tok/s", engine.counters().generation_tokens as f64 / started.elapsed().as_secs_f64()));
    }
    outs.extend(engine.take_finished());
    bar.finish_and_clear();
    let elapsed = started.elapsed().as_secs_f64();
    let prompt_tokens: usize = lengths.iter().map(|l| l.0).sum();
    let output_tokens: usize = outs.iter().flat_map(|o| &o.outputs).map(|s| s.token_ids.len()).sum();
    let report = json!({
        "num_requests": outs.len(),
        "elapsed_s": elapsed,
        "requests_per_s": outs.len() as f64 / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) as f64 / elapsed,
        "output_tokens_per_s": output_tokens as f64 / elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "threads": rayon_threads(),
    });
    if args.json {
        println!("{report}");
    } else {
        println!(
            "{} requests in {:.2} s: {:.2} requests/s, {:.1} total tokens/s, {:.1} output tokens/s",
            outs.len(),
            elapsed,
            report["requests_per_s"].as_f64().unwrap_or(0.0),
            report["total_tokens_per_s"].as_f64().unwrap_or(0.0),
            report["output_tokens_per_s"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
