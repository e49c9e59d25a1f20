//! `vellum bench latency`: the latency of one batch, in the shape of vLLM's
//! benchmark_latency (`--batch-size --input-len --output-len`, warm-up and
//! measured iterations; mean and p50/p90/p99).
//!
//! Each iteration also splits its time at the step that produced the
//! batch's first tokens: prefill throughput (prompt tokens / time to first
//! tokens) and decode throughput (tokens after the first / the rest). These
//! are the figures llama.cpp's batched-bench reports, so the two can be
//! compared side by side (benchmarks/).

use super::engine_flags::{EngineDefaults, EngineFlags};
use anyhow::{anyhow, bail, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use std::time::Instant;
use vellum_base::{SamplingParams, SeededRng};

/// Arguments of `vellum bench latency`.
#[derive(Args, Debug)]
pub struct LatencyArgs {
    /// Model: a .gguf file, a Hugging Face directory, or a short name
    /// (smollm2-135m, the default; gemma3-270m).
    #[arg(long)]
    pub model: Option<String>,
    /// Requests in the batch.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Prompt tokens per request (random ordinary token ids).
    #[arg(long, default_value_t = 32)]
    pub input_len: usize,
    /// Generated tokens per request (EOS ignored).
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Unmeasured iterations first.
    #[arg(long, default_value_t = 1)]
    pub num_iters_warmup: usize,
    /// Measured iterations.
    #[arg(long, default_value_t = 3)]
    pub num_iters: usize,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Every request's prompt, instead of random tokens (`--input-len` is
    /// then ignored; after the warm-up the prompt is a prefix-cache hit, so
    /// only the decode figures mean much): a workload whose text matters,
    /// such as speculative decoding's.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Wrap `--prompt` as a user message in the model's chat template.
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// Sampling temperature of every request (0: greedy, the default).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus cut of every request (1: none).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Candidates kept by rank (0: no cut).
    #[arg(long, default_value_t = 0)]
    pub top_k: i32,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub engine: EngineFlags,
}

struct Iteration {
    latency_s: f64,
    first_tokens_s: f64,
}

/// Runs `vellum bench latency`.
pub fn run(args: LatencyArgs) -> Result<()> {
    if args.batch_size == 0 || args.input_len == 0 || args.output_len < 2 || args.num_iters == 0 {
        bail!("--batch-size, --input-len and --num-iters must be positive and --output-len at least 2");
    }
    // The whole batch's prompts fit in one step unless the flags say otherwise.
    let defaults = EngineDefaults {
        max_num_seqs: args.batch_size,
        max_num_batched_tokens: (args.batch_size * args.input_len).max(8192),
        max_model_len: (args.input_len + args.output_len).max(2048),
        step_flop_budget: None,
    };
    let engine_args = args.engine.engine_args(args.model.clone(), defaults)?;
    let mut llm = super::load_with_progress(engine_args)?;
    let vocab = llm.tokenizer().vocab_size();
    let fixed_prompt = match &args.prompt {
        Some(text) => {
            let text = if args.chat {
                llm.render_chat(&[vellum_models::ChatMessage::new("user", text.as_str())]).map_err(|e| anyhow!("{e}"))?
            } else {
                text.clone()
            };
            Some(llm.tokenizer().encode(&text, true).map_err(|e| anyhow!("{e}"))?)
        }
        None => None,
    };
    let input_len = fixed_prompt.as_ref().map_or(args.input_len, Vec::len);
    let mut rng = SeededRng::new(args.seed);
    let total = args.num_iters_warmup + args.num_iters;
    let bar = ProgressBar::new(total as u64);
    bar.set_style(ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} iterations").unwrap_or_else(|_| ProgressStyle::default_bar()));
    let mut iters = Vec::new();
    let counters_before = llm.engine().counters();
    for it in 0..total {
        bar.set_message(if it < args.num_iters_warmup { "warm-up" } else { "measuring" });
        let engine = llm.engine();
        let started = Instant::now();
        for i in 0..args.batch_size {
            // Fresh random prompts every iteration: no prefix-cache hits.
            let prompt = match &fixed_prompt {
                Some(p) => p.clone(),
                None => super::random_prompt(&mut rng, vocab, args.input_len),
            };
            let params = SamplingParams {
                ignore_eos: true,
                temperature: args.temperature,
                top_p: args.top_p,
                top_k: args.top_k,
                // Seeded draws, so that a sampled run repeats.
                seed: (args.temperature > 0.0).then_some(args.seed.wrapping_add((it * args.batch_size + i) as u64)),
                ..SamplingParams::greedy(args.output_len)
            };
            engine.add_request(prompt, params).map_err(|e| anyhow!("{e}"))?;
        }
        let mut first_tokens_s = None;
        let mut seen = 0;
        while engine.has_unfinished_requests() {
            let out = engine.step_streaming().map_err(|e| anyhow!("{e}"))?;
            seen += out.deltas.len();
            if first_tokens_s.is_none() && seen >= args.batch_size {
                first_tokens_s = Some(started.elapsed().as_secs_f64());
            }
        }
        engine.take_finished();
        let latency_s = started.elapsed().as_secs_f64();
        if it >= args.num_iters_warmup {
            iters.push(Iteration { latency_s, first_tokens_s: first_tokens_s.unwrap_or(latency_s) });
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let c = llm.engine().counters();
    let phase = |now: f64, before: f64| now - before;
    let (sched, exec, samp) = (
        phase(c.schedule_s, counters_before.schedule_s),
        phase(c.execute_s, counters_before.execute_s),
        phase(c.sample_s, counters_before.sample_s),
    );
    // Under --async-scheduling most of the scheduling ran beside the
    // forward pass: the share of it that did.
    let overlapped = phase(c.schedule_overlapped_s, counters_before.schedule_overlapped_s);
    let mut lat: Vec<f64> = iters.iter().map(|i| i.latency_s).collect();
    lat.sort_by(f64::total_cmp);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let first: Vec<f64> = iters.iter().map(|i| i.first_tokens_s).collect();
    let decode: Vec<f64> = iters.iter().map(|i| i.latency_s - i.first_tokens_s).collect();
    let b = args.batch_size as f64;
    let report = json!({
        "batch_size": args.batch_size,
        "input_len": input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "sampling": { "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k },
        "avg_latency_s": mean(&lat),
        "p50_latency_s": super::percentile(&lat, 50.0),
        "p90_latency_s": super::percentile(&lat, 90.0),
        "p99_latency_s": super::percentile(&lat, 99.0),
        "prefill_tokens_per_s": b * input_len as f64 / mean(&first),
        "decode_tokens_per_s": b * (args.output_len - 1) as f64 / mean(&decode),
        "time_share": { "schedule": sched / (sched + exec + samp), "execute": exec / (sched + exec + samp), "sample": samp / (sched + exec + samp) },
        "schedule_overlapped": if sched > 0.0 { overlapped / sched } else { 0.0 },
        "async_scheduling": llm.engine().async_scheduling(),
        "threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
        "spec_decode": spec_report(&llm.engine().spec_decode_counters()),
    });
    if args.json {
        println!("{report}");
    } else {
        println!(
            "batch {} × ({} in, {} out): latency avg {:.3} s, p50 {:.3}, p90 {:.3}, p99 {:.3}; prefill {:.1} tok/s, decode {:.1} tok/s; \
             time in schedule {:.2}%, execute {:.2}%, sample {:.2}%",
            args.batch_size,
            input_len,
            args.output_len,
            mean(&lat),
            super::percentile(&lat, 50.0),
            super::percentile(&lat, 90.0),
            super::percentile(&lat, 99.0),
            report["prefill_tokens_per_s"].as_f64().unwrap_or(0.0),
            report["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
            100.0 * sched / (sched + exec + samp),
            100.0 * exec / (sched + exec + samp),
            100.0 * samp / (sched + exec + samp),
        );
        let sd = llm.engine().spec_decode_counters();
        if sd.num_drafts > 0 {
            println!(
                "speculative decoding: {} drafts, {} draft tokens, acceptance rate {:.1}%, mean acceptance length {:.2}",
                sd.num_drafts,
                sd.num_draft_tokens,
                100.0 * sd.acceptance_rate(),
                sd.mean_acceptance_length()
            );
        }
    }
    Ok(())
}

/// The speculative-decoding counters as the benches report them (`null`
/// when nothing was drafted).
pub(crate) fn spec_report(sd: &vellum_engine::SpecDecodeCounters) -> serde_json::Value {
    if sd.num_drafts == 0 {
        return serde_json::Value::Null;
    }
    json!({
        "num_drafts": sd.num_drafts,
        "num_draft_tokens": sd.num_draft_tokens,
        "num_accepted_tokens": sd.num_accepted_tokens,
        "acceptance_rate": sd.acceptance_rate(),
        "mean_acceptance_length": sd.mean_acceptance_length(),
    })
}
