//! Times `schedule()` + `update_from_output()` over many steps with 1,000
//! running decode requests, set up once (for `perf record`; the criterion
//! bench rebuilds the scheduler per sample, so its setup dominates a
//! profile):
//!
//!     cargo run --release -p vellum-scheduler --example steps -- [steps] [fcfs|two-level]
//!
//! Steps are timed in rounds of 100; the fastest round and the median are
//! printed (this workload is bound by cache misses, so a neighbour's memory
//! traffic moves single rounds by 2×). For figures free of that noise, count
//! instructions and simulated L2 misses instead, e.g. the difference between
//! `valgrind --tool=cachegrind --cache-sim=yes --LL=524288,8,64` runs of 100
//! and 300 steps (docs/benchmarks.md, "Scheduler").

use std::time::Instant;
use vellum_base::{RequestId, SamplingParams, SchedulerConfig, SchedulingPolicy};
use vellum_kvcache::{KvCacheManager, KvCacheManagerConfig};
use vellum_scheduler::{NewRequest, RequestSamples, Scheduler, StepSamples};

const NUM_REQUESTS: usize = 1000;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2000).max(1);
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
    let mut fewest = NUM_REQUESTS;
    let mut rounds = Vec::new();
    for chunk in (0..steps).collect::<Vec<_>>().chunks(100) {
        let start = Instant::now();
        for _ in chunk {
            let out = s.schedule();
            fewest = fewest.min(out.scheduled.len());
            s.update_from_output(&samples);
        }
        rounds.push(start.elapsed().as_secs_f64() * 1e6 / chunk.len() as f64);
    }
    rounds.sort_by(f64::total_cmp);
    let (best, median) = (rounds[0], rounds[rounds.len() / 2]);
    println!(
        "{best:.1} µs per step at best, {median:.1} median ({policy:?}: {steps} steps in rounds of 100, {NUM_REQUESTS} running, at least {fewest} scheduled)"
    );
}
