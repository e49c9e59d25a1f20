//! Paged-attention decode bandwidth on a GPU (the CUDA issue's benchmark;
//! paper §7.1, Figure 18a): one query token per sequence, every sequence
//! `context` tokens long, the KV bytes the kernel must read divided by the
//! kernel's time, next to the device's own copy bandwidth.
//!
//! Three layouts of the same kernel and the same data sizes:
//! - `contiguous`: no block table, sequence `s`'s block `b` at
//!   `s · max_blocks + b` (a contiguous per-sequence cache, the baseline);
//! - `paged`: through the block table, blocks in that same order;
//! - `shuffled`: through the block table, blocks drawn at random from the
//!   whole pool (what a long-running server's free list gives).
//!
//! ```text
//! cargo build --release -p vellum-backend-cuda --example attention_bench
//! attention_bench [--quick] > attention.jsonl   # a table on stderr
//! attention_bench --overheads                   # what a launch, an allocation, a copy cost
//! attention_bench --prefill [--quick]            # prefill attention: flash against the decode kernels
//! attention_bench --loads                        # the decode kernels' loads (PagedLoads) side by side
//! ```
//!
//! `--prefill`: one sequence's whole prompt (causal, every position a query,
//! blocks shuffled through the pool, a bf16 cache) attended by flash prefill
//! on tensor cores and by the decode kernels (one thread block per query
//! token and head group, as before flash prefill), in TFLOP/s: Q·Kᵀ and P·V
//! are 4 · head_dim · heads FLOPs for each of the L(L+1)/2 causal pairs.
//!
//! Without a GPU it says so and exits with status 2.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use std::time::Instant;
use vellum_backend_cuda::launch::{
    AttentionParams, AttentionVersion, DeviceAttentionMetadata, Elementwise, Kernels, KvLayout, KvPool, PagedLoads, PoolDtype, QueryLens,
};

/// A model's attention shape.
struct Shape {
    name: &'static str,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Shape {
    /// Causal attention at head_dim^-½, no window or soft-cap, an unscaled cache.
    fn params(&self) -> AttentionParams {
        AttentionParams {
            num_heads: self.heads,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
            softcap: 0.0,
            window: 0,
            kv_scale: vellum_base::KvScale::ONE,
        }
    }
}

const SHAPES: [Shape; 2] = [
    // Llama 3 8B / Mistral 7B: GQA 32/8, 128 dims.
    Shape { name: "llama3-8b", heads: 32, kv_heads: 8, head_dim: 128 },
    // SmolLM2-135M: GQA 9/3, 64 dims.
    Shape { name: "smollm2-135m", heads: 9, kv_heads: 3, head_dim: 64 },
];
const BLOCK: usize = 16;

/// xorshift64*: a reproducible shuffle without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn up<T: cudarc::driver::DeviceRepr>(k: &Kernels, v: &[T]) -> Res<CudaSlice<T>> {
    Ok(k.stream().clone_htod(v)?)
}

/// Milliseconds per call of `f`, timed with CUDA events over `iters` calls
/// after `warmup` calls.
fn time_ms(k: &Kernels, warmup: usize, iters: usize, mut f: impl FnMut() -> Res<()>) -> Res<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let start = k.stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    for _ in 0..iters {
        f()?;
    }
    let end = k.stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    Ok(start.elapsed_ms(&end)? as f64 / iters as f64)
}

/// Device-to-device copy bandwidth in GB/s, counting bytes read and written.
fn copy_bandwidth(k: &Kernels) -> Res<f64> {
    let n = 1usize << 30; // 1 GiB each way
    let src: CudaSlice<u8> = k.stream().alloc_zeros(n)?;
    let mut dst: CudaSlice<u8> = k.stream().alloc_zeros(n)?;
    let ms = time_ms(k, 2, 10, || Ok(k.stream().memcpy_dtod(&src, &mut dst)?))?;
    Ok(2.0 * n as f64 / (ms * 1e6))
}

/// Host-side costs of the executor's building blocks, in µs each: what a
/// decode step of one sequence (a few hundred of each) is made of.
fn overheads(k: &Kernels) -> Res<()> {
    let n = 20_000u32;
    let mut x: CudaSlice<f32> = k.stream().alloc_zeros(1024)?;
    k.elementwise(Elementwise::Scale(1.0), &mut x, 1024)?;
    k.stream().synchronize()?;
    let t = Instant::now();
    for _ in 0..n {
        k.elementwise(Elementwise::Scale(1.0), &mut x, 1024)?;
    }
    let enqueue = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    k.stream().synchronize()?;
    let launch = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    let t = Instant::now();
    for _ in 0..n {
        // SAFETY: never read; freed at once.
        let b: CudaSlice<f32> = unsafe { k.stream().alloc(4096) }?;
        drop(b);
    }
    let alloc = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    let t = Instant::now();
    for _ in 0..n {
        let b: CudaSlice<f32> = k.stream().alloc_zeros(4096)?;
        drop(b);
    }
    let alloc_zeros = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    k.stream().synchronize()?;
    let ids = vec![1i32; 64];
    let t = Instant::now();
    for _ in 0..n / 10 {
        let b = k.stream().clone_htod(&ids)?;
        drop(b);
    }
    let htod = t.elapsed().as_secs_f64() * 1e6 / (n / 10) as f64;
    let logits: CudaSlice<f32> = k.stream().alloc_zeros(49152)?;
    let t = Instant::now();
    for _ in 0..n / 10 {
        let v = k.stream().clone_dtoh(&logits)?;
        k.stream().synchronize()?;
        drop(v);
    }
    let dtoh = t.elapsed().as_secs_f64() * 1e6 / (n / 10) as f64;
    eprintln!(
        "µs each: launch enqueue {enqueue:.2}, launch with GPU time {launch:.2}, alloc+free {alloc:.2}, alloc_zeros+free {alloc_zeros:.2}, 64-int upload {htod:.2}, 49,152-float download + sync {dtoh:.2}"
    );
    println!(
        "{{\"enqueue_us\":{enqueue:.3},\"launch_us\":{launch:.3},\"alloc_free_us\":{alloc:.3},\"alloc_zeros_free_us\":{alloc_zeros:.3},\"htod_64_us\":{htod:.3},\"dtoh_logits_sync_us\":{dtoh:.3}}}"
    );
    Ok(())
}

/// The paged decode kernels' loads ([`PagedLoads`]) side by side: the
/// shuffled layout of the decode benchmark's largest cases, each load
/// choice in two mirrored rounds (the best of two), GB/s and the share of
/// the device's copy bandwidth.
fn loads(k: &mut Kernels) -> Res<()> {
    let copy = copy_bandwidth(k)?;
    eprintln!("{:?}; device-to-device copy {copy:.0} GB/s (read + write)", k.info());
    println!("{{\"bench\":\"paged_loads\",\"device\":{:?},\"copy_gbps\":{copy:.1}}}", format!("{:?}", k.info()));
    let cases: [(&Shape, usize, usize); 6] = [
        (&SHAPES[0], 16384, 256),
        (&SHAPES[0], 16384, 16),
        (&SHAPES[0], 4096, 64),
        (&SHAPES[0], 1024, 256),
        (&SHAPES[1], 16384, 256),
        (&SHAPES[1], 4096, 64),
    ];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let names: Vec<&str> = PagedLoads::ALL.iter().map(|l| l.name()).collect();
    eprintln!("| shape | context | batch | version | {} GB/s (% of copy) |", names.join(" GB/s (% of copy) | "));
    eprintln!("|---|---:|---:|---|{}", "---:|".repeat(names.len()));
    for (shape, context, batch) in cases {
        let blocks = batch * context / BLOCK;
        let pool = KvPool::new(k.stream(), PoolDtype::F16, blocks, BLOCK, shape.kv_heads, shape.head_dim)?;
        let mut table: Vec<i32> = (0..blocks as i32).collect();
        for i in (1..table.len()).rev() {
            table.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        let qsl: Vec<i32> = (0..=batch as i32).collect();
        let meta = DeviceAttentionMetadata {
            block_tables: up(k, &table)?,
            max_blocks_per_seq: context / BLOCK,
            token_seq: up(k, &(0..batch as i32).collect::<Vec<_>>())?,
            query_start_loc: up(k, &qsl)?,
            context_lens: up(k, &vec![context as i32; batch])?,
            num_tokens: batch,
            max_context: context,
            query_lens: QueryLens::decode(),
        };
        let q = up(k, &vec![0.01f32; batch * shape.heads * shape.head_dim])?;
        let mut out: CudaSlice<f32> = k.stream().alloc_zeros(batch * shape.heads * shape.head_dim)?;
        let params = shape.params();
        let queries = Kernels::attention_queries(shape.heads, shape.kv_heads, shape.head_dim);
        let version = k.attention_version(batch, shape.heads, queries, shape.head_dim, context);
        let iters = if batch * context >= 1 << 20 { 10 } else { 50 };
        let mut best = [f64::MAX; PagedLoads::ALL.len()];
        for round in 0..2 {
            for i in 0..PagedLoads::ALL.len() {
                let which = if round == 0 { i } else { PagedLoads::ALL.len() - 1 - i };
                k.set_paged_loads(PagedLoads::ALL[which]);
                let k = &*k;
                // SAFETY: the table holds `batch` sequences of `context`
                // tokens in the pool's own blocks.
                let ms = time_ms(k, 3, iters, || Ok(unsafe { k.paged_attention(&mut out, &q, &pool, &meta, params, None) }?))?;
                best[which] = best[which].min(ms);
            }
        }
        k.set_paged_loads(PagedLoads::default());
        let bytes = (2 * batch * context * shape.kv_heads * shape.head_dim * PoolDtype::F16.size()) as f64;
        let gbps = |ms: f64| bytes / (ms * 1e6);
        let cells: Vec<String> = best.iter().map(|&ms| format!("{:.0} ({:.0}%)", gbps(ms), 100.0 * gbps(ms) / copy)).collect();
        eprintln!("| {} | {context} | {batch} | {version:?} | {} |", shape.name, cells.join(" | "));
        let fields: Vec<String> = PagedLoads::ALL.iter().zip(&best).map(|(l, ms)| format!("\"{}_ms\":{ms:.5}", l.name())).collect();
        println!(
            "{{\"bench\":\"paged_loads\",\"shape\":\"{}\",\"context\":{context},\"batch\":{batch},\"version\":\"{version:?}\",\"kv_bytes\":{bytes},{},\"copy_gbps\":{copy:.1}}}",
            shape.name,
            fields.join(",")
        );
    }
    Ok(())
}

/// Prefill attention: one sequence of `len` prompt tokens, flash prefill
/// against the decode kernels, TFLOP/s of the causal products.
fn prefill(k: &Kernels, quick: bool) -> Res<()> {
    // The decode benchmark's shapes and Gemma 3's head size of 256.
    let gemma = Shape { name: "gemma3-270m", heads: 4, kv_heads: 1, head_dim: 256 };
    let lens: &[usize] = if quick { &[2048, 8192] } else { &[512, 2048, 8192, 16384] };
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    eprintln!("| shape | prompt | flash ms | flash TFLOP/s | decode kernels ms | decode kernels TFLOP/s | speed-up |");
    eprintln!("|---|---:|---:|---:|---:|---:|---:|");
    for shape in SHAPES.iter().chain([&gemma]) {
        for &len in lens {
            let blocks = len.div_ceil(BLOCK);
            let mut pool = KvPool::new(k.stream(), PoolDtype::Bf16, blocks + 3, BLOCK, shape.kv_heads, shape.head_dim)?;
            let mut table: Vec<i32> = (0..(blocks + 3) as i32).collect();
            for i in (1..table.len()).rev() {
                table.swap(i, (rng.next() % (i as u64 + 1)) as usize);
            }
            table.truncate(blocks);
            let row = shape.kv_heads * shape.head_dim;
            let small =
                |n: usize, rng: &mut Rng| -> Vec<f32> { (0..n).map(|_| (rng.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5).collect() };
            let (kv_k, kv_v) = (up(k, &small(len * row, &mut rng))?, up(k, &small(len * row, &mut rng))?);
            let slots: Vec<i64> = (0..len).map(|p| i64::from(table[p / BLOCK]) * BLOCK as i64 + (p % BLOCK) as i64).collect();
            // SAFETY: every slot is inside the pool's blocks (the table's ids).
            unsafe { k.reshape_and_cache(&kv_k, &kv_v, &mut pool, &up(k, &slots)?, vellum_base::KvScale::ONE) }?;
            let qsl = [0i32, len as i32];
            let meta = DeviceAttentionMetadata {
                block_tables: up(k, &table)?,
                max_blocks_per_seq: blocks,
                token_seq: up(k, &vec![0i32; len])?,
                query_start_loc: up(k, &qsl)?,
                context_lens: up(k, &[len as i32])?,
                num_tokens: len,
                max_context: len,
                query_lens: QueryLens::of(&qsl),
            };
            let q = up(k, &small(len * shape.heads * shape.head_dim, &mut rng))?;
            let mut out: CudaSlice<f32> = k.stream().alloc_zeros(len * shape.heads * shape.head_dim)?;
            let params = shape.params();
            let queries = Kernels::attention_queries(shape.heads, shape.kv_heads, shape.head_dim);
            let decode_version = k.attention_version(len, shape.heads, queries, shape.head_dim, len);
            let iters = if len >= 8192 { 3 } else { 10 };
            let mut run = |version| {
                // SAFETY: the table covers the sequence's `len` positions with the pool's own blocks.
                time_ms(k, 1, iters, || Ok(unsafe { k.paged_attention(&mut out, &q, &pool, &meta, params, Some(version)) }?))
            };
            let (flash, decode) = (run(AttentionVersion::Flash)?, run(decode_version)?);
            let flops = 4.0 * (len * (len + 1) / 2) as f64 * (shape.head_dim * shape.heads) as f64;
            let tflops = |ms: f64| flops / (ms * 1e9);
            eprintln!(
                "| {} | {len} | {flash:.3} | {:.1} | {decode:.3} ({decode_version:?}) | {:.1} | {:.1}× |",
                shape.name,
                tflops(flash),
                tflops(decode),
                decode / flash
            );
            println!(
                "{{\"bench\":\"prefill_attention\",\"shape\":\"{}\",\"prompt\":{len},\"flash_ms\":{flash:.5},\"flash_tflops\":{:.2},\"decode_kernels_ms\":{decode:.5},\"decode_kernels_tflops\":{:.2},\"decode_version\":\"{decode_version:?}\"}}",
                shape.name,
                tflops(flash),
                tflops(decode)
            );
        }
    }
    Ok(())
}

fn main() -> Res<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let mut k = match Kernels::open(0) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("no GPU: {e}");
            std::process::exit(2);
        }
    };
    if std::env::args().any(|a| a == "--overheads") {
        return overheads(&k);
    }
    if std::env::args().any(|a| a == "--prefill") {
        return prefill(&k, quick);
    }
    if std::env::args().any(|a| a == "--loads") {
        return loads(&mut k);
    }
    let info = k.info();
    let copy = copy_bandwidth(&k)?;
    eprintln!("{info:?}; device-to-device copy {copy:.0} GB/s (read + write)");
    println!("{{\"device\":{:?},\"copy_gbps\":{copy:.1}}}", format!("{info:?}"));
    let contexts: &[usize] = if quick { &[1024, 16384] } else { &[1024, 2048, 4096, 8192, 16384] };
    let batches: &[usize] = if quick { &[1, 256] } else { &[1, 4, 16, 64, 256] };
    let (max_ctx, max_batch) = (contexts[contexts.len() - 1], batches[batches.len() - 1]);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    eprintln!(
        "| shape | context | batch | version | contiguous µs | paged µs | shuffled µs | contiguous GB/s | paged GB/s | shuffled GB/s | shuffled/contiguous time |"
    );
    eprintln!("|---|---|---|---|---|---|---|---|---|---|---|");
    for shape in &SHAPES {
        let max_blocks_total = max_batch * max_ctx / BLOCK;
        let pool = KvPool::new(k.stream(), PoolDtype::F16, max_blocks_total, BLOCK, shape.kv_heads, shape.head_dim)?;
        let mut all: Vec<i32> = (0..max_blocks_total as i32).collect();
        for i in (1..all.len()).rev() {
            all.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        for &context in contexts {
            for &batch in batches {
                let max_blocks = context / BLOCK;
                let in_order: Vec<i32> = (0..(batch * max_blocks) as i32).collect();
                let shuffled: Vec<i32> = all[..batch * max_blocks].to_vec();
                let token_seq: Vec<i32> = (0..batch as i32).collect();
                let qsl: Vec<i32> = (0..=batch as i32).collect();
                let ctx = vec![context as i32; batch];
                let meta_of = |tables: &[i32]| -> Res<DeviceAttentionMetadata> {
                    Ok(DeviceAttentionMetadata {
                        block_tables: up(&k, tables)?,
                        max_blocks_per_seq: max_blocks,
                        token_seq: up(&k, &token_seq)?,
                        query_start_loc: up(&k, &qsl)?,
                        context_lens: up(&k, &ctx)?,
                        num_tokens: batch,
                        max_context: context,
                        query_lens: QueryLens::decode(),
                    })
                };
                let (meta_order, meta_shuffled) = (meta_of(&in_order)?, meta_of(&shuffled)?);
                let q = up(&k, &vec![0.01f32; batch * shape.heads * shape.head_dim])?;
                let mut out: CudaSlice<f32> = k.stream().alloc_zeros(batch * shape.heads * shape.head_dim)?;
                let params = shape.params();
                let queries = Kernels::attention_queries(shape.heads, shape.kv_heads, shape.head_dim);
                let version = k.attention_version(batch, shape.heads, queries, shape.head_dim, context);
                let iters = if batch * context >= 1 << 20 { 10 } else { 50 };
                let mut run = |meta: &DeviceAttentionMetadata, layout: KvLayout| {
                    // SAFETY: both layouts' metadata address the pool's own
                    // blocks for `batch` sequences of `context` tokens.
                    time_ms(&k, 3, iters, || Ok(unsafe { k.attention_with_layout(&mut out, &q, &pool, meta, params, None, layout) }?))
                };
                // Each layout twice, in mirrored order (the best of two), so
                // that no layout always runs first or last.
                let (mut t_contig, mut t_paged, mut t_shuf) = (f64::MAX, f64::MAX, f64::MAX);
                for round in 0..2 {
                    for i in 0..3 {
                        let which = if round == 0 { i } else { 2 - i };
                        match which {
                            0 => t_contig = t_contig.min(run(&meta_order, KvLayout::ContiguousBaseline)?),
                            1 => t_paged = t_paged.min(run(&meta_order, KvLayout::Paged)?),
                            _ => t_shuf = t_shuf.min(run(&meta_shuffled, KvLayout::Paged)?),
                        }
                    }
                }
                let bytes = (2 * batch * context * shape.kv_heads * shape.head_dim * PoolDtype::F16.size()) as f64;
                let gbps = |ms: f64| bytes / (ms * 1e6);
                eprintln!(
                    "| {} | {context} | {batch} | {version:?} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {:.3} |",
                    shape.name,
                    t_contig * 1e3,
                    t_paged * 1e3,
                    t_shuf * 1e3,
                    gbps(t_contig),
                    gbps(t_paged),
                    gbps(t_shuf),
                    t_shuf / t_contig
                );
                println!(
                    "{{\"shape\":\"{}\",\"context\":{context},\"batch\":{batch},\"version\":\"{version:?}\",\"kv_bytes\":{bytes},\"contiguous_ms\":{t_contig:.5},\"paged_ms\":{t_paged:.5},\"shuffled_ms\":{t_shuf:.5},\"copy_gbps\":{copy:.1}}}",
                    shape.name
                );
            }
        }
        drop(pool);
    }
    Ok(())
}
