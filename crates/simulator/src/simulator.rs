//! Runs a trace through the real scheduler and an allocator in simulated time.

use crate::cost_model::CostModel;
use crate::workload::{generate_requests, generate_trace, Workload};
use serde::Serialize;
use std::collections::HashMap;
use vellum_base::SeededRng as Rng;
use vellum_base::{BeamSearchParams, BlockAllocator, RequestId, SamplingParams, SchedulerConfig, SchedulingPolicy, SeqId, TokenId};
use vellum_kvcache::{KvCacheManager, KvCacheManagerConfig, OrcaAllocator, OrcaMode};
use vellum_scheduler::{NewRequest, RequestSamples, Scheduler, StepSamples};

/// Which allocator manages the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AllocatorKind {
    /// PagedAttention's block manager.
    Paged,
    /// Orca reserving `max_model_len`.
    OrcaMax,
    /// Orca reserving the output rounded up to a power of two.
    OrcaPow2,
    /// Orca reserving the true length.
    OrcaOracle,
}

impl AllocatorKind {
    /// Parses `paged`, `orca-max`, `orca-pow2`, `orca-oracle`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "paged" => Some(Self::Paged),
            "orca-max" => Some(Self::OrcaMax),
            "orca-pow2" => Some(Self::OrcaPow2),
            "orca-oracle" => Some(Self::OrcaOracle),
            _ => None,
        }
    }

    /// The name `parse` accepts.
    pub fn name(self) -> &'static str {
        match self {
            Self::Paged => "paged",
            Self::OrcaMax => "orca-max",
            Self::OrcaPow2 => "orca-pow2",
            Self::OrcaOracle => "orca-oracle",
        }
    }
}

/// One simulation.
#[derive(Clone, Debug, Serialize)]
pub struct SimConfig {
    /// Length distribution.
    pub workload: Workload,
    /// Poisson arrival rate, requests per second.
    pub request_rate: f64,
    /// Arrivals span this many seconds.
    pub duration_s: f64,
    /// KV capacity in token slots (paper Table 1: 15.7K for OPT-13B).
    pub kv_slots: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Allocator.
    pub allocator: AllocatorKind,
    /// Parallel samples per request.
    pub n: usize,
    /// Beam width (0 = no beam search).
    pub beam_width: usize,
    /// Trace seed.
    pub seed: u64,
    /// Longest prompt + output.
    pub max_model_len: usize,
    /// Scheduler budgets and policy.
    #[serde(skip)]
    pub scheduler: SchedulerConfig,
    /// Step cost.
    pub cost_model: CostModel,
    /// Closed-loop clients instead of Poisson arrivals (`vellum bench serve
    /// --max-concurrency`): this many requests in flight, each client
    /// sending its next as its last one finishes, `num_prompts` in all.
    pub max_concurrency: Option<usize>,
    /// Requests the closed-loop clients send in all.
    pub num_prompts: usize,
}

impl Default for SimConfig {
    /// The paper's setting: OPT-13B on one A100, vLLM-0.1-era scheduler
    /// (no chunked prefill, 2560-token budget, 256 sequences).
    fn default() -> Self {
        Self {
            workload: Workload::ShareGpt,
            request_rate: 1.0,
            duration_s: 600.0,
            kv_slots: 15_700,
            block_size: 16,
            allocator: AllocatorKind::Paged,
            n: 1,
            beam_width: 0,
            seed: 0,
            max_model_len: 2048,
            scheduler: SchedulerConfig {
                max_num_seqs: 256,
                max_num_batched_tokens: 2560,
                max_model_len: 2048,
                policy: SchedulingPolicy::Fcfs,
                enable_chunked_prefill: false,
                ..SchedulerConfig::default()
            },
            cost_model: CostModel::default(),
            max_concurrency: None,
            num_prompts: 1000,
        }
    }
}

/// What a simulation measured. Averages over steps are weighted by step time.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    /// Workload name.
    pub workload: Workload,
    /// Allocator name.
    pub allocator: AllocatorKind,
    /// Arrival rate.
    pub request_rate: f64,
    /// Requests in the trace.
    pub num_requests: usize,
    /// Requests that finished before the time cap.
    pub num_finished: usize,
    /// Filled slots over allocated or reserved slots, mean.
    pub kv_utilization_mean: f64,
    /// 99th percentile over steps.
    pub kv_utilization_p99: f64,
    /// 1st percentile over steps (the worst moments).
    pub kv_utilization_p1: f64,
    /// Mean requests per step (paper Fig. 13).
    pub avg_batched_requests: f64,
    /// Mean of (end-to-end latency / output tokens), seconds per token (Fig. 12).
    pub normalized_latency_mean_s: f64,
    /// Blocks saved by sharing over blocks needed without it, mean (Fig. 15).
    pub sharing_savings: f64,
    /// Preemptions.
    pub num_preemptions: u64,
    /// Finished requests per simulated second.
    pub throughput_req_s: f64,
    /// Simulated seconds until the last request finished (or the cap).
    pub simulated_s: f64,
    /// Mean prompt length of the trace.
    pub mean_prompt_len: f64,
    /// Mean output length of the trace.
    pub mean_output_len: f64,
    /// Steps run.
    pub num_steps: u64,
    /// Output tokens per simulated second.
    pub output_tokens_per_s: f64,
    /// Time to first token (arrival to the step that sampled it), median
    /// over the requests that got one before the time cap (an overloaded
    /// run's unserved requests are not in it).
    pub ttft_median_s: f64,
    /// Time to first token, 99th percentile.
    pub ttft_p99_s: f64,
    /// Gaps between a request's successive tokens, median over every gap.
    pub itl_median_s: f64,
    /// Gaps between a request's successive tokens, 99th percentile: what a
    /// long prefill in the same step does to the decodes beside it.
    pub itl_p99_s: f64,
}

/// The `p`-quantile of sorted values (0 for none).
fn quantile(sorted: &[f64], p: f64) -> f64 {
    sorted.get(((sorted.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0)
}

/// Runs one simulation.
pub fn simulate(config: &SimConfig) -> SimReport {
    let num_blocks = config.kv_slots / config.block_size;
    match config.allocator {
        AllocatorKind::Paged => {
            let kv = KvCacheManager::new(KvCacheManagerConfig {
                num_blocks,
                num_host_blocks: num_blocks,
                block_size: config.block_size,
                enable_prefix_caching: true,
                group_windows: vec![None],
            });
            run(config, kv)
        }
        kind => {
            let mode = match kind {
                AllocatorKind::OrcaMax => OrcaMode::Max,
                AllocatorKind::OrcaPow2 => OrcaMode::Pow2,
                _ => OrcaMode::Oracle,
            };
            run(config, OrcaAllocator::new(mode, num_blocks, config.block_size, config.max_model_len))
        }
    }
}

/// Running means weighted by step time.
#[derive(Default)]
struct Accumulator {
    weight: f64,
    utilization: f64,
    batched: f64,
    savings: f64,
    samples: Vec<f64>,
}

fn run<A: BlockAllocator>(config: &SimConfig, allocator: A) -> SimReport {
    let mut trace = match config.max_concurrency {
        Some(_) => generate_requests(config.workload, config.num_prompts, config.max_model_len, config.seed),
        None => generate_trace(config.workload, config.request_rate, config.duration_s, config.max_model_len, config.seed),
    };
    // Closed loop: requests in flight (a client is free when one finishes).
    let mut in_flight = 0usize;
    let sched_config = SchedulerConfig { max_model_len: config.max_model_len, ..config.scheduler.clone() };
    let mut sched = Scheduler::new(sched_config, allocator).expect("simulator config is valid");
    sched.keep_finished_requests(false);
    let mut rng = Rng::new(config.seed.wrapping_add(1));
    let mut acc = Accumulator::default();
    let mut arrival: HashMap<RequestId, (f64, usize)> = HashMap::new();
    let mut normalized = Vec::new();
    // Per request, when its latest token was sampled; every gap; every TTFT.
    let mut last_token: HashMap<RequestId, f64> = HashMap::new();
    let (mut itl, mut ttft, mut output_tokens) = (Vec::new(), Vec::new(), 0u64);
    // Requests whose first sample was drawn (parallel samples, beams).
    let mut forked: std::collections::HashSet<RequestId> = std::collections::HashSet::new();
    let (mut t, mut next, mut num_steps) = (0.0f64, 0usize, 0u64);
    let time_cap = match config.max_concurrency {
        Some(_) => f64::INFINITY,
        None => config.duration_s * 20.0 + 600.0,
    };
    while t < time_cap {
        loop {
            let due = match config.max_concurrency {
                Some(clients) => in_flight < clients,
                None => trace.get(next).is_some_and(|r| r.arrival_s <= t),
            };
            if !due || next >= trace.len() {
                break;
            }
            if config.max_concurrency.is_some() {
                trace[next].arrival_s = t;
            }
            let r = trace[next];
            let id = RequestId(next as u64);
            let prompt: Vec<TokenId> = (0..r.prompt_len).map(|_| 3 + rng.below(49_000) as TokenId).collect();
            let params = SamplingParams {
                n: config.n,
                max_tokens: Some(r.output_len),
                ignore_eos: true,
                beam_search: (config.beam_width > 0).then_some(BeamSearchParams { beam_width: config.beam_width, length_penalty: 1.0 }),
                temperature: if config.beam_width > 0 { 0.0 } else { 1.0 },
                ..SamplingParams::default()
            };
            let req = NewRequest {
                arrival_time: r.arrival_s,
                true_total_tokens: Some(r.prompt_len + r.output_len),
                ..NewRequest::new(id, prompt, params)
            };
            if sched.add_request(req).is_ok() {
                arrival.insert(id, (r.arrival_s, r.output_len));
                in_flight += 1;
            }
            next += 1;
        }
        let out = sched.schedule();
        if out.is_empty() {
            sched.update_from_output(&StepSamples::default());
            if next < trace.len() && config.max_concurrency.is_none() {
                t = t.max(trace[next].arrival_s);
                continue;
            }
            break; // nothing runnable and nothing to come
        }
        let stats = sched.allocator().stats();
        let num_context: usize = out.scheduled.iter().map(|s| s.num_computed_tokens + s.num_scheduled_tokens).sum();
        let dt = config.cost_model.step_time(out.num_scheduled_tokens(), num_context);
        acc.weight += dt;
        acc.utilization += dt * stats.utilization();
        acc.samples.push(stats.utilization());
        acc.batched += dt * out.num_scheduled_requests() as f64;
        acc.savings += dt * stats.sharing_savings();
        t += dt;
        num_steps += 1;
        // The fake executor samples: random tokens; beams pick random parents.
        let mut per_req: HashMap<RequestId, Vec<SeqId>> = HashMap::new();
        for s in out.scheduled.iter().filter(|s| s.samples) {
            per_req.entry(s.request_id).or_default().push(s.seq_id);
        }
        let mut requests = Vec::with_capacity(per_req.len());
        for &id in per_req.keys() {
            match last_token.insert(id, t) {
                Some(prev) => itl.push(t - prev),
                None => ttft.push(t - arrival.get(&id).map_or(t, |a| a.0)),
            }
        }
        for (id, seqs) in per_req {
            let width = if config.beam_width > 0 { config.beam_width } else { config.n };
            let first = width > 1 && forked.insert(id);
            let next_tokens: Vec<(SeqId, TokenId)> = if config.beam_width > 0 || first {
                (0..width).map(|_| (seqs[rng.below(seqs.len())], 3 + rng.below(49_000) as TokenId)).collect()
            } else {
                seqs.iter().map(|&s| (s, 3 + rng.below(49_000) as TokenId)).collect()
            };
            output_tokens += next_tokens.len() as u64;
            requests.push(RequestSamples::tokens(id, next_tokens));
        }
        let update = sched.update_from_output(&StepSamples { requests });
        for (id, _) in &update.finished_requests {
            last_token.remove(id);
            in_flight = in_flight.saturating_sub(1);
            if let Some((at, out_len)) = arrival.get(id) {
                normalized.push((t - at) / (*out_len).max(1) as f64);
            }
        }
    }
    acc.samples.sort_by(f64::total_cmp);
    itl.sort_by(f64::total_cmp);
    ttft.sort_by(f64::total_cmp);
    let pct = |p: f64| if acc.samples.is_empty() { 1.0 } else { quantile(&acc.samples, p) };
    let w = acc.weight.max(f64::MIN_POSITIVE);
    let n = trace.len().max(1) as f64;
    SimReport {
        workload: config.workload,
        allocator: config.allocator,
        request_rate: config.request_rate,
        num_requests: trace.len(),
        num_finished: normalized.len(),
        kv_utilization_mean: acc.utilization / w,
        kv_utilization_p99: pct(0.99),
        kv_utilization_p1: pct(0.01),
        avg_batched_requests: acc.batched / w,
        normalized_latency_mean_s: normalized.iter().sum::<f64>() / normalized.len().max(1) as f64,
        sharing_savings: acc.savings / w,
        num_preemptions: sched.num_preemptions(),
        throughput_req_s: normalized.len() as f64 / t.max(f64::MIN_POSITIVE),
        simulated_s: t,
        mean_prompt_len: trace.iter().map(|r| r.prompt_len).sum::<usize>() as f64 / n,
        mean_output_len: trace.iter().map(|r| r.output_len).sum::<usize>() as f64 / n,
        num_steps,
        output_tokens_per_s: output_tokens as f64 / t.max(f64::MIN_POSITIVE),
        ttft_median_s: quantile(&ttft, 0.5),
        ttft_p99_s: quantile(&ttft, 0.99),
        itl_median_s: quantile(&itl, 0.5),
        itl_p99_s: quantile(&itl, 0.99),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(kind: AllocatorKind) -> SimReport {
        simulate(&SimConfig { allocator: kind, duration_s: 60.0, request_rate: 1.0, ..SimConfig::default() })
    }

    /// A cap on the tokens one prompt takes per step keeps the decode steps
    /// beside a long prefill short (lower p99 inter-token latency) and
    /// makes that prompt wait longer for its first token; the work done is
    /// the same.
    #[test]
    fn a_prefill_chunk_cap_trades_time_to_first_token_for_steadier_decodes() {
        let run = |threshold| {
            simulate(&SimConfig {
                request_rate: 20.0,
                duration_s: 30.0,
                kv_slots: 400_000,
                cost_model: CostModel::llama3_8b_h100(),
                scheduler: SchedulerConfig {
                    max_num_seqs: 256,
                    max_num_batched_tokens: 2048,
                    enable_chunked_prefill: true,
                    long_prefill_token_threshold: threshold,
                    ..SchedulerConfig::default()
                },
                ..SimConfig::default()
            })
        };
        let (free, capped) = (run(0), run(128));
        assert_eq!(free.num_finished, free.num_requests);
        assert!(free.itl_median_s > 0.0 && free.itl_p99_s > free.itl_median_s, "{free:?}");
        assert!(capped.itl_p99_s < 0.8 * free.itl_p99_s, "p99 ITL {} → {}", free.itl_p99_s, capped.itl_p99_s);
        assert!(capped.ttft_p99_s > free.ttft_p99_s, "p99 TTFT {} → {}", free.ttft_p99_s, capped.ttft_p99_s);
        let work = |r: &SimReport| r.output_tokens_per_s * r.simulated_s;
        assert!((work(&free) - work(&capped)).abs() < 1.0, "the same tokens: {} vs {}", work(&free), work(&capped));
    }

    /// Closed-loop clients with fixed lengths (`bench serve
    /// --max-concurrency 64 --input-len 128 --output-len 128`): never more
    /// requests in flight than clients, every request served whole; they
    /// start together, so prompts arrive in waves, and the first requests
    /// of a wave wait out its prefill chunks between their first tokens: a
    /// smaller step budget cuts that tail of the inter-token gaps.
    #[test]
    fn closed_loop_clients_send_waves_whose_prefill_sets_the_inter_token_tail() {
        let run = |budget| {
            simulate(&SimConfig {
                workload: Workload::Fixed { prompt_len: 128, output_len: 128 },
                max_concurrency: Some(64),
                num_prompts: 256,
                kv_slots: 400_000,
                cost_model: CostModel::vellum_llama3_8b_q8_h100(),
                scheduler: SchedulerConfig {
                    max_num_seqs: 256,
                    max_num_batched_tokens: budget,
                    enable_chunked_prefill: true,
                    ..SchedulerConfig::default()
                },
                ..SimConfig::default()
            })
        };
        let (wide, narrow) = (run(2048), run(512));
        for r in [&wide, &narrow] {
            assert_eq!((r.num_requests, r.num_finished), (256, 256), "{r:?}");
            assert!(r.avg_batched_requests <= 64.0 + 1e-9, "{r:?}");
            assert!((r.output_tokens_per_s * r.simulated_s - 256.0 * 128.0).abs() < 1.0, "{r:?}");
        }
        let ratio = |r: &SimReport| r.itl_p99_s / r.itl_median_s;
        assert!(ratio(&wide) > 3.0, "a wave's 2048-token steps stretch the gaps: {}", ratio(&wide));
        assert!(ratio(&narrow) < 0.6 * ratio(&wide), "{} against {}", ratio(&narrow), ratio(&wide));
        assert!(narrow.ttft_p99_s > wide.ttft_p99_s, "the wave's last prompts wait longer: {} vs {}", narrow.ttft_p99_s, wide.ttft_p99_s);
    }

    #[test]
    fn paged_beats_every_orca_baseline_on_memory() {
        let paged = small(AllocatorKind::Paged);
        assert_eq!(paged.num_finished, paged.num_requests, "light load: all finish");
        assert!(paged.kv_utilization_mean > 0.9, "{}", paged.kv_utilization_mean);
        for kind in [AllocatorKind::OrcaOracle, AllocatorKind::OrcaPow2, AllocatorKind::OrcaMax] {
            let o = small(kind);
            assert!(o.kv_utilization_mean < paged.kv_utilization_mean, "{kind:?}: {}", o.kv_utilization_mean);
        }
    }

    /// Preemption by recompute under a prefill budget: a parallel request's
    /// sequences and a beam search's candidates recompute while the budget
    /// is spent by others, and every request still finishes (a group that
    /// failed whole every step once stalled the run: 67 of 110 finished).
    #[test]
    fn groups_recomputing_under_a_prefill_budget_all_finish() {
        let base = SimConfig { workload: Workload::ShareGpt, duration_s: 60.0, request_rate: 2.0, ..SimConfig::default() };
        let scheduler = SchedulerConfig { enable_chunked_prefill: true, max_num_batched_tokens: 2048, ..base.scheduler.clone() };
        for (n, beam_width) in [(4, 0), (1, 2), (1, 4)] {
            for max_num_prefill_tokens in [256, 512] {
                let scheduler = SchedulerConfig { max_num_prefill_tokens, ..scheduler.clone() };
                let r = simulate(&SimConfig { n, beam_width, scheduler, ..base.clone() });
                assert!(r.num_preemptions > 0, "n {n} beams {beam_width}: the pool is small enough to preempt");
                assert_eq!(r.num_finished, r.num_requests, "n {n} beams {beam_width}, prefill budget {max_num_prefill_tokens}");
            }
        }
    }

    #[test]
    fn sharing_is_measured_for_parallel_sampling_and_beams() {
        let base = SimConfig { workload: Workload::Alpaca, duration_s: 20.0, request_rate: 2.0, ..SimConfig::default() };
        let par = simulate(&SimConfig { n: 4, ..base.clone() });
        let beam = simulate(&SimConfig { beam_width: 4, ..base });
        assert!(
            par.sharing_savings > 0.0 && beam.sharing_savings > par.sharing_savings,
            "{} {}",
            par.sharing_savings,
            beam.sharing_savings
        );
        assert_eq!(par.num_finished, par.num_requests);
    }
}
