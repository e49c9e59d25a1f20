//! Micro-benchmarks of the KV-cache manager (figures in docs/benchmarks.md).
//!
//! * `append_10k_seqs`: 10,000 live sequences (32-token prompts) each append
//!   16 decode tokens through `allocate_slots`, then all are freed. Reported
//!   per appended token (throughput in elements = tokens).
//! * `prefix_lookup_4k`: `get_computed_blocks` on a 4,096-token prompt whose
//!   256 blocks are all cached.

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use vellum_base::{BlockAllocator, ComputedBlocks, LengthHint, SeqId, SeqTokens};
use vellum_kvcache::{KvCacheManager, KvCacheManagerConfig};

const NUM_SEQS: usize = 10_000;
const PROMPT: usize = 32;
const DECODE: usize = 16;
const HINT: LengthHint = LengthHint { max_total_tokens: 2048, true_total_tokens: None };

fn st(id: usize, tokens: &[u32], num_computed: usize) -> SeqTokens<'_> {
    SeqTokens { seq_id: SeqId(id as u64), token_ids: tokens, num_prompt_tokens: PROMPT, num_computed_tokens: num_computed, hint: HINT }
}

fn prefilled() -> (KvCacheManager, Vec<Vec<u32>>) {
    let mut m = KvCacheManager::new(KvCacheManagerConfig::new(NUM_SEQS * 4, 16));
    let mut seqs = Vec::with_capacity(NUM_SEQS);
    for i in 0..NUM_SEQS {
        let mut toks: Vec<u32> = (0..PROMPT as u32).map(|t| t + i as u32 * 7).collect();
        toks.reserve(DECODE);
        m.allocate_slots(&st(i, &toks, 0), PROMPT, ComputedBlocks::default()).unwrap();
        seqs.push(toks);
    }
    (m, seqs)
}

fn append(c: &mut Criterion) {
    let mut g = c.benchmark_group("kvcache");
    g.sample_size(10);
    g.throughput(Throughput::Elements((NUM_SEQS * DECODE) as u64));
    g.bench_function("append_10k_seqs", |b| {
        b.iter_batched(
            prefilled,
            |(mut m, mut seqs)| {
                for step in 0..DECODE {
                    for (i, toks) in seqs.iter_mut().enumerate() {
                        toks.push(step as u32);
                        let computed = toks.len() - 1;
                        black_box(m.allocate_slots(&st(i, toks, computed), 1, ComputedBlocks::default()));
                    }
                }
                for i in 0..NUM_SEQS {
                    m.free(SeqId(i as u64));
                }
                m
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn prefix_lookup(c: &mut Criterion) {
    let mut m = KvCacheManager::new(KvCacheManagerConfig::new(1024, 16));
    let prompt: Vec<u32> = (0..4097).map(|t| (t * 31 % 49152) as u32).collect();
    let s = SeqTokens { seq_id: SeqId(0), token_ids: &prompt, num_prompt_tokens: prompt.len(), num_computed_tokens: 0, hint: HINT };
    m.allocate_slots(&s, prompt.len(), ComputedBlocks::default()).unwrap();
    m.free(SeqId(0));
    let s = SeqTokens { seq_id: SeqId(1), ..s };
    assert_eq!(m.get_computed_blocks(&s).num_computed_tokens, 4096);
    let mut g = c.benchmark_group("kvcache");
    g.bench_function("prefix_lookup_4k", |b| b.iter(|| black_box(m.get_computed_blocks(black_box(&s)))));
    g.finish();
}

criterion_group!(benches, append, prefix_lookup);
criterion_main!(benches);
