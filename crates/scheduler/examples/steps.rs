//! Times `schedule()` + `update_from_output()` over many steps with 1,000
//! running decode requests, set up once (for `perf record`; the criterion
//! bench rebuilds the scheduler per sample, so its setup dominates a
//! profile):
//!
//!     cargo run --release -p vellum-scheduler --example steps -- [steps] [fcfs|two-level]

use std::time::Instant;
use vellum_core::{RequestId, SamplingParams, SchedulerConfig, SchedulingPolicy};
use vellum_kvcache::{KvCacheManager, KvCacheManagerConfig};
use vellum_scheduler::{NewRequest, RequestSamples, Scheduler, StepSamples};

const NUM_REQUESTS: usize = 1000;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2000);
    let policy = match args.get(2).map(String::as_str) {
        Some("two-level") => SchedulingPolicy::TwoLevel { staging_queue_size: 8 },
        _ => SchedulingPolicy::Fcfs,
    };
    let config = SchedulerConfig {
        max_num_seqs: NUM_REQUESTS,
        max_num_batched_tokens: 64 * NUM_REQUESTS,
        max_model_len: 1 << 16,
        policy,
        ..SchedulerConfig::default()
    };
    let kv = KvCacheManager::new(KvCacheManagerConfig::new(NUM_REQUESTS * (steps / 16 + 8), 16));
    let mut s = Scheduler::new(config, kv).expect("valid config");
    for i in 0..NUM_REQUESTS {
        let prompt: Vec<u32> = (0..64).map(|t| (t + i * 64) as u32).collect();
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(steps + 16) };
        s.add_request(NewRequest::new(RequestId(i as u64), prompt, params)).expect("accepted");
    }
    let mut all = Vec::new();
    while s.num_running() < NUM_REQUESTS || s.num_waiting() > 0 {
        let out = s.schedule();
        let requests: Vec<RequestSamples> =
            out.scheduled.iter().map(|x| RequestSamples::tokens(x.request_id, vec![(x.seq_id, 7)])).collect();
        s.update_from_output(&StepSamples { requests });
        all.extend(
            out.scheduled.iter().filter(|x| x.num_computed_tokens == 0).map(|x| RequestSamples::tokens(x.request_id, vec![(x.seq_id, 7)])),
        );
    }
    let samples = StepSamples { requests: all };
    let (start, mut fewest) = (Instant::now(), NUM_REQUESTS);
    for _ in 0..steps {
        let out = s.schedule();
        fewest = fewest.min(out.scheduled.len());
        s.update_from_output(&samples);
    }
    let per_step = start.elapsed().as_secs_f64() / steps as f64;
    println!("{policy:?}: {steps} steps with {NUM_REQUESTS} running (at least {fewest} scheduled): {:.1} µs per step", per_step * 1e6);
}
