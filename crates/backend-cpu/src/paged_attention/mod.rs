//! Paged attention on the CPU: the fused K/V block write and causal attention
//! of a mixed prefill/decode batch through block tables (vLLM paper §4.1, §5.1).
//!
//! # Layouts
//!
//! ```text
//! q, out        [num_tokens, num_heads, head_dim]        rows of all sequences, back to back
//! k, v (new)    [num_tokens, num_kv_heads, head_dim]
//! cache.k/.v    [num_blocks, block_size, num_kv_heads, head_dim]   (see crate::kv_cache)
//!
//! query_start_loc  [0, q0, q0+q1, …]       sequence s owns rows qsl[s]..qsl[s+1]
//! context_lens[s]  tokens of s in the cache, this step's included
//! block_tables     row s = physical blocks of s, `block_table_stride` entries
//!
//! sequence s, q_len = qsl[s+1]-qsl[s], ctx = context_lens[s]:
//!
//!   positions   0 1 2 … ctx-q_len-1 | ctx-q_len … ctx-1
//!               └ earlier context ┘  └ this step's rows ┘
//!   row i sits at position p = ctx - q_len + i and attends to 0..=p
//!   position p lives in block block_tables[s*stride + p / bs], offset p % bs
//! ```
//!
//! # Kernel
//!
//! A work item is one query row and a range of kv heads, each with the
//! `group = num_heads / num_kv_heads` query heads that share it
//! (grouped-query attention), so every key and value row is loaded once per
//! group. Its output is the contiguous run of `out` it owns, so items run in
//! parallel on rayon without synchronisation. With enough rows (a decode
//! batch, a prefill) an item takes all kv heads of its row and reads each
//! cached token as one dense `num_kv_heads * head_dim` run; with few rows (a
//! single decode) it takes one kv head, to give every thread work.
//!
//! ```text
//! item (row t, kv heads a..b):  q[t, a*group .. b*group, :]  ->  out[t, same]
//! per tile of TILE positions:
//!   runs     = the tile's rows, one run per block touched (resolved once)
//!   scores   [heads, TILE]  = scale * q_h · k_{pos, kv(h)}
//!   m, l     running max and sum per head; out *= exp(m_old - m_new)
//!   out_h   += Σ_pos exp(score - m) * v_{pos, kv(h)}      (16-lane register blocks)
//! ```
//!
//! Each item makes a single pass over its context in tiles of `TILE` (64)
//! positions (flash-style online softmax), reading keys and values in place
//! through the block table — nothing is gathered into a contiguous buffer. The
//! next tile's keys and the current tile's values are prefetched: every block
//! of the paged layout starts a new memory stream that the hardware
//! prefetcher would only pick up after a few misses. Dot products, `exp`
//! (a branch-free polynomial) and value accumulation run over contiguous
//! `head_dim` slices with `chunks_exact` and fixed-width `f32` accumulators so
//! that LLVM vectorises them. On CPUs with AVX2, FMA and F16C the kernel is
//! compiled a second time for them (`attend_group_simd`, picked at run time),
//! and `f16`/`bf16` pools are widened sixteen values at a time in registers
//! inside the tile; the baseline build widens each tile into scratch first.
//! Where the CPU kernel is AVX-512 VNNI and a query group has several heads,
//! the tile's score and value loops run on 512-bit registers, each key and
//! value chunk loaded once for up to four heads (`kernel/wide.rs`): the
//! same operations per element in the same order, so the same bits.
//!
//! `contiguous_attention` (feature `reference`) is the same kernel over
//! per-sequence contiguous K/V: a reference for the tests and the baseline
//! of the benchmark.

mod kernel;

use kernel::{attend, check_query_start_loc, run_items, KvElem, Rows, Shape};
use vellum_base::{fp8, AttentionMetadata, AttentionShape, KvCacheDtype, KvScale};

use crate::kv_cache::{KvCacheLayout, KvPool, LayerKvCache};

/// Writes the new tokens' K and V (`[num_tokens, num_kv_heads, head_dim]`)
/// into their slots: `slot = block_id * block_size + offset` (paper §5.1
/// "fused reshape and block write").
///
/// ```text
/// k[t, :, :]  ──►  cache.k[slot_mapping[t] / bs, slot_mapping[t] % bs, :, :]
/// ```
///
/// `scale` is the layer's ([`KvScale`]): keys are stored as `k · (1 /
/// scale.k)`, values as `v · (1 / scale.v)` (an unscaled cache takes
/// [`KvScale::ONE`]).
///
/// # Panics
/// If `k`/`v` do not hold `slot_mapping.len()` tokens, a slot is outside the
/// pool, or the pools do not match `layout`.
pub fn write_kv(cache: &mut LayerKvCache, layout: &KvCacheLayout, k: &[f32], v: &[f32], slot_mapping: &[u32], scale: KvScale) {
    cache.assert_layout(layout, "write_kv");
    let row = layout.slot_elems();
    let n = slot_mapping.len();
    assert!(
        k.len() == n * row && v.len() == n * row,
        "write_kv: k/v hold {}/{} floats, {n} tokens × {} kv heads × {} head_dim need {}",
        k.len(),
        v.len(),
        layout.num_kv_heads,
        layout.head_dim,
        n * row
    );
    if row == 0 {
        return;
    }
    let num_slots = layout.num_slots();
    let (k_inv, v_inv) = (1.0 / scale.k, 1.0 / scale.v);
    for ((&slot, k_row), v_row) in slot_mapping.iter().zip(k.chunks_exact(row)).zip(v.chunks_exact(row)) {
        let slot = slot as usize;
        assert!(slot < num_slots, "write_kv: slot {slot} outside the pool of {num_slots} slots");
        cache.k.write_scaled(slot * row, k_row, k_inv);
        cache.v.write_scaled(slot * row, v_row, v_inv);
    }
}

/// Causal paged attention over a mixed batch (prefill chunks and decodes).
///
/// `q`, `out`: `[num_tokens, num_heads, head_dim]`. Sequence `s` owns query
/// rows `query_start_loc[s]..query_start_loc[s+1]`; its context in the cache
/// has `context_lens[s]` tokens (including this step's new ones, already
/// written by [`write_kv`]). Query row `i` of sequence `s` sits at position
/// `context_lens[s] - q_len + i` and attends to cache positions `0..=` that
/// position (the last `attn.sliding_window` of them with a window; all
/// `context_lens[s]` of them when `attn.causal` is false), read
/// through block table row `s` (`block_tables[s * stride + pos / block_size]`).
/// Grouped-query attention: query head `h` reads kv head
/// `h / (num_heads / num_kv_heads)`. Softmax in `f32` with max subtraction;
/// `attn.scale` multiplies `q·k`, then the soft-cap applies if any.
/// `scale` is the layer's, as [`write_kv`] stored it: the key scale (and,
/// for FP8, the 2⁸ of its widening) joins `attn.scale`, the value scale
/// multiplies the outputs.
///
/// # Panics
/// On any shape mismatch between `q`, `out`, `layout`, `cache` and `meta`, a
/// block table too short for its context, or a block id outside the pool —
/// these are engine invariants, not user input.
pub fn paged_attention(
    out: &mut [f32],
    q: &[f32],
    cache: &LayerKvCache,
    layout: &KvCacheLayout,
    meta: &AttentionMetadata<'_>,
    attn: &AttentionShape,
    scale: KvScale,
) {
    cache.assert_layout(layout, "paged_attention");
    assert!(
        attn.num_kv_heads == layout.num_kv_heads && attn.head_dim == layout.head_dim,
        "paged_attention: {} kv heads of {} for a cache of {} kv heads of {}",
        attn.num_kv_heads,
        attn.head_dim,
        layout.num_kv_heads,
        layout.head_dim
    );
    assert_eq!(meta.block_size, layout.block_size, "paged_attention: metadata block_size differs from the cache layout's");
    assert!(layout.block_size > 0, "paged_attention: block_size is 0");
    // The kernel reads an FP8 code as its value / 2⁸ (kernel::FP8_F16_UNITS).
    let unit = if cache.dtype() == KvCacheDtype::Fp8E4m3 { fp8::F16_UNIT } else { 1.0 };
    let shape = Shape {
        scale: attn.scale * (scale.k * unit),
        softcap: attn.logit_softcap,
        v_scale: scale.v * unit,
        ..Shape::new(attn.num_heads, layout.num_kv_heads, layout.head_dim, "paged_attention")
    };
    let num_seqs = check_query_start_loc(meta.query_start_loc, "paged_attention");
    let num_tokens = meta.query_start_loc[num_seqs] as usize;
    shape.check_rows(q, out, num_tokens, "paged_attention");
    assert_eq!(
        meta.context_lens.len(),
        num_seqs,
        "paged_attention: context_lens has {} entries for {num_seqs} sequences",
        meta.context_lens.len()
    );
    let stride = meta.block_table_stride;
    assert!(
        meta.block_tables.len() >= num_seqs * stride,
        "paged_attention: block_tables has {} entries, {num_seqs} rows × stride {stride} need {}",
        meta.block_tables.len(),
        num_seqs * stride
    );
    let mut work = 0usize;
    for s in 0..num_seqs {
        let ctx = meta.context_lens[s] as usize;
        let q_len = (meta.query_start_loc[s + 1] - meta.query_start_loc[s]) as usize;
        assert!(q_len <= ctx, "paged_attention: sequence {s} has {q_len} query rows but a context of only {ctx}");
        let n_blocks = ctx.div_ceil(layout.block_size);
        assert!(
            n_blocks <= stride,
            "paged_attention: sequence {s} needs {n_blocks} blocks for {ctx} tokens, \
             block_table_stride is {stride}"
        );
        if let Some(&b) = meta.block_tables[s * stride..s * stride + n_blocks].iter().find(|&&b| b as usize >= layout.num_blocks) {
            panic!("paged_attention: sequence {s} uses block {b}, the pool has {} blocks", layout.num_blocks);
        }
        // Σ over rows of (row position + 1) context entries.
        work += q_len * (2 * ctx - q_len + 1) / 2;
    }
    let call = PagedCall { meta, shape, block_size: layout.block_size, work, window: attn.sliding_window, causal: attn.causal };
    match (&cache.k, &cache.v) {
        (KvPool::F32(k), KvPool::F32(v)) => call.run(out, q, k, v),
        (KvPool::F16(k), KvPool::F16(v)) => call.run(out, q, k, v),
        (KvPool::Bf16(k), KvPool::Bf16(v)) => call.run(out, q, k, v),
        (KvPool::Fp8E4m3(k), KvPool::Fp8E4m3(v)) => call.run(out, q, k, v),
        _ => unreachable!("paged_attention: assert_layout checks that K and V share a dtype"),
    }
}

/// A validated [`paged_attention`] call, run over pools of element type `T`.
struct PagedCall<'a, 'm> {
    meta: &'a AttentionMetadata<'m>,
    shape: Shape,
    block_size: usize,
    work: usize,
    window: Option<usize>,
    /// `false`: every query of a sequence sees its whole context (an encoder).
    causal: bool,
}

impl PagedCall<'_, '_> {
    fn run<T: KvElem>(&self, out: &mut [f32], q: &[f32], k: &[T], v: &[T]) {
        let (meta, shape, block_size) = (self.meta, &self.shape, self.block_size);
        let stride = meta.block_table_stride;
        let item = |t: usize, kv_head: usize, q: &[f32], out: &mut [f32], scratch: &mut Vec<f32>| {
            let s = meta.query_start_loc.partition_point(|&x| x as usize <= t) - 1;
            let q_len = (meta.query_start_loc[s + 1] - meta.query_start_loc[s]) as usize;
            let ctx = meta.context_lens[s] as usize;
            let i = t - meta.query_start_loc[s] as usize;
            let table = &meta.block_tables[s * stride..(s + 1) * stride];
            let n_ctx = if self.causal { ctx - q_len + i + 1 } else { ctx };
            let first = self.window.map_or(0, |w| n_ctx.saturating_sub(w));
            let rows = Rows { k, v, row_stride: shape.kv_row(), head_off: kv_head * shape.head_dim };
            attend(out, q, &rows, first..n_ctx, block_size, |b| table[b] as usize * block_size, shape, scratch);
        };
        run_items(out, q, shape, self.work, item);
    }
}

/// The same attention over contiguous per-sequence K/V: `k[s]`, `v[s]` are
/// `[context_len_s, num_kv_heads, head_dim]` (the whole context of sequence
/// `s`, this step's tokens last). The reference of the tests and the baseline
/// of the benchmark; it shares the paged kernel, with the context as one run.
///
/// # Panics
/// On shape mismatches, as [`paged_attention`].
#[allow(clippy::too_many_arguments)] // Signature fixed by the backend plan; mirrors `paged_attention`.
#[cfg(any(test, feature = "reference"))]
pub fn contiguous_attention(
    out: &mut [f32],
    q: &[f32],
    k: &[&[f32]],
    v: &[&[f32]],
    query_start_loc: &[u32],
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scale: f32,
) {
    let shape = Shape { scale, ..Shape::new(num_heads, num_kv_heads, head_dim, "contiguous_attention") };
    let num_seqs = check_query_start_loc(query_start_loc, "contiguous_attention");
    let num_tokens = query_start_loc[num_seqs] as usize;
    shape.check_rows(q, out, num_tokens, "contiguous_attention");
    assert!(
        k.len() == num_seqs && v.len() == num_seqs,
        "contiguous_attention: {}/{} K/V sequences for {num_seqs} sequences",
        k.len(),
        v.len()
    );
    let row = shape.kv_row();
    let mut work = 0usize;
    for s in 0..num_seqs {
        assert!(
            k[s].len() == v[s].len() && k[s].len().is_multiple_of(row),
            "contiguous_attention: sequence {s} K/V hold {}/{} floats, not whole rows of {row}",
            k[s].len(),
            v[s].len()
        );
        let ctx = k[s].len() / row;
        let q_len = (query_start_loc[s + 1] - query_start_loc[s]) as usize;
        assert!(q_len <= ctx, "contiguous_attention: sequence {s} has {q_len} query rows but a context of only {ctx}");
        work += q_len * (2 * ctx - q_len + 1) / 2;
    }
    let item = |t: usize, kv_head: usize, q: &[f32], out: &mut [f32], scratch: &mut Vec<f32>| {
        let s = query_start_loc.partition_point(|&x| x as usize <= t) - 1;
        let q_len = (query_start_loc[s + 1] - query_start_loc[s]) as usize;
        let ctx = k[s].len() / row;
        let i = t - query_start_loc[s] as usize;
        let n_ctx = ctx - q_len + i + 1;
        let rows = Rows { k: k[s], v: v[s], row_stride: row, head_off: kv_head * shape.head_dim };
        attend(out, q, &rows, 0..n_ctx, n_ctx, |_| 0, &shape, scratch);
    };
    run_items(out, q, &shape, work, item);
}
