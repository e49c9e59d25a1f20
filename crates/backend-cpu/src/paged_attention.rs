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
//! that LLVM vectorises them.
//!
//! [`contiguous_attention`] is the same kernel over per-sequence contiguous
//! K/V: a reference for the tests and the baseline of the benchmark.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;
use vellum_core::AttentionMetadata;

use crate::kv_cache::{KvCacheLayout, KvPool, LayerKvCache};

/// Positions per online-softmax tile.
const TILE: usize = 64;

/// Below this many multiply-adds (`Σ rows × context × num_heads × head_dim`)
/// a batch runs on the calling thread: rayon's fork/join costs more than it
/// saves.
const PAR_MIN_WORK: usize = 1 << 17;

/// Writes the new tokens' K and V (`[num_tokens, num_kv_heads, head_dim]`)
/// into their slots: `slot = block_id * block_size + offset` (paper §5.1
/// "fused reshape and block write").
///
/// ```text
/// k[t, :, :]  ──►  cache.k[slot_mapping[t] / bs, slot_mapping[t] % bs, :, :]
/// ```
///
/// # Panics
/// If `k`/`v` do not hold `slot_mapping.len()` tokens, a slot is outside the
/// pool, or the pools do not match `layout`.
pub fn write_kv(
    cache: &mut LayerKvCache,
    layout: &KvCacheLayout,
    k: &[f32],
    v: &[f32],
    slot_mapping: &[u32],
) {
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
    for ((&slot, k_row), v_row) in slot_mapping
        .iter()
        .zip(k.chunks_exact(row))
        .zip(v.chunks_exact(row))
    {
        let slot = slot as usize;
        assert!(
            slot < num_slots,
            "write_kv: slot {slot} outside the pool of {num_slots} slots"
        );
        cache.k.write_f32(slot * row, k_row);
        cache.v.write_f32(slot * row, v_row);
    }
}

/// Causal paged attention over a mixed batch (prefill chunks and decodes).
///
/// `q`, `out`: `[num_tokens, num_heads, head_dim]`. Sequence `s` owns query
/// rows `query_start_loc[s]..query_start_loc[s+1]`; its context in the cache
/// has `context_lens[s]` tokens (including this step's new ones, already
/// written by [`write_kv`]). Query row `i` of sequence `s` sits at position
/// `context_lens[s] - q_len + i` and attends to cache positions `0..=` that
/// position, read through block table row `s`
/// (`block_tables[s * stride + pos / block_size]`). Grouped-query attention:
/// query head `h` reads kv head `h / (num_heads / num_kv_heads)`. Softmax in
/// `f32` with max subtraction; `scale` multiplies `q·k`.
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
    num_heads: usize,
    scale: f32,
) {
    cache.assert_layout(layout, "paged_attention");
    assert_eq!(
        meta.block_size, layout.block_size,
        "paged_attention: metadata block_size differs from the cache layout's"
    );
    assert!(layout.block_size > 0, "paged_attention: block_size is 0");
    let shape = Shape::new(
        num_heads,
        layout.num_kv_heads,
        layout.head_dim,
        "paged_attention",
    );
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
        assert!(
            q_len <= ctx,
            "paged_attention: sequence {s} has {q_len} query rows but a context of only {ctx}"
        );
        let n_blocks = ctx.div_ceil(layout.block_size);
        assert!(
            n_blocks <= stride,
            "paged_attention: sequence {s} needs {n_blocks} blocks for {ctx} tokens, \
             block_table_stride is {stride}"
        );
        if let Some(&b) = meta.block_tables[s * stride..s * stride + n_blocks]
            .iter()
            .find(|&&b| b as usize >= layout.num_blocks)
        {
            panic!(
                "paged_attention: sequence {s} uses block {b}, the pool has {} blocks",
                layout.num_blocks
            );
        }
        // Σ over rows of (row position + 1) context entries.
        work += q_len * (2 * ctx - q_len + 1) / 2;
    }
    let call = PagedCall {
        meta,
        shape,
        block_size: layout.block_size,
        work,
        scale,
    };
    match (&cache.k, &cache.v) {
        (KvPool::F32(k), KvPool::F32(v)) => call.run(out, q, k, v),
        (KvPool::F16(k), KvPool::F16(v)) => call.run(out, q, k, v),
        (KvPool::Bf16(k), KvPool::Bf16(v)) => call.run(out, q, k, v),
        _ => unreachable!("paged_attention: assert_layout checks that K and V share a dtype"),
    }
}

/// A validated [`paged_attention`] call, run over pools of element type `T`.
struct PagedCall<'a, 'm> {
    meta: &'a AttentionMetadata<'m>,
    shape: Shape,
    block_size: usize,
    work: usize,
    scale: f32,
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
            let n_ctx = ctx - q_len + i + 1;
            let rows = Rows {
                k,
                v,
                row_stride: shape.kv_row(),
                head_off: kv_head * shape.head_dim,
            };
            attend_group(
                out,
                q,
                &rows,
                n_ctx,
                block_size,
                |b| table[b] as usize * block_size,
                shape,
                self.scale,
                scratch,
            );
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
    let shape = Shape::new(num_heads, num_kv_heads, head_dim, "contiguous_attention");
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
            k[s].len() == v[s].len() && k[s].len() % row == 0,
            "contiguous_attention: sequence {s} K/V hold {}/{} floats, not whole rows of {row}",
            k[s].len(),
            v[s].len()
        );
        let ctx = k[s].len() / row;
        let q_len = (query_start_loc[s + 1] - query_start_loc[s]) as usize;
        assert!(
            q_len <= ctx,
            "contiguous_attention: sequence {s} has {q_len} query rows but a context of only {ctx}"
        );
        work += q_len * (2 * ctx - q_len + 1) / 2;
    }
    let item = |t: usize, kv_head: usize, q: &[f32], out: &mut [f32], scratch: &mut Vec<f32>| {
        let s = query_start_loc.partition_point(|&x| x as usize <= t) - 1;
        let q_len = (query_start_loc[s + 1] - query_start_loc[s]) as usize;
        let ctx = k[s].len() / row;
        let i = t - query_start_loc[s] as usize;
        let n_ctx = ctx - q_len + i + 1;
        let rows = Rows {
            k: k[s],
            v: v[s],
            row_stride: row,
            head_off: kv_head * shape.head_dim,
        };
        attend_group(out, q, &rows, n_ctx, n_ctx, |_| 0, &shape, scale, scratch);
    };
    run_items(out, q, &shape, work, item);
}

/// Head counts and sizes of one attention call, validated.
#[derive(Clone, Copy, Debug)]
struct Shape {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    /// Query heads per kv head.
    group: usize,
}

impl Shape {
    fn new(num_heads: usize, num_kv_heads: usize, head_dim: usize, what: &str) -> Self {
        assert!(
            num_kv_heads > 0 && num_heads > 0 && num_heads % num_kv_heads == 0,
            "{what}: num_heads {num_heads} is not a positive multiple of num_kv_heads {num_kv_heads}"
        );
        assert!(head_dim > 0, "{what}: head_dim is 0");
        Self {
            num_heads,
            num_kv_heads,
            head_dim,
            group: num_heads / num_kv_heads,
        }
    }

    /// Floats per token in the K/V layout.
    fn kv_row(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Floats of one work item's query/output run: its group of query heads.
    fn group_len(&self) -> usize {
        self.group * self.head_dim
    }

    fn check_rows(&self, q: &[f32], out: &[f32], num_tokens: usize, what: &str) {
        let n = num_tokens * self.num_heads * self.head_dim;
        assert!(
            q.len() == n && out.len() == n,
            "{what}: q/out hold {}/{} floats, {num_tokens} tokens × {} heads × {} head_dim need {n}",
            q.len(),
            out.len(),
            self.num_heads,
            self.head_dim
        );
    }
}

/// Asserts `query_start_loc` is a non-decreasing offset list starting at 0;
/// returns the number of sequences.
fn check_query_start_loc(query_start_loc: &[u32], what: &str) -> usize {
    assert!(
        query_start_loc.first() == Some(&0),
        "{what}: query_start_loc must start with 0, got {:?}",
        query_start_loc.first()
    );
    assert!(
        query_start_loc.windows(2).all(|w| w[0] <= w[1]),
        "{what}: query_start_loc is not non-decreasing"
    );
    query_start_loc.len() - 1
}

/// Runs `item(token, first_kv_head, q_run, out_run, scratch)` for every work
/// item, on rayon when the batch is big enough.
///
/// A work item is one query row and either one kv head or all of them:
/// `q_run`/`out_run` are its `[kv_heads_per_item * group, head_dim]` slices
/// of `q` and `out`. With many rows to share out, an item takes all kv heads,
/// so that it reads every K/V row of the cache as one contiguous
/// `num_kv_heads * head_dim` run (dense, prefetch-friendly streams through
/// each block); with few rows (a single decode), one kv head per item gives
/// the threads something to split.
fn run_items<F>(out: &mut [f32], q: &[f32], shape: &Shape, work: usize, item: F)
where
    F: Fn(usize, usize, &[f32], &mut [f32], &mut Vec<f32>) + Sync,
{
    let threads = rayon::current_num_threads();
    let work = work.saturating_mul(shape.num_heads * shape.head_dim);
    let parallel = work >= PAR_MIN_WORK && threads >= 2;
    let num_tokens = out.len() / (shape.num_heads * shape.head_dim);
    let kv_per_item = if parallel && num_tokens < 4 * threads {
        1
    } else {
        shape.num_kv_heads
    };
    let items_per_token = shape.num_kv_heads / kv_per_item;
    let run = kv_per_item * shape.group_len();
    let split = |c: usize| (c / items_per_token, (c % items_per_token) * kv_per_item);
    if !parallel {
        let mut scratch = Vec::new();
        for (c, (q, o)) in q
            .chunks_exact(run)
            .zip(out.chunks_exact_mut(run))
            .enumerate()
        {
            let (t, kv_head) = split(c);
            item(t, kv_head, q, o, &mut scratch);
        }
    } else {
        // Aim for a few items per split so small items do not drown in
        // fork/join overhead while large prefills still balance.
        let n_items = out.len() / run;
        let min_len = (n_items / (8 * threads)).max(1);
        out.par_chunks_mut(run)
            .zip(q.par_chunks(run))
            .with_min_len(min_len)
            .enumerate()
            .for_each_init(Vec::new, |scratch, (c, (o, q))| {
                let (t, kv_head) = split(c);
                item(t, kv_head, q, o, scratch)
            });
    }
}

/// Keys and values of one kv head: row `r` (a token) of the head starts at
/// `r * row_stride + head_off` in `k` and `v`.
struct Rows<'a, T> {
    k: &'a [T],
    v: &'a [T],
    row_stride: usize,
    head_off: usize,
}

/// An element type of the KV pools, read by the kernel as `f32`.
trait KvElem: Copy + Send + Sync {
    /// The slice itself when the elements already are `f32`: the kernel then
    /// reads the pools in place. `None` for `f16`/`bf16`, which the kernel
    /// widens tile by tile into scratch.
    fn as_f32(x: &[Self]) -> Option<&[f32]>;

    /// `dst[i] = src[i] as f32` (same lengths).
    fn widen(src: &[Self], dst: &mut [f32]);
}

impl KvElem for f32 {
    #[inline(always)]
    fn as_f32(x: &[f32]) -> Option<&[f32]> {
        Some(x)
    }

    #[inline(always)]
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn as_f32(_: &[f16]) -> Option<&[f32]> {
        None
    }

    /// `half` uses the F16C instructions when the CPU has them.
    #[inline(always)]
    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
}

impl KvElem for bf16 {
    #[inline(always)]
    fn as_f32(_: &[bf16]) -> Option<&[f32]> {
        None
    }

    /// A shift into the high half of an `f32`: exact.
    #[inline(always)]
    fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
}

/// Attention of the query heads in `q` (`[n_kv * group, head_dim]`, the
/// groups of `n_kv = q.len() / (group * head_dim)` consecutive kv heads,
/// the first at `rows.head_off`) over context positions `0..n_ctx`, written
/// to `out` (same shape as `q`).
///
/// The context is made of runs of `run_len` consecutive positions; run `r`
/// starts at row `run_row(r)` of `rows` (a block of the block table, or the
/// whole contiguous context). One pass over tiles of [`TILE`] positions with
/// an online softmax; `out` is the accumulator. `f32` pools are read in
/// place; `f16`/`bf16` pools are widened one tile at a time into two dense
/// `[TILE, n_kv * head_dim]` scratch buffers (K and V), which the same tile
/// code then reads.
#[allow(clippy::too_many_arguments)] // Private kernel; a struct would only rename the arguments.
#[inline]
fn attend_group<T: KvElem>(
    out: &mut [f32],
    q: &[f32],
    rows: &Rows<'_, T>,
    n_ctx: usize,
    run_len: usize,
    run_row: impl Fn(usize) -> usize,
    shape: &Shape,
    scale: f32,
    scratch: &mut Vec<f32>,
) {
    // Query heads of the item.
    let n_q = q.len() / shape.head_dim;
    // Elements of one row of the item's kv heads.
    let row_len = q.len() / shape.group;
    let in_place = T::as_f32(rows.k).zip(T::as_f32(rows.v));
    let widened_len = if in_place.is_some() { 0 } else { TILE * row_len };
    // scratch: scores [n_q, TILE], running max [n_q], running sum [n_q],
    // then (f16/bf16 only) the widened K and V of the tile.
    scratch.clear();
    scratch.resize(n_q * TILE + 2 * n_q + 2 * widened_len, 0.0);
    let (scores, rest) = scratch.split_at_mut(n_q * TILE);
    let (m, rest) = rest.split_at_mut(n_q);
    let (l, rest) = rest.split_at_mut(n_q);
    let (k_tile, v_tile) = rest.split_at_mut(widened_len);
    m.fill(f32::NEG_INFINITY);
    out.fill(0.0);
    let mut state = SoftmaxState { scores, m, l };

    let prefetch_next = |runs: &TileRuns| {
        runs.for_each_row(rows.row_stride, |_, base| {
            prefetch(&rows.k[base..base + row_len]);
            if in_place.is_none() {
                prefetch(&rows.v[base..base + row_len]);
            }
        });
    };
    // Row runs of the current tile and of the next one.
    let mut runs = TileRuns::new(rows, 0, TILE.min(n_ctx), run_len, &run_row);
    prefetch_next(&runs);
    let mut tile_start = 0;
    while tile_start < n_ctx {
        let tile_end = (tile_start + TILE).min(n_ctx);
        let tile_len = tile_end - tile_start;
        // The next tile's keys stream in while this one is computed: in the
        // paged layout every block starts a new stream that the hardware
        // prefetcher would only pick up after a few misses.
        let next = TileRuns::new(
            rows,
            tile_end,
            (tile_end + TILE).min(n_ctx),
            run_len,
            &run_row,
        );
        prefetch_next(&next);
        match in_place {
            Some((k, v)) => {
                let rows = Rows {
                    k,
                    v,
                    row_stride: rows.row_stride,
                    head_off: rows.head_off,
                };
                attend_tile(out, q, &rows, &runs, tile_len, shape, scale, &mut state);
            }
            None => {
                runs.for_each_row(rows.row_stride, |j, base| {
                    let dst = j * row_len..(j + 1) * row_len;
                    T::widen(&rows.k[base..base + row_len], &mut k_tile[dst.clone()]);
                    T::widen(&rows.v[base..base + row_len], &mut v_tile[dst]);
                });
                let dense = Rows {
                    k: &*k_tile,
                    v: &*v_tile,
                    row_stride: row_len,
                    head_off: 0,
                };
                let dense_runs = TileRuns::one(tile_len);
                attend_tile(out, q, &dense, &dense_runs, tile_len, shape, scale, &mut state);
            }
        }
        tile_start = tile_end;
        runs = next;
    }

    for (g, o) in out.chunks_exact_mut(shape.head_dim).enumerate() {
        let inv = 1.0 / state.l[g];
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

/// Online-softmax state of one work item: the tile's scores `[n_q, TILE]`
/// and the running max `m` and sum `l` of each query head.
struct SoftmaxState<'a> {
    scores: &'a mut [f32],
    m: &'a mut [f32],
    l: &'a mut [f32],
}

/// One tile of [`attend_group`] over `f32` rows: scores, online-softmax
/// rescaling of `out`, value accumulation.
#[allow(clippy::too_many_arguments)] // Private kernel; a struct would only rename the arguments.
#[inline(always)]
fn attend_tile(
    out: &mut [f32],
    q: &[f32],
    rows: &Rows<'_, f32>,
    runs: &TileRuns,
    tile_len: usize,
    shape: &Shape,
    scale: f32,
    state: &mut SoftmaxState<'_>,
) {
    let hd = shape.head_dim;
    let group_len = shape.group_len();
    let row_len = q.len() / shape.group;
    let SoftmaxState { scores, m, l } = state;

    // 1. Scores of the tile: s[h, j] = scale * q_h · k_{j, kv(h)}; the
    //    item's kv heads of row j lie next to each other.
    runs.for_each_row(rows.row_stride, |j, base| {
        prefetch(&rows.v[base..base + row_len]);
        for (kv, q_kv) in q.chunks_exact(group_len).enumerate() {
            let k_row = &rows.k[base + kv * hd..base + (kv + 1) * hd];
            for (g, q_h) in q_kv.chunks_exact(hd).enumerate() {
                scores[(kv * shape.group + g) * TILE + j] = scale * dot(q_h, k_row);
            }
        }
    });

    // 2. Online softmax: rescale the running state to the new max.
    for g in 0..m.len() {
        let s = &mut scores[g * TILE..g * TILE + tile_len];
        let tile_max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let m_new = m[g].max(tile_max);
        let correction = (m[g] - m_new).exp(); // exp(-inf) = 0 on the first tile
        l[g] = l[g] * correction + exp_shifted(s, m_new);
        m[g] = m_new;
        if correction != 1.0 {
            out[g * hd..(g + 1) * hd]
                .iter_mut()
                .for_each(|o| *o *= correction);
        }
    }

    // 3. Accumulate the tile's values: out_g += Σ_j p[g, j] * v_j, one
    //    LANES-wide chunk of head_dim at a time so the accumulator stays
    //    in registers across the tile's rows.
    for (g, o) in out.chunks_exact_mut(hd).enumerate() {
        let p = &scores[g * TILE..g * TILE + tile_len];
        let v_off = (g / shape.group) * hd;
        let mut c = 0;
        while c + LANES <= hd {
            let mut acc = [0.0f32; LANES];
            acc.copy_from_slice(&o[c..c + LANES]);
            runs.for_each_row(rows.row_stride, |j, base| {
                let v = &rows.v[base + v_off + c..base + v_off + c + LANES];
                let pj = p[j];
                for (a, x) in acc.iter_mut().zip(v) {
                    *a += pj * x;
                }
            });
            o[c..c + LANES].copy_from_slice(&acc);
            c += LANES;
        }
        if c < hd {
            let o = &mut o[c..];
            runs.for_each_row(rows.row_stride, |j, base| {
                axpy(o, p[j], &rows.v[base + v_off + c..base + v_off + hd]);
            });
        }
    }
}

/// The rows of one tile as runs of consecutive rows: `(offset, n)` is `n`
/// rows whose head rows start at `offset`, `offset + row_stride`, … in
/// `rows.k`/`rows.v` — one run per block touched (one in all for a
/// contiguous context). Resolved once per tile, walked by every pass.
#[derive(Clone, Copy)]
struct TileRuns {
    runs: [(usize, usize); TILE],
    len: usize,
}

impl TileRuns {
    /// Runs of positions `start..end` (at most [`TILE`] of them): run `r` of
    /// `run_len` positions starts at row `run_row(r)`.
    #[inline(always)]
    fn new<T>(
        rows: &Rows<'_, T>,
        start: usize,
        end: usize,
        run_len: usize,
        run_row: &impl Fn(usize) -> usize,
    ) -> Self {
        debug_assert!(end - start <= TILE || start >= end);
        let mut t = TileRuns {
            runs: [(0, 0); TILE],
            len: 0,
        };
        if start >= end {
            return t;
        }
        let (mut run, mut off) = (start / run_len, start % run_len);
        let mut pos = start;
        while pos < end {
            let n = (run_len - off).min(end - pos);
            t.runs[t.len] = ((run_row(run) + off) * rows.row_stride + rows.head_off, n);
            t.len += 1;
            pos += n;
            run += 1;
            off = 0;
        }
        t
    }

    /// One run of `n` rows from offset 0: a dense, widened tile.
    #[inline(always)]
    fn one(n: usize) -> Self {
        let mut t = TileRuns {
            runs: [(0, 0); TILE],
            len: 1,
        };
        t.runs[0] = (0, n);
        t
    }

    /// Calls `f(j, offset)` for the tile's rows in order (`j` counts from 0).
    #[inline(always)]
    fn for_each_row(&self, row_stride: usize, mut f: impl FnMut(usize, usize)) {
        let mut j = 0;
        for &(mut base, n) in &self.runs[..self.len] {
            for _ in 0..n {
                f(j, base);
                base += row_stride;
                j += 1;
            }
        }
    }
}

/// Lanes of the vectorised accumulators.
const LANES: usize = 16;

/// `a · b` with [`LANES`] independent `f32` partial sums (vectorisable).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ac, bc) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ar.iter().zip(br) {
        tail += x * y;
    }
    reduce_lanes(acc) + tail
}

/// Pairwise sum of the lanes of an accumulator.
#[inline(always)]
fn reduce_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for i in 0..w {
            acc[i] += acc[i + w];
        }
        w /= 2;
    }
    acc[0]
}

/// Replaces every `x` of `s` by `exp(x - m)` and returns their sum.
///
/// Branch-free Cephes-style `expf` (range reduction to `r ∈ [-ln2/2, ln2/2]`,
/// degree-5 polynomial, `2^n` built in the exponent bits; relative error
/// ~1e-7) so that LLVM vectorises the loop; `x - m ≤ 0` here, and arguments
/// below -87 (where `exp` is under 1.7e-38) are clamped to -87.
#[inline(always)]
fn exp_shifted(s: &mut [f32], m: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    for x in s.iter_mut() {
        let a = (*x - m).max(-87.0);
        let t = a * LOG2E + MAGIC;
        let n = t - MAGIC;
        let r = a - n * LN2_HI - n * LN2_LO;
        let mut p = 1.987_569_1e-4f32;
        p = p * r + 1.398_199_9e-3;
        p = p * r + 8.333_452e-3;
        p = p * r + 4.166_579_6e-2;
        p = p * r + 1.666_666_5e-1;
        p = p * r + 0.5;
        let e = p * r * r + r + 1.0;
        // 2^n: n sits in the low bits of t's mantissa (two's complement).
        let n_bits = t.to_bits().wrapping_sub(MAGIC.to_bits());
        let two_n = f32::from_bits(n_bits.wrapping_add(127) << 23);
        *x = e * two_n;
    }
    // A separate lane-wise sum: a running scalar sum would keep the loop
    // above from vectorising (f32 addition is not reassociated).
    let chunks = s.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    let mut acc = [0.0f32; LANES];
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    reduce_lanes(acc) + tail
}

/// `y += a * x` (vectorisable).
#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Hints the CPU to load `x` into the cache (one prefetch per 64-byte line).
#[inline(always)]
fn prefetch<T>(x: &[T]) {
    #[cfg(target_arch = "x86_64")]
    for line in x.chunks(64 / std::mem::size_of::<T>()) {
        // SAFETY: prefetching never faults and `line` is a valid slice.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            );
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}
