//! Decode attention: paged (blocks in random physical order) against the same
//! kernel over contiguous per-sequence K/V, on the same data.
//!
//! SmolLM2's attention shape: 9 query heads, 3 kv heads, head_dim 64; block
//! size 16; one query per sequence. Criterion ids are
//! `decode/{paged,contiguous}/ctx{C}_b{B}`, so the ratio paged/contiguous of
//! each case reads off two adjacent lines. Two cases also run with the cache
//! stored as f16 and bf16 (`decode/paged_{f16,bf16}/…`; same data, rounded),
//! the kernel widening each tile to f32. Gemma 3 270M's shape (4 query
//! heads sharing one kv head of 256) runs as `decode/gemma3_{f32,f16}/…`,
//! and over 18 layers' caches in turn (read from memory, as in a model's
//! step) as `decode/gemma3_f16_18_layers/…`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use std::time::Duration;
use vellum_backend_cpu::kv_cache::{KvCacheLayout, LayerKvCache};
use vellum_backend_cpu::paged_attention::{contiguous_attention, paged_attention, write_kv};
use vellum_base::SeededRng as Rng;
use vellum_base::{AttentionMetadata, AttentionShape, KvCacheDtype, KvScale};

/// (query heads, kv heads, head_dim).
type Heads = (usize, usize, usize);
const SMOLLM2: Heads = (9, 3, 64);
const GEMMA3: Heads = (4, 1, 256);
const BLOCK_SIZE: usize = 16;

/// One decode case: `batch` sequences of `ctx` tokens, both layouts.
struct DecodeCase {
    heads: Heads,
    layout: KvCacheLayout,
    cache: LayerKvCache,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    q: Vec<f32>,
    query_start_loc: Vec<u32>,
    context_lens: Vec<u32>,
    block_tables: Vec<u32>,
    stride: usize,
}

impl DecodeCase {
    fn new(ctx: usize, batch: usize, dtype: KvCacheDtype, heads: Heads) -> Self {
        let (num_heads, num_kv_heads, head_dim) = heads;
        let mut rng = Rng::new(0x5eed ^ (ctx * 1000 + batch) as u64);
        let row = num_kv_heads * head_dim;
        let stride = ctx.div_ceil(BLOCK_SIZE);
        let num_blocks = batch * stride;
        let layout = KvCacheLayout { num_blocks, block_size: BLOCK_SIZE, num_kv_heads, head_dim };

        // Random physical order (Fisher-Yates over all blocks of the batch).
        let mut block_tables: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..block_tables.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            block_tables.swap(i, j);
        }

        let mut cache = LayerKvCache::new(&layout, dtype);
        let mut k = Vec::with_capacity(batch);
        let mut v = Vec::with_capacity(batch);
        for s in 0..batch {
            let ks: Vec<f32> = (0..ctx * row).map(|_| rng.signed_f32()).collect();
            let vs: Vec<f32> = (0..ctx * row).map(|_| rng.signed_f32()).collect();
            let table = &block_tables[s * stride..(s + 1) * stride];
            let slots: Vec<u32> = (0..ctx).map(|p| table[p / BLOCK_SIZE] * BLOCK_SIZE as u32 + (p % BLOCK_SIZE) as u32).collect();
            write_kv(&mut cache, &layout, &ks, &vs, &slots, KvScale::ONE);
            k.push(ks);
            v.push(vs);
        }
        let q = (0..batch * num_heads * head_dim).map(|_| rng.signed_f32()).collect();
        DecodeCase {
            heads,
            layout,
            cache,
            k,
            v,
            q,
            query_start_loc: (0..=batch as u32).collect(),
            context_lens: vec![ctx as u32; batch],
            block_tables,
            stride,
        }
    }

    fn paged(&self, out: &mut [f32]) {
        let meta = AttentionMetadata {
            block_size: BLOCK_SIZE,
            slot_mapping: &[],
            query_start_loc: &self.query_start_loc,
            context_lens: &self.context_lens,
            block_tables: &self.block_tables,
            block_table_stride: self.stride,
        };
        let (num_heads, num_kv_heads, head_dim) = self.heads;
        let attn = AttentionShape { scale: 0.125, ..AttentionShape::new(num_heads, num_kv_heads, head_dim) };
        paged_attention(out, &self.q, &self.cache, &self.layout, &meta, &attn, KvScale::ONE);
    }

    fn contiguous(&self, out: &mut [f32], k: &[&[f32]], v: &[&[f32]]) {
        let (num_heads, num_kv_heads, head_dim) = self.heads;
        contiguous_attention(out, &self.q, k, v, &self.query_start_loc, num_heads, num_kv_heads, head_dim, 0.125);
    }
}

fn decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode");
    group.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for ctx in [128usize, 512, 1024, 4096] {
        for batch in [1usize, 16, 64] {
            let case = DecodeCase::new(ctx, batch, KvCacheDtype::F32, SMOLLM2);
            let id = format!("ctx{ctx}_b{batch}");
            // K and V bytes read per call.
            group.throughput(Throughput::Bytes((2 * batch * ctx * SMOLLM2.1 * SMOLLM2.2 * 4) as u64));
            let mut out = vec![0.0f32; case.q.len()];
            group.bench_function(BenchmarkId::new("paged", &id), |b| {
                b.iter(|| case.paged(black_box(&mut out)));
            });
            let k: Vec<&[f32]> = case.k.iter().map(Vec::as_slice).collect();
            let v: Vec<&[f32]> = case.v.iter().map(Vec::as_slice).collect();
            group.bench_function(BenchmarkId::new("contiguous", &id), |b| {
                b.iter(|| case.contiguous(black_box(&mut out), &k, &v));
            });
        }
    }
    // Half-precision caches: a batched decode and a single long decode.
    for (ctx, batch) in [(1024usize, 64usize), (4096, 1)] {
        for (name, dtype) in [("paged_f16", KvCacheDtype::F16), ("paged_bf16", KvCacheDtype::Bf16), ("paged_fp8", KvCacheDtype::Fp8E4m3)] {
            let case = DecodeCase::new(ctx, batch, dtype, SMOLLM2);
            group.throughput(Throughput::Bytes((2 * batch * ctx * SMOLLM2.1 * SMOLLM2.2 * dtype.size_bytes()) as u64));
            let mut out = vec![0.0f32; case.q.len()];
            group.bench_function(BenchmarkId::new(name, format!("ctx{ctx}_b{batch}")), |b| {
                b.iter(|| case.paged(black_box(&mut out)));
            });
        }
    }
    // Gemma 3 270M: a query group of 4 on one kv head of 256.
    for (ctx, batch) in [(192usize, 64usize), (1024, 64), (4096, 1)] {
        for (name, dtype) in [("gemma3_f32", KvCacheDtype::F32), ("gemma3_f16", KvCacheDtype::F16), ("gemma3_fp8", KvCacheDtype::Fp8E4m3)] {
            let case = DecodeCase::new(ctx, batch, dtype, GEMMA3);
            group.throughput(Throughput::Bytes((2 * batch * ctx * GEMMA3.1 * GEMMA3.2 * dtype.size_bytes()) as u64));
            let mut out = vec![0.0f32; case.q.len()];
            group.bench_function(BenchmarkId::new(name, format!("ctx{ctx}_b{batch}")), |b| {
                b.iter(|| case.paged(black_box(&mut out)));
            });
        }
    }
    // Gemma 3's 18 layers in turn, each with its own cache (227 MB of f16
    // K/V in all, more than the caches): each call reads its rows from
    // memory, as a model's decode step does.
    let layers: Vec<DecodeCase> = (0..18).map(|_| DecodeCase::new(192, 64, KvCacheDtype::F16, GEMMA3)).collect();
    group.throughput(Throughput::Bytes((18 * 2 * 64 * 192 * GEMMA3.1 * GEMMA3.2 * 2) as u64));
    let mut out = vec![0.0f32; layers[0].q.len()];
    group.bench_function(BenchmarkId::new("gemma3_f16_18_layers", "ctx192_b64"), |b| {
        b.iter(|| {
            for layer in &layers {
                layer.paged(black_box(&mut out));
            }
        });
    });
    group.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
