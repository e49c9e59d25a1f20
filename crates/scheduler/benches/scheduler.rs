//! `schedule()` + `update_from_output()` with 1,000 running decode requests
//! (figures in docs/benchmarks.md; target < 100 µs per step).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use vellum_base::{RequestId, SamplingParams, SchedulerConfig};
use vellum_kvcache::{KvCacheManager, KvCacheManagerConfig};
use vellum_scheduler::{NewRequest, RequestSamples, Scheduler, StepSamples};

const NUM_REQUESTS: usize = 1000;
const STEPS: usize = 16;

fn setup(policy: vellum_base::SchedulingPolicy) -> (Scheduler<KvCacheManager>, StepSamples) {
    let config = SchedulerConfig {
        max_num_seqs: NUM_REQUESTS,
        max_num_batched_tokens: 64 * NUM_REQUESTS,
        max_model_len: 4096,
        policy,
        ..SchedulerConfig::default()
    };
    let kv = KvCacheManager::new(KvCacheManagerConfig::new(NUM_REQUESTS * 128, 16));
    let mut s = Scheduler::new(config, kv).unwrap();
    for i in 0..NUM_REQUESTS {
        let prompt: Vec<u32> = (0..64).map(|t| (t + i * 64) as u32).collect();
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(1000) };
        s.add_request(NewRequest::new(RequestId(i as u64), prompt, params)).unwrap();
    }
    // Prefill everything (two-level admits a staging batch at a time).
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
    assert_eq!(s.num_running(), NUM_REQUESTS);
    // From here on every request decodes one token per step.
    assert_eq!(s.schedule().scheduled.len(), NUM_REQUESTS, "all decode together");
    s.update_from_output(&StepSamples { requests: all.clone() });
    (s, StepSamples { requests: all })
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler");
    g.sample_size(20);
    for (name, policy) in
        [("fcfs", vellum_base::SchedulingPolicy::Fcfs), ("two_level", vellum_base::SchedulingPolicy::TwoLevel { staging_queue_size: 8 })]
    {
        g.bench_function(format!("{name}_1000_running_x{STEPS}_steps"), |b| {
            b.iter_batched(
                || setup(policy),
                |(mut s, samples)| {
                    for _ in 0..STEPS {
                        let out = s.schedule();
                        assert_eq!(out.scheduled.len(), NUM_REQUESTS);
                        s.update_from_output(&samples);
                    }
                    s
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
