//! The GPU suite: every kernel against a float64 host reference on shapes
//! that exercise the paging (shuffled block ids, partial blocks, GQA, a mixed
//! prefill/decode batch, sliding window, soft-cap, long contexts through v2,
//! all three cache types).
//!
//! Without a GPU each test says SKIPPED by name and passes, unless
//! `VELLUM_REQUIRE_GPU` is set (set it on a GPU machine, so that a broken
//! driver setup cannot pass silently). On a machine with a GPU and no Rust:
//! build here with `cargo test -p vellum-backend-cuda --release --no-run`,
//! copy the `gpu-*` test binary and NVRTC's `lib/` over, then run it with
//! `LD_LIBRARY_PATH=<nvrtc lib> VELLUM_REQUIRE_GPU=1 ./gpu-* --test-threads 1`.

use cudarc::driver::CudaSlice;
use vellum_backend_cuda::blas::{Blas, Half};
use vellum_backend_cuda::launch::{
    AttentionParams, AttentionVersion, DeviceAttentionMetadata, GemvPlan, Kernels, KvPool, PagedLoads, PoolDtype, QuantMatrix, QueryLens,
};
use vellum_backend_cuda::layout;
use vellum_base::KvScale;
use vellum_ops::quant::GgmlType;

fn gpu_or_skip(test: &str) -> Option<Kernels> {
    match Kernels::open(0) {
        Ok(k) => Some(k),
        Err(e) => {
            assert!(std::env::var_os("VELLUM_REQUIRE_GPU").is_none(), "VELLUM_REQUIRE_GPU is set but: {e}");
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

/// xorshift64*: reproducible inputs without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
    }
}

/// A value as the cache stores it with scale `s` (1 but for FP8): `x · (1
/// / s)` rounded to the type.
fn stored(x: f32, dtype: PoolDtype, s: f32) -> f32 {
    match dtype {
        PoolDtype::F32 => x,
        PoolDtype::F16 => half::f16::from_f32(x).to_f32(),
        PoolDtype::Bf16 => half::bf16::from_f32(x).to_f32(),
        PoolDtype::Fp8E4m3 => vellum_base::fp8::to_f32(vellum_base::fp8::from_f32(x * (1.0 / s))),
    }
}

/// A value as attention reads it back: stored, times the scale.
fn round(x: f32, dtype: PoolDtype, s: f32) -> f32 {
    stored(x, dtype, s) * s
}

/// Decodes a pool read back as bytes (as stored: FP8 codes' values).
fn decode(bytes: &[u8], dtype: PoolDtype) -> Vec<f32> {
    match dtype {
        PoolDtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        PoolDtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        PoolDtype::Bf16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        PoolDtype::Fp8E4m3 => bytes.iter().map(|&c| vellum_base::fp8::to_f32(c)).collect(),
    }
}

/// Scales that are not powers of two, different for K and V (|x| < 1
/// becomes up to 81 and 143 in the pool).
const FP8_SCALE: KvScale = KvScale { k: 0.0123, v: 0.007 };

/// The scales a test gives a pool of `dtype`.
fn scale_for(dtype: PoolDtype) -> KvScale {
    if dtype == PoolDtype::Fp8E4m3 {
        FP8_SCALE
    } else {
        KvScale::ONE
    }
}

fn up<T: cudarc::driver::DeviceRepr>(k: &Kernels, v: &[T]) -> CudaSlice<T> {
    k.stream().clone_htod(v).expect("upload")
}

fn down<T: cudarc::driver::DeviceRepr + Default + Clone>(k: &Kernels, v: &CudaSlice<T>) -> Vec<T> {
    k.stream().clone_dtoh(v).expect("download")
}

/// One sequence of the batch: its context after this step and how many of
/// those positions are this step's queries.
struct Seq {
    context_len: usize,
    q_len: usize,
}

struct Case {
    head_dim: usize,
    dtype: PoolDtype,
    window: usize,
    softcap: f32,
    /// Query and KV heads (a thread block serves a group's heads together).
    heads: usize,
    kv_heads: usize,
}

const BLOCK: usize = 16;

/// Writes every position of every sequence through `reshape_and_cache`,
/// runs paged attention both ways, and compares with the host reference.
fn check_attention(k: &mut Kernels, case: &Case, rng: &mut Rng) {
    let seqs = [
        Seq { context_len: 33, q_len: 1 },
        Seq { context_len: 1, q_len: 1 },
        Seq { context_len: 40, q_len: 7 },
        Seq { context_len: 700, q_len: 1 },
        Seq { context_len: 20, q_len: 20 },
        Seq { context_len: 1100, q_len: 3 },
        // Flash prefill's: a prefix hit over three query tiles (the last
        // partial), and a prompt of exactly its threshold.
        Seq { context_len: 300, q_len: 150 },
        Seq { context_len: 16, q_len: 16 },
    ];
    let (d, row) = (case.head_dim, case.kv_heads * case.head_dim);
    let blocks_of = |s: &Seq| s.context_len.div_ceil(BLOCK);
    let num_blocks = seqs.iter().map(blocks_of).sum::<usize>() + 7;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    rng.shuffle(&mut ids);
    let max_blocks = seqs.iter().map(blocks_of).max().expect("seqs");
    let mut tables = vec![0i32; seqs.len() * max_blocks];
    let mut next = 0;
    for (s, seq) in seqs.iter().enumerate() {
        for b in 0..blocks_of(seq) {
            tables[s * max_blocks + b] = ids[next];
            next += 1;
        }
    }
    // Every position's K and V, written through the kernel; one padding
    // entry (slot -1) must write nothing.
    let mut keys: Vec<Vec<f32>> = Vec::new();
    let mut values: Vec<Vec<f32>> = Vec::new();
    let mut slots: Vec<i64> = Vec::new();
    let (mut k_all, mut v_all) = (Vec::new(), Vec::new());
    for (s, seq) in seqs.iter().enumerate() {
        let (kk, vv) = (rng.vec(seq.context_len * row), rng.vec(seq.context_len * row));
        for pos in 0..seq.context_len {
            slots.push(tables[s * max_blocks + pos / BLOCK] as i64 * BLOCK as i64 + (pos % BLOCK) as i64);
        }
        k_all.extend_from_slice(&kk);
        v_all.extend_from_slice(&vv);
        keys.push(kk);
        values.push(vv);
    }
    slots.push(-1);
    k_all.extend(std::iter::repeat_n(9.0f32, row));
    v_all.extend(std::iter::repeat_n(9.0f32, row));
    let mut pool = KvPool::new(k.stream(), case.dtype, num_blocks, BLOCK, case.kv_heads, d).expect("pool");
    let sc = scale_for(case.dtype);
    // SAFETY: the slots are -1 or below num_blocks · BLOCK, as built above.
    unsafe { k.reshape_and_cache(&up(k, &k_all), &up(k, &v_all), &mut pool, &up(k, &slots), sc) }.expect("reshape_and_cache");
    // The pools hold each row at its slot, rounded to the cache type (FP8:
    // the host's own codes, bit for bit), and nothing else (the padding
    // row of 9s went nowhere).
    let (k_pool, v_pool) = (decode(&down(k, &pool.k), case.dtype), decode(&down(k, &pool.v), case.dtype));
    for (i, &slot) in slots.iter().enumerate().filter(|(_, s)| **s >= 0) {
        let (at, from) = (slot as usize * row, i * row);
        for j in 0..row {
            assert_eq!(k_pool[at + j], stored(k_all[from + j], case.dtype, sc.k), "K slot {slot} elem {j}");
            assert_eq!(v_pool[at + j], stored(v_all[from + j], case.dtype, sc.v), "V slot {slot} elem {j}");
        }
    }
    let nines = |x: &f32| *x == stored(9.0, case.dtype, sc.k) || *x == stored(9.0, case.dtype, sc.v);
    assert!(!k_pool.iter().any(nines) && !v_pool.iter().any(nines), "the padding slot wrote into the pool");

    // The batch's queries and metadata.
    let num_tokens: usize = seqs.iter().map(|s| s.q_len).sum();
    let q = rng.vec(num_tokens * case.heads * d);
    let (mut token_seq, mut qsl, mut ctx) = (Vec::new(), vec![0i32], Vec::new());
    for (s, seq) in seqs.iter().enumerate() {
        token_seq.extend(std::iter::repeat_n(s as i32, seq.q_len));
        qsl.push(qsl[s] + seq.q_len as i32);
        ctx.push(seq.context_len as i32);
    }
    let max_context =
        seqs.iter().map(|s| if case.window > 0 { s.context_len.min(case.window) } else { s.context_len }).max().expect("seqs");
    let meta_of = |query_lens| DeviceAttentionMetadata {
        block_tables: up(k, &tables),
        max_blocks_per_seq: max_blocks,
        token_seq: up(k, &token_seq),
        query_start_loc: up(k, &qsl),
        context_lens: up(k, &ctx),
        num_tokens,
        max_context,
        query_lens,
    };
    let meta = meta_of(QueryLens::of(&qsl));
    let scale = 1.0 / (d as f32).sqrt();
    let params = AttentionParams { num_heads: case.heads, scale, softcap: case.softcap, window: case.window, kv_scale: sc };
    // Flash prefill multiplies the queries times the score's scale (the key
    // scale and an FP8 code's unit in it), rounded to its 16-bit type.
    let s_total = scale * sc.k * case.dtype.unit();
    let q_mma: Vec<f32> = q
        .iter()
        .map(|&x| match case.dtype {
            PoolDtype::F32 => x,
            PoolDtype::Bf16 => half::bf16::from_f32(x * s_total).to_f32() / s_total,
            PoolDtype::F16 | PoolDtype::Fp8E4m3 => half::f16::from_f32(x * s_total).to_f32() / s_total,
        })
        .collect();
    let expected = attention_reference(&seqs, case, &q, &keys, &values, sc, scale);
    let expected_mma = attention_reference(&seqs, case, &q_mma, &keys, &values, sc, scale);
    let q_dev = up(k, &q);
    let n_out = num_tokens * case.heads * d;
    let mut versions = vec![(AttentionVersion::V1, &meta, 2e-4), (AttentionVersion::V2, &meta, 2e-4)];
    // Flash for the long sequences, v1/v2 for the rest; then the same over
    // the tile slots of a CUDA graph of this many tokens (most return).
    let meta_any = meta_of(QueryLens::any(num_tokens));
    if case.dtype != PoolDtype::F32 {
        // P is rounded to the 16-bit type too: bf16 keeps 8 bits, f16 11.
        let tol = if case.dtype == PoolDtype::Bf16 { 1e-2 } else { 2e-3 };
        versions.push((AttentionVersion::Flash, &meta, tol));
        versions.push((AttentionVersion::Flash, &meta_any, tol));
    }
    for (version, meta, tol) in versions {
        // Poisoned: a row no kernel writes stays NaN and fails.
        let mut out: CudaSlice<f32> = up(k, &vec![f32::NAN; n_out]);
        // SAFETY: meta's tables hold the pool's own block ids and its
        // lengths describe the num_tokens queries built above.
        unsafe { k.paged_attention(&mut out, &q_dev, &pool, meta, params, Some(version)) }.expect("paged attention");
        let got = down(k, &out);
        let want = if version == AttentionVersion::Flash { &expected_mma } else { &expected };
        let worst =
            got.iter().zip(want).map(|(&g, &e)| if g.is_finite() { (g as f64 - e).abs() } else { f64::INFINITY }).fold(0.0, f64::max);
        eprintln!(
            "head_dim {d} heads {}/{} {:?} window {} softcap {} {version:?} (flash slots {}): max |err| {worst:.2e}",
            case.heads, case.kv_heads, case.dtype, case.window, case.softcap, meta.query_lens.flash_tiles
        );
        assert!(worst < tol, "{version:?}: max |err| {worst:.2e}");
        if version != AttentionVersion::Flash {
            // The decode kernels' other loads give the same bits.
            let default = k.paged_loads();
            for loads in PagedLoads::ALL.into_iter().filter(|&l| l != default) {
                k.set_paged_loads(loads);
                let mut other: CudaSlice<f32> = up(k, &vec![f32::NAN; n_out]);
                // SAFETY: as above.
                unsafe { k.paged_attention(&mut other, &q_dev, &pool, meta, params, Some(version)) }.expect("paged attention");
                let differ = down(k, &other).iter().zip(&got).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(differ, 0, "{version:?} with {loads:?} loads: {differ} outputs differ from {default:?}'s bits");
            }
            k.set_paged_loads(default);
        }
    }
}

/// Attention in float64 over the values as the cache holds them, for the
/// queries `q` (as given, or rounded as a kernel multiplies them).
fn attention_reference(seqs: &[Seq], case: &Case, q: &[f32], keys: &[Vec<f32>], values: &[Vec<f32>], sc: KvScale, scale: f32) -> Vec<f64> {
    let (d, row) = (case.head_dim, case.kv_heads * case.head_dim);
    let num_tokens: usize = seqs.iter().map(|s| s.q_len).sum();
    let mut expected = vec![0f64; num_tokens * case.heads * d];
    let mut t = 0;
    for (s, seq) in seqs.iter().enumerate() {
        for i in 0..seq.q_len {
            let n_ctx = seq.context_len - seq.q_len + i + 1;
            let first = if case.window > 0 && n_ctx > case.window { n_ctx - case.window } else { 0 };
            for h in 0..case.heads {
                let kvh = h / (case.heads / case.kv_heads);
                let qv = &q[(t * case.heads + h) * d..(t * case.heads + h + 1) * d];
                let scores: Vec<f64> = (first..n_ctx)
                    .map(|pos| {
                        let kr = &keys[s][pos * row + kvh * d..pos * row + (kvh + 1) * d];
                        let dot: f64 = qv.iter().zip(kr).map(|(&a, &b)| (a * scale) as f64 * round(b, case.dtype, sc.k) as f64).sum();
                        if case.softcap > 0.0 {
                            case.softcap as f64 * (dot / case.softcap as f64).tanh()
                        } else {
                            dot
                        }
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (j, pos) in (first..n_ctx).enumerate() {
                    let p = (scores[j] - m).exp() / total;
                    let vr = &values[s][pos * row + kvh * d..pos * row + (kvh + 1) * d];
                    for (e, &v) in expected[(t * case.heads + h) * d..(t * case.heads + h + 1) * d].iter_mut().zip(vr) {
                        *e += p * round(v, case.dtype, sc.v) as f64;
                    }
                }
            }
            t += 1;
        }
    }
    expected
}

#[test]
fn paged_attention_matches_the_float64_reference_on_a_mixed_batch_or_skips_without_a_gpu() {
    let Some(mut k) = gpu_or_skip("paged_attention_matches_the_float64_reference_on_a_mixed_batch") else { return };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for head_dim in [64, 128, 256] {
        for dtype in [PoolDtype::F32, PoolDtype::F16, PoolDtype::Bf16, PoolDtype::Fp8E4m3] {
            check_attention(&mut k, &Case { head_dim, dtype, window: 0, softcap: 0.0, heads: 8, kv_heads: 2 }, &mut rng);
        }
    }
    // Gemma-style: a sliding window and a soft-cap.
    check_attention(&mut k, &Case { head_dim: 256, dtype: PoolDtype::Bf16, window: 64, softcap: 30.0, heads: 8, kv_heads: 2 }, &mut rng);
    check_attention(&mut k, &Case { head_dim: 256, dtype: PoolDtype::Fp8E4m3, window: 64, softcap: 30.0, heads: 8, kv_heads: 2 }, &mut rng);
    check_attention(&mut k, &Case { head_dim: 64, dtype: PoolDtype::F32, window: 600, softcap: 0.0, heads: 8, kv_heads: 2 }, &mut rng);
    // Other group sizes: SmolLM2's 9/3 (groups of 3), multi-head (1), 8
    // heads a group at 64 and 128 dims (8 queries a thread block), and a
    // group of 8 at 256 dims, served 4 heads a thread block.
    for (head_dim, heads, kv_heads) in [(64, 9, 3), (128, 2, 2), (64, 16, 2), (128, 16, 2), (256, 8, 1)] {
        let case = Case { head_dim, dtype: PoolDtype::F16, window: 0, softcap: 0.0, heads, kv_heads };
        check_attention(&mut k, &case, &mut rng);
    }
}

#[test]
fn copy_blocks_copies_whole_blocks_in_both_pools_or_skips_without_a_gpu() {
    let Some(k) = gpu_or_skip("copy_blocks_copies_whole_blocks_in_both_pools") else { return };
    let mut rng = Rng(7);
    for dtype in [PoolDtype::F32, PoolDtype::Bf16, PoolDtype::Fp8E4m3] {
        let (blocks, d) = (12, 64);
        let mut pool = KvPool::new(k.stream(), dtype, blocks, BLOCK, 2, d).expect("pool");
        let n = blocks * BLOCK;
        let slots: Vec<i64> = (0..n as i64).collect();
        let (keys, values) = (up(&k, &rng.vec(n * pool.row())), up(&k, &rng.vec(n * pool.row())));
        // SAFETY: slots 0..n are exactly the pool's slots.
        unsafe { k.reshape_and_cache(&keys, &values, &mut pool, &up(&k, &slots), scale_for(dtype)) }.expect("fill");
        let before = (down(&k, &pool.k), down(&k, &pool.v));
        let pairs: Vec<i64> = vec![3, 7, 0, 11, 5, 1];
        // SAFETY: every id is below the pool's 12 blocks.
        unsafe { k.copy_blocks(&mut pool, &up(&k, &pairs)) }.expect("copy_blocks");
        let after = (down(&k, &pool.k), down(&k, &pool.v));
        let bb = BLOCK * pool.row() * dtype.size();
        for b in 0..blocks {
            let src = pairs.chunks(2).find(|p| p[1] as usize == b).map_or(b, |p| p[0] as usize);
            assert_eq!(after.0[b * bb..(b + 1) * bb], before.0[src * bb..(src + 1) * bb], "K block {b}");
            assert_eq!(after.1[b * bb..(b + 1) * bb], before.1[src * bb..(src + 1) * bb], "V block {b}");
        }
    }
}

/// GGUF blocks of a random `[n, k]` weight of `dtype` (random codes and
/// packed scales, finite nonzero f16 scales and mins), or f32 values.
fn gguf_blocks(rng: &mut Rng, dtype: GgmlType, n: usize, k: usize) -> Vec<u8> {
    if dtype == GgmlType::F32 {
        return rng.vec(n * k).iter().flat_map(|v| v.to_le_bytes()).collect();
    }
    let (block, bb) = dtype.block_layout();
    let mut bytes: Vec<u8> = (0..n * k / block * bb).map(|_| (rng.next() >> 56) as u8).collect();
    // Where the block's f16 fields are: a scale (d), then a min where it has one.
    let halves: &[usize] = match dtype {
        GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[0],
    };
    for b in bytes.chunks_exact_mut(bb) {
        for (h, &at) in halves.iter().enumerate() {
            let v = if h == 0 { 0.01 + 0.02 * rng.f().abs() } else { -0.1 * rng.f().abs() };
            // K-quant scales multiply 6-bit sub-scales: keep weights of order 0.1.
            let v = if block == 256 { v / 32.0 } else { v };
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
    }
    bytes
}

/// A random weight in its device layout (on the device) and the values its
/// kernels decode, f32 row-major.
fn random_weight(k: &Kernels, rng: &mut Rng, dtype: GgmlType, n: usize, kk: usize) -> (QuantMatrix, Vec<f32>) {
    let bytes = gguf_blocks(rng, dtype, n, kk);
    let r = if dtype == GgmlType::F32 {
        layout::f32_layout(&bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect::<Vec<_>>())
    } else {
        layout::repack(dtype, &bytes, n, kk).expect("repacks")
    };
    let values = layout::dequantize_repacked(&r, n, kk);
    // The scale plane is one element when empty (the driver refuses zero bytes).
    let scales = if r.scales.is_empty() { vec![0u16] } else { r.scales.clone() };
    (QuantMatrix { codes: up(k, &r.codes), scales: up(k, &scales), format: r.format, n, k: kk }, values)
}

/// A time-seeded generator: fresh inputs every run (the seed is printed
/// with any failure).
fn fresh_rng() -> (Rng, u64) {
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64) | 1;
    (Rng(seed), seed)
}

const LAYOUT_TYPES: [GgmlType; 7] =
    [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::F32];

/// `k` rounded up to whole blocks of `dtype` (256 values for the K-quants).
fn whole_blocks(dtype: GgmlType, k: usize) -> usize {
    k.next_multiple_of(dtype.block_layout().0)
}

#[test]
fn gemv_and_cuda_core_gemm_on_the_weight_layouts_match_the_float64_product_or_skips_without_a_gpu() {
    let Some(k) = gpu_or_skip("gemv_and_cuda_core_gemm_on_the_weight_layouts_match_the_float64_product") else { return };
    let (mut rng, seed) = fresh_rng();
    // n not a multiple of a warp's columns nor of a tile; k of 10 blocks
    // (not a multiple of the GEMV's 512-weight stride; 768 for the K-quants)
    // and of ~50 (several 512-weight stretches a warp group splits, the
    // last one partial).
    let n = 101;
    // The GEMV under every plan worth keeping: the ones `for_rows` picks,
    // the one measured faster from 2 rows, the kernel's old one and the
    // widest split.
    let plan = |c, s, m| GemvPlan { columns_per_warp: c, k_split: s, magic: m };
    let plans = [None, Some(plan(2, 2, true)), Some(plan(4, 2, true)), Some(plan(1, 1, false)), Some(plan(3, 4, true))];
    for dtype in LAYOUT_TYPES {
        for k_weights in [320, 1600] {
            let kk = whole_blocks(dtype, k_weights);
            let (w_dev, w) = random_weight(&k, &mut rng, dtype, n, kk);
            for rows in [1, 2, 3, 4, 5, 7, 8] {
                let x = rng.vec(rows * kk);
                let want: Vec<f64> =
                    (0..rows * n).map(|i| (0..kk).map(|j| x[(i / n) * kk + j] as f64 * w[(i % n) * kk + j] as f64).sum()).collect();
                for p in plans {
                    let mut y = up(&k, &vec![f32::NAN; rows * n]);
                    match p {
                        None => k.gemv_q(&mut y, &w_dev, &up(&k, &x), rows).expect("gemv"),
                        Some(p) => k.gemv_q_planned(&mut y, &w_dev, &up(&k, &x), rows, p).expect("gemv"),
                    }
                    let got = down(&k, &y);
                    for (i, (&g, &e)) in got.iter().zip(&want).enumerate() {
                        let g = g as f64;
                        assert!(
                            (g - e).abs() < 1e-4 * (1.0 + e.abs()),
                            "{dtype} k={kk} rows={rows} plan {p:?} [{},{}]: {g} vs {e} (seed {seed})",
                            i / n,
                            i % n
                        );
                    }
                }
            }
        }
        // Beyond 8 rows: the tiled GEMM through gemv_rows, with partial
        // tiles of rows and columns, k split in parts at these sizes (too
        // few tiles for the GPU).
        let kk = whole_blocks(dtype, 320);
        let (w_dev, w) = random_weight(&k, &mut rng, dtype, n, kk);
        for rows in [9, 37, 130] {
            assert!(k.gemm_splits(rows, n, kk) > 1, "{rows} rows: the tiles alone would fill the GPU");
            let x = rng.vec(rows * kk);
            let mut y = up(&k, &vec![f32::NAN; rows * n]);
            k.gemv_rows(&mut y, &w_dev, &up(&k, &x), rows).expect("gemm");
            let got = down(&k, &y);
            for r in 0..rows {
                for c in 0..n {
                    let e: f64 = (0..kk).map(|i| x[r * kk + i] as f64 * w[c * kk + i] as f64).sum();
                    let g = got[r * n + c] as f64;
                    assert!((g - e).abs() < 1e-4 * (1.0 + e.abs()), "{dtype} rows={rows} [{r},{c}]: {g} vs {e} (seed {seed})");
                }
            }
        }
    }
    // Enough tiles to fill the GPU: one pass over k, no split.
    let (n, kk, rows) = (2200, 320, 520);
    assert_eq!(k.gemm_splits(rows, n, kk), 1);
    let (w_dev, w) = random_weight(&k, &mut rng, GgmlType::Q4_1, n, kk);
    let x = rng.vec(rows * kk);
    let mut y = up(&k, &vec![f32::NAN; rows * n]);
    k.gemv_rows(&mut y, &w_dev, &up(&k, &x), rows).expect("gemm");
    let got = down(&k, &y);
    for r in (0..rows).step_by(7) {
        for c in 0..n {
            let e: f64 = (0..kk).map(|i| x[r * kk + i] as f64 * w[c * kk + i] as f64).sum();
            let g = got[r * n + c] as f64;
            assert!((g - e).abs() < 1e-4 * (1.0 + e.abs()), "unsplit rows={rows} [{r},{c}]: {g} vs {e} (seed {seed})");
        }
    }
}

/// bf16 bits of `v`, rounded to nearest even (the kernels' `cvt.rn.bf16`).
fn bf16_bits(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

/// `y ?= x16 · w16ᵀ` against the float64 product of the same bf16 inputs:
/// f32 accumulation of exact products, in any order (split-K included).
#[allow(clippy::too_many_arguments)]
fn check_bf16_product(got: &[f32], x16: &[u16], w16: &[u16], rows: usize, n: usize, kk: usize, what: &str, seed: u64) {
    let f = |b: u16| half::bf16::from_bits(b).to_f32() as f64;
    // Large cases: every 7th row (the host's float64 sums are the cost).
    let step = if rows * n * kk > 100_000_000 { 7 } else { 1 };
    for r in (0..rows).step_by(step) {
        for c in 0..n {
            let (mut want, mut mag) = (0f64, 0f64);
            for i in 0..kk {
                let p = f(x16[r * kk + i]) * f(w16[c * kk + i]);
                want += p;
                mag += p.abs();
            }
            let g = got[r * n + c] as f64;
            let tol = 1e-6 * mag * (kk as f64).sqrt() + 1e-6;
            assert!((g - want).abs() <= tol, "{what} [{r},{c}]: {g} vs {want} (tolerance {tol}, seed {seed})");
        }
    }
}

/// The tensor-core GEMM (`gemm_mma.cu`) on every layout: activations cast
/// to bf16 on the device, weights decoded and rounded to bf16 as they are
/// staged; against the float64 product of the same bf16 values. Tile
/// heights 32/64/128, partial tiles of rows and columns, split and unsplit
/// k; also `dequantize_bf16`, bit for bit, and the cuBLAS product over it.
#[test]
fn tensor_core_gemm_on_the_weight_layouts_matches_the_float64_product_of_its_bf16_inputs_or_skips_without_a_gpu() {
    let test = "tensor_core_gemm_on_the_weight_layouts_matches_the_float64_product_of_its_bf16_inputs";
    let Some(k) = gpu_or_skip(test) else { return };
    let (mut rng, seed) = fresh_rng();
    let mut staged_cases = 0;
    for dtype in LAYOUT_TYPES {
        for (rows, n, kk) in
            [(9, 101, 320), (16, 200, 64), (33, 128, 320), (64, 515, 1024), (100, 77, 96), (300, 260, 256), (129, 2048, 4096)]
        {
            let (w_dev, w) = random_weight(&k, &mut rng, dtype, n, kk);
            let w16: Vec<u16> = w.iter().map(|&v| bf16_bits(v)).collect();
            let x = rng.vec(rows * kk);
            let mut x16 = up(&k, &vec![0u16; rows * kk]);
            k.cast_to_16(&mut x16, &up(&k, &x), rows * kk, Half::Bf16).expect("cast");
            let x16_host = down(&k, &x16);
            assert!(x16_host.iter().zip(&x).all(|(&g, &v)| g == bf16_bits(v)), "{dtype}: the cast rounds to nearest even");
            let mut y = up(&k, &vec![f32::NAN; rows * n]);
            k.set_gemm_staged(false);
            k.gemm_mma(&mut y, &w_dev, &x16, rows).expect("gemm_mma");
            let plan = k.mma_plan(rows, n, kk);
            let what = format!("{dtype} gemm_mma [{rows}x{kk}]·[{n}x{kk}]ᵀ ({plan:?})");
            let registers = down(&k, &y);
            check_bf16_product(&registers, &x16_host, &w16, rows, n, kk, &what, seed);
            // The staged kernel where it applies (quantized, k/32 even): the
            // same bits, as it takes the same plan and each output's k in the
            // same order.
            k.set_gemm_staged(true);
            if k.mma_staged_applies(&w_dev, rows) {
                let mut y = up(&k, &vec![f32::NAN; rows * n]);
                k.gemm_mma(&mut y, &w_dev, &x16, rows).expect("gemm_mma_staged");
                let what = format!("{dtype} gemm_mma_staged [{rows}x{kk}]·[{n}x{kk}]ᵀ ({plan:?})");
                let staged = down(&k, &y);
                check_bf16_product(&staged, &x16_host, &w16, rows, n, kk, &what, seed);
                let same = staged.iter().zip(&registers).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
                assert_eq!(same, rows * n, "{what}: {same} of {} outputs have gemm_mma's bits (seed {seed})", rows * n);
                staged_cases += 1;
            }
            // The whole weight as bf16: the host's rounding of the same values.
            let mut d16 = up(&k, &vec![0xffffu16; n * kk]);
            k.dequantize_bf16(&mut d16, &w_dev).expect("dequantize");
            assert!(down(&k, &d16) == w16, "{dtype} [{n}x{kk}]: dequantize_bf16 differs from the host's rounding (seed {seed})");
            if let Ok(blas) = Blas::new(k.stream().clone()) {
                let mut y = up(&k, &vec![f32::NAN; rows * n]);
                blas.linear_16(&mut y, &d16, &x16, Half::Bf16, rows, n, kk).expect("cublas");
                check_bf16_product(&down(&k, &y), &x16_host, &w16, rows, n, kk, &format!("{dtype} cuBLAS over dequantize_bf16"), seed);
            }
        }
    }
    // The plans the cases above were chosen to cover.
    assert_eq!(k.mma_plan(9, 101, 320).tile_rows, 32);
    assert_eq!(k.mma_plan(64, 515, 1024).tile_rows, 64);
    assert_eq!(k.mma_plan(300, 260, 256).tile_rows, 128);
    assert!(k.mma_plan(64, 515, 1024).parts > 1 && k.mma_plan(300, 260, 256).parts > 1, "split-K is exercised");
    assert_eq!(k.mma_plan(16, 200, 64).parts, 1, "two blocks of 32 along k: one part");
    assert!(staged_cases >= 12, "the staged kernel ran {staged_cases} cases");
    eprintln!("gemm_mma_staged: {staged_cases} cases, bit for bit with gemm_mma");
}

#[test]
fn rms_norm_plain_and_fused_with_the_residual_match_the_reference_or_skips_without_a_gpu() {
    let Some(k) = gpu_or_skip("rms_norm_plain_and_fused_with_the_residual_match_the_reference") else { return };
    let mut rng = Rng(5);
    let (rows, cols, eps) = (3, 640, 1e-6f32);
    let (x, res, w) = (rng.vec(rows * cols), rng.vec(rows * cols), rng.vec(cols));
    let norm = |v: &[f32], offset: f32| -> Vec<f64> {
        let ms: f64 = v.iter().map(|&a| a as f64 * a as f64).sum::<f64>() / cols as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        v.iter().zip(&w).map(|(&a, &g)| a as f64 * r * (g + offset) as f64).collect()
    };
    for offset in [0.0f32, 1.0] {
        let (mut xd, w_dev) = (up(&k, &x), up(&k, &w));
        k.rms_norm(&mut xd, None, &w_dev, rows, eps, offset).expect("rms_norm");
        let got = down(&k, &xd);
        let mut rd = up(&k, &res);
        let mut xf = up(&k, &x);
        k.rms_norm(&mut xf, Some(&mut rd), &w_dev, rows, eps, offset).expect("fused");
        let (got_f, got_r) = (down(&k, &xf), down(&k, &rd));
        for r in 0..rows {
            let e = norm(&x[r * cols..(r + 1) * cols], offset);
            let sum: Vec<f32> = (0..cols).map(|i| res[r * cols + i] + x[r * cols + i]).collect();
            let ef = norm(&sum, offset);
            for i in 0..cols {
                assert!((got[r * cols + i] as f64 - e[i]).abs() < 1e-5, "plain [{r},{i}]");
                assert!((got_f[r * cols + i] as f64 - ef[i]).abs() < 1e-5, "fused [{r},{i}]");
                assert_eq!(got_r[r * cols + i], sum[i], "residual [{r},{i}]");
            }
        }
    }
}

// ------------------------------------------- the executor, end to end

#[path = "../../models/tests/common/tiny_checkpoint.rs"]
mod tiny_checkpoint;

/// A tiny random-weight Llama (GQA, q/k/v biases, Q8_0 and F32 linears, F16
/// and BF16 norms, Q/K stored permuted as llama.cpp's converter does) with
/// head size 64, written as a GGUF file by the test into a directory of its
/// own (`tag`: tests run in parallel, and each removes its directory).
fn tiny_gguf(tag: &str) -> std::path::PathBuf {
    tiny_gguf_with_context(tag, 256)
}

/// [`tiny_gguf`] with a context of `positions`.
fn tiny_gguf_with_context(tag: &str, positions: u32) -> std::path::PathBuf {
    use tiny_checkpoint::*;
    let shape = TinyShape { hidden: 256, n_head: 4, n_kv_head: 2, head_dim: 64, ffn: 384, n_layer: 2, vocab: 96 };
    let dir = std::env::temp_dir().join(format!("vellum-cuda-tiny-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("tiny64.gguf");
    let mut w = tiny_gguf_writer_of(shape, &tiny_tensors_of(shape));
    for (key, value) in &mut w.kvs {
        if key == "llama.context_length" {
            *value = Kv::U32(positions);
        }
    }
    std::fs::write(&path, w.build().0).expect("write gguf");
    path
}

/// Logits of three steps — two prompts prefilled together, then two
/// decode steps of both — with shuffled, partial blocks of 16.
fn run_steps(exec: &mut dyn vellum_base::ModelExecutor) -> Vec<Vec<f32>> {
    use vellum_base::ForwardBatch;
    exec.initialize_kv_cache(16, 4, 16).expect("cache");
    let tables = [[5u32, 2, 9], [0, 7, 3]];
    let slot = |s: usize, p: usize| tables[s][p / 16] * 16 + (p % 16) as u32;
    let prompts: [Vec<u32>; 2] = [(0..21).map(|i| (i * 7 + 3) % 96).collect(), (0..9).map(|i| (i * 5 + 1) % 96).collect()];
    let step = |lens: [usize; 2], new: [&[u32]; 2]| {
        let mut b = ForwardBatch { block_table_stride: 3, num_kv_groups: 1, query_start_loc: vec![0], ..ForwardBatch::default() };
        for s in 0..2 {
            let start = lens[s] - new[s].len();
            b.token_ids.extend_from_slice(new[s]);
            b.positions.extend((start..lens[s]).map(|p| p as u32));
            b.slot_mapping.extend((start..lens[s]).map(|p| slot(s, p)));
            b.query_start_loc.push(b.token_ids.len() as u32);
            b.context_lens.push(lens[s] as u32);
            b.block_tables.extend_from_slice(&tables[s]);
            b.logits_indices.push(b.token_ids.len() as u32 - 1);
        }
        b
    };
    vec![
        exec.execute(&step([21, 9], [&prompts[0], &prompts[1]])).expect("prefill").logits,
        exec.execute(&step([22, 10], [&[11], &[40]])).expect("decode 1").logits,
        exec.execute(&step([23, 11], [&[95], &[0]])).expect("decode 2").logits,
    ]
}

/// The CUDA executor against the CPU's float32 path on the tiny Llama: its
/// float32 path within 2·10⁻³ of the largest logit; its bf16 path (tensor
/// cores on the 30-row prefill, the f32 GEMV on the 2-row decodes) within
/// 10% in relative L2 norm — the random model amplifies rounding about
/// fifty-fold (its float32 path is 6·10⁻⁶ off, 50 ulps), so bf16's 2⁻⁹
/// shows as a few percent, while a row or column out of place is O(1) —
/// and both with the same greedy tokens wherever the reference's top two
/// are further apart than the largest error.
#[test]
fn the_cuda_executor_matches_the_cpu_f32_path_on_a_tiny_llama_or_skips_without_a_gpu() {
    use vellum_backend_cuda::{CudaOps, CudaPrecision};
    use vellum_models::{GgufWeights, ModelRunner, WeightSource};
    let test = "the_cuda_executor_matches_the_cpu_f32_path_on_a_tiny_llama";
    // The reference half runs everywhere, so the harness is exercised in CI.
    let path = tiny_gguf("executor");
    let weights = GgufWeights::open(&path).expect("opens");
    let config = weights.model_config().expect("config");
    let cpu_ops = vellum_backend_cpu::CpuOps::new(vellum_backend_cpu::WeightFormat::F32);
    let mut cpu = ModelRunner::load(cpu_ops, &weights, config.clone(), |_, _| {}).expect("cpu loads");
    let want = run_steps(&mut cpu);
    for (i, w) in want.iter().enumerate() {
        assert_eq!(w.len(), 2 * 96, "step {i}: two rows of logits");
        assert!(w.iter().any(|x| x.abs() > 1e-2), "step {i}: reference logits are not trivially zero");
    }
    for precision in [CudaPrecision::Float32, CudaPrecision::Bf16] {
        let ops = match CudaOps::with_precision(0, precision) {
            Ok(ops) => ops,
            Err(e) => {
                assert!(std::env::var_os("VELLUM_REQUIRE_GPU").is_none(), "VELLUM_REQUIRE_GPU is set but: {e}");
                eprintln!("SKIPPED {test}: {e}");
                let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
                return;
            }
        };
        let mut gpu = ModelRunner::load(ops, &weights, config.clone(), |_, _| {}).expect("cuda loads");
        let got = run_steps(&mut gpu);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.len(), g.len(), "step {i}: logits length");
            let scale = w.iter().fold(1f32, |m, x| m.max(x.abs()));
            let worst = w.iter().zip(g).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let norm = |v: &mut dyn Iterator<Item = f32>| v.map(|x| (x as f64).powi(2)).sum::<f64>().sqrt();
            let rel_l2 = norm(&mut w.iter().zip(g).map(|(a, b)| a - b)) / norm(&mut w.iter().copied());
            eprintln!("{precision:?} step {i}: max |cuda - cpu| = {worst:.2e} (logits up to {scale:.2}), relative L2 {rel_l2:.2e}");
            match precision {
                CudaPrecision::Float32 => assert!(worst < 2e-3 * scale, "{precision:?} step {i}: logits differ by up to {worst}"),
                _ => assert!(rel_l2 < 0.1, "{precision:?} step {i}: relative L2 error {rel_l2}"),
            }
            for (rw, rg) in w.chunks(96).zip(g.chunks(96)) {
                let mut sorted = rw.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                if sorted[0] - sorted[1] > 2.0 * worst {
                    assert_eq!(argmax(rw), argmax(rg), "{precision:?} step {i}: greedy token");
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

/// Tensor parallelism on the tiny Llama (4 query heads, 2 KV heads, MLP 384,
/// vocabulary 96): split over 2 and 4 CPU ranks (4: each KV head on two
/// ranks), and over NCCL groups of every size the GPUs allow — 1, NCCL's
/// single-rank communicator, on any GPU; 2 and 4 where present — against
/// the whole model on the CPU's float32 path, within 10⁻⁴ of the largest
/// logit (only the order of the partial sums changes).
#[test]
fn tensor_parallel_groups_over_nccl_match_the_cpu_f32_path_or_skips_without_a_gpu() {
    use vellum_backend_cuda::{CudaOps, CudaPrecision};
    use vellum_models::{GgufWeights, ModelRunner, RunnerOptions, WeightSource};
    let test = "tensor_parallel_groups_over_nccl_match_the_cpu_f32_path";
    let path = tiny_gguf("tensor-parallel");
    let weights = GgufWeights::open(&path).expect("opens");
    let config = weights.model_config().expect("config");
    let cpu_ops = vellum_backend_cpu::CpuOps::new(vellum_backend_cpu::WeightFormat::F32);
    let want = run_steps(&mut ModelRunner::load(cpu_ops.clone(), &weights, config.clone(), |_, _| {}).expect("cpu loads"));
    let close = |got: &[Vec<f32>], what: &str| {
        for (i, (w, g)) in want.iter().zip(got).enumerate() {
            assert_eq!(w.len(), g.len(), "{what} step {i}: logits length");
            let scale = w.iter().fold(1f32, |m, x| m.max(x.abs()));
            let worst = w.iter().zip(g).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            eprintln!("{what} step {i}: max |split - whole| = {worst:.2e} (logits up to {scale:.2})");
            assert!(worst <= 1e-4 * scale, "{what} step {i}: logits differ by up to {worst}");
        }
    };
    let options = RunnerOptions::default();
    for size in [2, 4] {
        let group = cpu_ops.tensor_parallel_group(size);
        let mut split = ModelRunner::load_tensor_parallel(group, &weights, config.clone(), options, |_, _| {}).expect("cpu group loads");
        close(&run_steps(&mut split), &format!("cpu TP {size}"));
    }
    for size in [1, 2, 4] {
        let group = match CudaOps::tensor_parallel_group(size, CudaPrecision::Float32) {
            Ok(group) => group,
            Err(vellum_backend_cuda::CudaError::TooFewGpus { present, .. }) if size > 1 && present >= 1 => {
                eprintln!("SKIPPED {test} at TP {size}: {present} GPU(s)");
                continue;
            }
            Err(e) => {
                assert!(std::env::var_os("VELLUM_REQUIRE_GPU").is_none(), "VELLUM_REQUIRE_GPU is set but: {e}");
                eprintln!("SKIPPED {test} on CUDA: {e}");
                break;
            }
        };
        let mut split = ModelRunner::load_tensor_parallel(group, &weights, config.clone(), options, |_, _| {}).expect("cuda group loads");
        close(&run_steps(&mut split), &format!("cuda NCCL TP {size}"));
    }
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold((0, f32::MIN), |m, (j, &x)| if x > m.1 { (j, x) } else { m }).0
}

/// The shared conformance suite (`vellum-conformance`): every op and the
/// paged attention at the head sizes, block sizes and KV types the backend
/// declares, against the CPU's float32 path (the stacked-attention check
/// through the split that writes the cache, counted); its linears (1–40 rows) again
/// with no weight keeping a bf16 copy (the tensor-core GEMM past 2 rows,
/// where the default multiplies the copies through cuBLAS); and the fused
/// products again on the float32 path.
#[test]
fn the_conformance_suite_passes_or_skips_without_a_gpu() {
    let test = "the_conformance_suite_passes";
    match vellum_backend_cuda::CudaOps::new(0) {
        Ok(ops) => {
            assert!(vellum_base::AttentionBackend::describe(&ops).contains("cuda"));
            vellum_conformance::Suite::new("cuda").run(&ops);
            // Its stacked-attention check took the fused path (split writing the cache).
            assert!(ops.split_kv_writes() > 0, "attention_stacked never wrote the cache from the split");
            let apart =
                vellum_backend_cuda::CudaOps::new(0).expect("a second instance").with_weight_copies(vellum_base::WeightCopies::None);
            vellum_conformance::Suite::new("cuda, no bf16 copies").linear(&apart);
            // The float32 path fuses up to 8 rows (the GEMV's plans of 3–8
            // rows, an odd count of columns a warp paired for gate and up).
            let f32_path =
                vellum_backend_cuda::CudaOps::with_precision(0, vellum_backend_cuda::CudaPrecision::Float32).expect("a float32 instance");
            vellum_conformance::Suite::new("cuda, float32").fused_products(&f32_path);
        }
        Err(e) => {
            assert!(std::env::var_os("VELLUM_REQUIRE_GPU").is_none(), "VELLUM_REQUIRE_GPU is set but: {e}");
            eprintln!("SKIPPED {test}: {e}");
        }
    }
}

/// cuBLAS's 16-bit GEMM behind f16/bf16 weights, with the activations cast
/// by `cast_to_16`: against a float64 product of the same rounded inputs
/// (fresh random values, output poisoned first), decode- and prefill-sized.
#[test]
fn sixteen_bit_linear_on_tensor_cores_matches_the_float64_product_or_skips_without_a_gpu() {
    let test = "sixteen_bit_linear_on_tensor_cores_matches_the_float64_product";
    let Some(k) = gpu_or_skip(test) else { return };
    let blas = match Blas::new(k.stream().clone()) {
        Ok(b) => b,
        Err(e) => {
            assert!(std::env::var_os("VELLUM_REQUIRE_GPU").is_none(), "VELLUM_REQUIRE_GPU is set but: {e}");
            eprintln!("SKIPPED {test}: {e}");
            return;
        }
    };
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64) | 1;
    let mut rng = Rng(seed);
    for dtype in [Half::F16, Half::Bf16] {
        type Round = (fn(f32) -> u16, fn(u16) -> f32);
        let (to16, from16): Round = match dtype {
            Half::F16 => (|v| half::f16::from_f32(v).to_bits(), |b| half::f16::from_bits(b).to_f32()),
            Half::Bf16 => (|v| half::bf16::from_f32(v).to_bits(), |b| half::bf16::from_bits(b).to_f32()),
        };
        for (rows, n, kk) in [(1usize, 1000usize, 4096usize), (7, 333, 1000), (64, 2048, 512)] {
            let w: Vec<u16> = (0..n * kk).map(|_| to16(rng.f())).collect();
            let x = rng.vec(rows * kk);
            let w_dev = up(&k, &w);
            let x_dev = up(&k, &x);
            let mut x16 = up(&k, &vec![0u16; rows * kk]);
            k.cast_to_16(&mut x16, &x_dev, rows * kk, dtype).expect("cast");
            let cast = down(&k, &x16);
            // The cast is the host's round-to-nearest-even.
            for (i, (&c, &v)) in cast.iter().zip(&x).enumerate() {
                assert_eq!(c, to16(v), "{dtype:?} cast of element {i} ({v})");
            }
            let mut y = up(&k, &vec![f32::NAN; rows * n]);
            blas.linear_16(&mut y, &w_dev, &x16, dtype, rows, n, kk).expect("linear_16");
            let got = down(&k, &y);
            for r in 0..rows {
                for o in 0..n {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for i in 0..kk {
                        let p = from16(w[o * kk + i]) as f64 * from16(cast[r * kk + i]) as f64;
                        want += p;
                        mag += p.abs();
                    }
                    let g = got[r * n + o] as f64;
                    // f32 accumulation over k terms of exact 16-bit products.
                    let tol = 1e-6 * mag * (kk as f64).sqrt() + 1e-6;
                    assert!(
                        (g - want).abs() <= tol,
                        "{dtype:?} [{rows}x{kk}]·[{n}x{kk}]ᵀ ({r}, {o}): {g} vs {want} (tolerance {tol}, seed {seed})"
                    );
                }
            }
        }
    }
}

/// CUDA graphs (`crate::graphs`, `cudagraph_mode` FULL): decode steps
/// recorded and replayed give the logits the same steps give launched op by
/// op (`--enforce-eager`), through padding (3 sequences on graphs of 4 rows,
/// then 2), a context crossing a bound (512 → 1024: a second graph), and a
/// batch that changes shape; so do mixed steps (two decodes beside a prompt
/// chunk of 4–6 tokens that samples or not: two mixed keys, each warmed
/// up, recorded and replayed with new values); a replayed shape refuses a
/// token id outside the vocabulary by name, as the eager ops do.
#[test]
fn decode_steps_replayed_as_cuda_graphs_match_eager_launches_or_skips_without_a_gpu() {
    use vellum_backend_cuda::{CudaOps, GraphOptions};
    use vellum_base::{CudaGraphMode, ForwardBatch, ModelExecutor};
    use vellum_models::{GgufWeights, ModelRunner, WeightSource};
    let test = "decode_steps_replayed_as_cuda_graphs_match_eager_launches";
    // Contexts past 512: the tiny model with 1,024 positions.
    let path = tiny_gguf_with_context("graphs", 1024);
    let weights = GgufWeights::open(&path).expect("opens");
    let config = weights.model_config().expect("config");
    let load = |mode: CudaGraphMode| -> Option<ModelRunner<CudaOps>> {
        match CudaOps::new(0) {
            Ok(ops) => {
                let ops = ops.with_graphs(GraphOptions { mode, ..GraphOptions::default() });
                Some(ModelRunner::load(ops, &weights, config.clone(), |_, _| {}).expect("cuda loads"))
            }
            Err(e) => {
                assert!(std::env::var_os("VELLUM_REQUIRE_GPU").is_none(), "VELLUM_REQUIRE_GPU is set but: {e}");
                eprintln!("SKIPPED {test}: {e}");
                None
            }
        }
    };
    let (Some(mut eager), Some(mut graphs)) = (load(CudaGraphMode::None), load(CudaGraphMode::Full)) else {
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
        return;
    };
    const BS: usize = 16;
    const STRIDE: usize = 48;
    for exec in [&mut eager, &mut graphs] {
        exec.initialize_kv_cache(3 * STRIDE, 0, BS).expect("cache");
    }
    // Sequence s owns blocks s·48 .. s·48+48, in reverse order (not contiguous).
    let block = |s: usize, i: usize| (s * STRIDE + STRIDE - 1 - i) as u32;
    let batch = |seqs: &[(usize, usize, Vec<u32>)]| {
        // (sequence, context after the step, new tokens)
        let mut b = ForwardBatch { block_table_stride: STRIDE, num_kv_groups: 1, query_start_loc: vec![0], ..ForwardBatch::default() };
        for (s, len, new) in seqs {
            let start = len - new.len();
            b.token_ids.extend_from_slice(new);
            b.positions.extend((start..*len).map(|p| p as u32));
            b.slot_mapping.extend((start..*len).map(|p| block(*s, p / BS) * BS as u32 + (p % BS) as u32));
            b.query_start_loc.push(b.token_ids.len() as u32);
            b.context_lens.push(*len as u32);
            b.block_tables.extend((0..STRIDE).map(|i| block(*s, i)));
            b.logits_indices.push(b.token_ids.len() as u32 - 1);
        }
        b
    };
    let mut lens = [500usize, 30, 7];
    let prompt = |s: usize, n: usize| (0..n).map(|i| ((i * (7 + s) + 3 * s) % 96) as u32).collect::<Vec<u32>>();
    let first = batch(&[(0, lens[0], prompt(0, lens[0])), (1, lens[1], prompt(1, lens[1])), (2, lens[2], prompt(2, lens[2]))]);
    let mut next = Vec::new();
    let mut compare = |b: &ForwardBatch, what: &str, next: &mut Vec<u32>| {
        let want = eager.execute(b).expect("eager step").logits;
        let got = graphs.execute(b).expect("graph step").logits;
        assert_eq!(want.len(), got.len(), "{what}: logits length");
        let scale = want.iter().fold(1f32, |m, x| m.max(x.abs()));
        let worst = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-5 * scale, "{what}: replayed logits differ from eager ones by {worst} (scale {scale})");
        *next = want.chunks(96).map(|row| argmax(row) as u32).collect();
        worst
    };
    compare(&first, "prefill", &mut next);
    let mut worst = 0f32;
    for step in 0..30 {
        // Two sequences from step 20 on: the batch changes shape.
        let live: Vec<usize> = if step < 20 { vec![0, 1, 2] } else { vec![0, 1] };
        let seqs: Vec<(usize, usize, Vec<u32>)> = live
            .iter()
            .enumerate()
            .map(|(row, &s)| {
                lens[s] += 1;
                (s, lens[s], vec![next[row.min(next.len() - 1)]])
            })
            .collect();
        worst = worst.max(compare(&batch(&seqs), &format!("decode {step}"), &mut next));
    }
    // Mixed steps: sequences 0 and 1 decode beside a prompt chunk of
    // sequence 2 (4–6 tokens, 6–8 in all: 8 rows), which samples every
    // other step (4 logits rows, else 2). Each key is seen 8 times: warmed
    // up, recorded, then replayed with new tokens, positions and contexts.
    let mut mixed_worst = 0f32;
    for step in 0..16 {
        let chunk = 4 + step % 3;
        let sample = step % 2 == 0;
        lens[0] += 1;
        lens[1] += 1;
        lens[2] += chunk;
        let chunk_tokens: Vec<u32> = (lens[2] - chunk..lens[2]).map(|p| ((p * 5 + step) % 96) as u32).collect();
        let mut b = batch(&[(0, lens[0], vec![next[0]]), (1, lens[1], vec![next[1.min(next.len() - 1)]]), (2, lens[2], chunk_tokens)]);
        if !sample {
            b.logits_indices.pop();
        }
        mixed_worst = mixed_worst.max(compare(&b, &format!("mixed {step}"), &mut next));
    }
    let (recorded, ms) = graphs.ops().recorded_graphs();
    let (memory, high) = graphs.ops().graph_memory();
    eprintln!(
        "{test}: recorded {recorded:?} in {ms:.1} ms, graph memory {} KiB (peak {} KiB), largest gap {worst:.2e} (decode), {mixed_worst:.2e} (mixed)",
        memory >> 10,
        high >> 10
    );
    let decode: Vec<(usize, usize)> = recorded.iter().filter(|k| !k.mixed).map(|k| (k.rows, k.context_bucket)).collect();
    for key in [(4, 512), (4, 1024), (2, 1024)] {
        assert!(decode.contains(&key), "no graph of {key:?} in {recorded:?}");
    }
    let mixed: Vec<(usize, usize)> = recorded.iter().filter(|k| k.mixed).map(|k| (k.rows, k.logits_rows)).collect();
    assert_eq!(mixed.len(), 2, "two mixed keys recorded: {recorded:?}");
    for key in [(8, 4), (8, 2)] {
        assert!(mixed.contains(&key), "no mixed graph of {key:?} in {recorded:?}");
    }
    // A token outside the vocabulary on a replayed shape: refused by name.
    lens[0] += 1;
    lens[1] += 1;
    let bad = batch(&[(0, lens[0], vec![96]), (1, lens[1], vec![5])]);
    let e = graphs.execute(&bad).expect_err("token 96 of 96").to_string();
    assert!(e.contains("token id 96"), "{e}");
    let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
}
