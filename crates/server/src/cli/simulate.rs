//! `vellum simulate`: one simulation (`--json` prints one object), or the
//! whole paper reproduction (`--reproduce-paper`).

use anyhow::{anyhow, Result};
use clap::Args;
use std::path::PathBuf;
use vellum_base::SchedulingPolicy;
use vellum_simulator::{
    calibrate, simulate, AllocatorKind, SimConfig, SimReport, Workload, PAPER_FIG13A_RATIO_VS_MAX, PAPER_FIG13A_RATIO_VS_ORACLE,
};

/// Arguments of `vellum simulate`.
#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// Length distribution: sharegpt | alpaca | fixed:IN:OUT (every request
    /// IN prompt and OUT output tokens, as `bench serve` sends them).
    #[arg(long, default_value = "sharegpt")]
    pub workload: String,
    /// Closed-loop clients instead of Poisson arrivals (`bench serve
    /// --max-concurrency`): this many requests in flight, each client
    /// sending its next as its last one finishes (--request-rate and
    /// --duration-s then do not apply).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Requests the closed-loop clients send in all.
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// Poisson arrival rate, requests per second.
    #[arg(long, default_value_t = 1.0)]
    pub request_rate: f64,
    /// Arrivals span this many simulated seconds.
    #[arg(long, default_value_t = 600.0)]
    pub duration_s: f64,
    /// KV-cache capacity in token slots (paper Table 1, OPT-13B on one A100: 15.7K).
    #[arg(long, default_value_t = 15_700)]
    pub kv_slots: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// paged | orca-max | orca-pow2 | orca-oracle.
    #[arg(long, default_value = "paged")]
    pub allocator: String,
    /// Parallel samples per request.
    #[arg(long, default_value_t = 1, conflicts_with = "beam_width")]
    pub n: usize,
    /// Beam search width (0 = off).
    #[arg(long, default_value_t = 0)]
    pub beam_width: usize,
    /// Trace seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Scheduling policy: fcfs | two-level | priority.
    #[arg(long, default_value = "fcfs")]
    pub policy: String,
    /// Step cost: opt13b-a100 (the paper's setup, fitted to its Fig. 13a),
    /// llama3-8b-h100 (bf16 on one H100, from bandwidth and FLOPs) or
    /// vellum-llama3-8b-q8-h100 (Vellum's own steps of that shape in Q8_0 on
    /// an H100, fitted to its measured decode and prefill rates).
    #[arg(long, default_value = "opt13b-a100")]
    pub cost_model: String,
    /// Most sequences in one step.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one step (the paper's vLLM: 2560).
    #[arg(long, default_value_t = 2560)]
    pub max_num_batched_tokens: usize,
    /// Split long prompts across steps and mix them with decodes (off in
    /// the paper's vLLM).
    #[arg(long)]
    pub enable_chunked_prefill: bool,
    /// Most tokens one prompt may take in a step (0: only the budget).
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: usize,
    /// Most tokens all prefills together (prompts, and recomputations after
    /// a preemption) may take in a step beside its decodes (0: only the
    /// budget; `vellum serve` on a GPU sets it by the model's size).
    #[arg(long, default_value_t = 0)]
    pub max_num_prefill_tokens: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Run every experiment of docs/paper-reproduction.md and rewrite it,
    /// with figures and JSON, under --out-dir.
    #[arg(long)]
    pub reproduce_paper: bool,
    /// Fit the cost model's time scale to the paper's Fig. 13a (paged
    /// batches 2.2× Orca (Oracle) on ShareGPT at 2 req/s) and print it.
    #[arg(long)]
    pub calibrate: bool,
    /// Where --reproduce-paper writes (paper-reproduction.md and figures/).
    #[arg(long, default_value = "docs")]
    pub out_dir: PathBuf,
}

/// Builds the simulation config the arguments describe.
pub fn config_from(args: &SimulateArgs) -> Result<SimConfig> {
    let workload = Workload::parse(&args.workload)
        .ok_or_else(|| anyhow!("--workload must be sharegpt, alpaca or fixed:IN:OUT, got {:?}", args.workload))?;
    if args.max_concurrency == Some(0) || args.num_prompts == 0 {
        return Err(anyhow!("--max-concurrency and --num-prompts must be at least 1"));
    }
    let allocator = AllocatorKind::parse(&args.allocator)
        .ok_or_else(|| anyhow!("--allocator must be paged, orca-max, orca-pow2 or orca-oracle, got {:?}", args.allocator))?;
    let policy = match args.policy.as_str() {
        "fcfs" => SchedulingPolicy::Fcfs,
        "two-level" => SchedulingPolicy::TwoLevel { staging_queue_size: 8 },
        "priority" => SchedulingPolicy::Priority,
        other => return Err(anyhow!("--policy must be fcfs, two-level or priority, got {other:?}")),
    };
    if !(args.request_rate > 0.0 && args.request_rate.is_finite()) {
        return Err(anyhow!("--request-rate must be positive, got {}", args.request_rate));
    }
    if !(args.duration_s > 0.0 && args.duration_s.is_finite()) {
        return Err(anyhow!("--duration-s must be positive, got {}", args.duration_s));
    }
    if !args.block_size.is_power_of_two() || args.kv_slots < args.block_size {
        return Err(anyhow!("--block-size must be a power of two no larger than --kv-slots"));
    }
    if args.n == 0 {
        return Err(anyhow!("--n must be at least 1"));
    }
    let cost_model = vellum_simulator::CostModel::named(&args.cost_model).ok_or_else(|| {
        anyhow!("--cost-model must be opt13b-a100, llama3-8b-h100 or vellum-llama3-8b-q8-h100, got {:?}", args.cost_model)
    })?;
    let base = SimConfig::default();
    let scheduler = vellum_base::SchedulerConfig {
        policy,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        enable_chunked_prefill: args.enable_chunked_prefill,
        long_prefill_token_threshold: args.long_prefill_token_threshold,
        max_num_prefill_tokens: args.max_num_prefill_tokens,
        ..base.scheduler.clone()
    };
    scheduler.validate().map_err(|e| anyhow!("{e}"))?;
    Ok(SimConfig {
        workload,
        request_rate: args.request_rate,
        duration_s: args.duration_s,
        kv_slots: args.kv_slots,
        block_size: args.block_size,
        allocator,
        n: args.n,
        beam_width: args.beam_width,
        seed: args.seed,
        scheduler,
        cost_model,
        max_concurrency: args.max_concurrency,
        num_prompts: args.num_prompts,
        ..base
    })
}

/// Runs `vellum simulate`.
pub fn run(args: SimulateArgs) -> Result<()> {
    if args.reproduce_paper {
        return super::paper_reproduction::run(&super::paper_reproduction::ReproductionArgs {
            out_dir: args.out_dir,
            duration_s: args.duration_s,
            seed: args.seed,
            kv_slots: args.kv_slots,
            block_size: args.block_size,
        });
    }
    if args.calibrate {
        let base = SimConfig {
            duration_s: args.duration_s,
            seed: args.seed,
            kv_slots: args.kv_slots,
            block_size: args.block_size,
            ..SimConfig::default()
        };
        let c = calibrate(&base, PAPER_FIG13A_RATIO_VS_ORACLE);
        if args.json {
            println!("{}", serde_json::to_string(&c)?);
        } else {
            println!(
                "time scale {:.2} over the first-principles model ({} simulations): {:.1} ms per step + {:.3} ms per batched token + {:.2} µs per context token",
                c.time_scale,
                c.simulations,
                c.cost_model.fixed_s * 1e3,
                c.cost_model.per_token_s * 1e3,
                c.cost_model.per_context_token_s * 1e6
            );
            println!(
                "ShareGPT @ 2 req/s: paged {:.1}, Orca (Oracle) {:.1}, Orca (Max) {:.1} batched requests: {:.2}× / {:.2}× (paper {PAPER_FIG13A_RATIO_VS_ORACLE}× / {PAPER_FIG13A_RATIO_VS_MAX}×)",
                c.paged_batched,
                c.oracle_batched,
                c.max_batched,
                c.ratio_vs_oracle(),
                c.ratio_vs_max()
            );
        }
        return Ok(());
    }
    let config = config_from(&args)?;
    let report = simulate(&config);
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
    }
    if report.num_finished < report.num_requests {
        // The scheduler ran out of anything to schedule with requests left:
        // a stall the figures above do not show.
        tracing::warn!(
            unfinished = report.num_requests - report.num_finished,
            "the simulation stopped with requests unfinished: nothing could be scheduled"
        );
    }
    Ok(())
}

fn print_table(r: &SimReport) {
    println!(
        "workload {:?}, allocator {}, {:.2} req/s: {} requests ({} finished)",
        r.workload,
        r.allocator.name(),
        r.request_rate,
        r.num_requests,
        r.num_finished
    );
    println!(
        "  KV utilization      mean {:.1}%  p1 {:.1}%  p99 {:.1}%",
        100.0 * r.kv_utilization_mean,
        100.0 * r.kv_utilization_p1,
        100.0 * r.kv_utilization_p99
    );
    println!("  batched requests    {:.1} per step", r.avg_batched_requests);
    println!("  normalized latency  {:.3} s/token", r.normalized_latency_mean_s);
    println!("  sharing savings     {:.1}%", 100.0 * r.sharing_savings);
    println!("  preemptions         {}", r.num_preemptions);
    println!("  output tokens/s     {:.0}", r.output_tokens_per_s);
    println!("  time to 1st token   median {:.1} ms  p99 {:.1} ms", 1e3 * r.ttft_median_s, 1e3 * r.ttft_p99_s);
    println!(
        "  inter-token         median {:.1} ms  p99 {:.1} ms ({:.1}× the median)",
        1e3 * r.itl_median_s,
        1e3 * r.itl_p99_s,
        r.itl_p99_s / r.itl_median_s.max(f64::MIN_POSITIVE)
    );
}
