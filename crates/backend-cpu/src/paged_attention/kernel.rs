//! The attention kernel behind [`super::paged_attention`]: work items over
//! query rows and kv heads, tiles of `TILE` positions with an online
//! softmax, and the vectorisable inner loops (see the module doc of
//! `paged_attention`).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use vellum_base::fp8;

use crate::kv_cache::Fp8E4m3;

#[cfg(target_arch = "x86_64")]
mod wide;

/// Positions per online-softmax tile.
const TILE: usize = 64;

/// Below this many multiply-adds (`Σ rows × context × num_heads × head_dim`)
/// a batch runs on the calling thread: rayon's fork/join costs more than it
/// saves.
const PAR_MIN_WORK: usize = 1 << 17;

/// Head counts and sizes of one attention call, validated.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    pub(super) num_heads: usize,
    pub(super) num_kv_heads: usize,
    pub(super) head_dim: usize,
    /// Query heads per kv head.
    pub(super) group: usize,
    /// Multiplies `q·k`.
    pub(super) scale: f32,
    /// Soft-cap of the scores (`cap · tanh(s / cap)`), if any.
    pub(super) softcap: Option<f32>,
    /// Multiplies the outputs: the value pool's scale where its elements
    /// are stored divided by one (FP8), else 1.
    pub(super) v_scale: f32,
    /// The SIMD tile computes its scores and values on AVX-512 a query
    /// group at a time (`kernel/wide.rs`; the same bits): set where the CPU
    /// kernel is [`Kernel::Avx512Vnni`](crate::quant::Kernel) and a group
    /// has several heads.
    pub(super) wide_tile: bool,
}

impl Shape {
    pub(super) fn new(num_heads: usize, num_kv_heads: usize, head_dim: usize, what: &str) -> Self {
        assert!(
            num_kv_heads > 0 && num_heads > 0 && num_heads.is_multiple_of(num_kv_heads),
            "{what}: num_heads {num_heads} is not a positive multiple of num_kv_heads {num_kv_heads}"
        );
        assert!(head_dim > 0, "{what}: head_dim is 0");
        let group = num_heads / num_kv_heads;
        let wide_tile = cfg!(target_arch = "x86_64") && group > 1 && crate::quant::Kernel::detect() == crate::quant::Kernel::Avx512Vnni;
        Self { num_heads, num_kv_heads, head_dim, group, scale: 1.0 / (head_dim as f32).sqrt(), softcap: None, v_scale: 1.0, wide_tile }
    }

    /// A score from a query–key dot product: scaled, then soft-capped.
    #[inline(always)]
    pub(super) fn score(&self, dot: f32) -> f32 {
        let s = self.scale * dot;
        match self.softcap {
            Some(cap) => cap * (s / cap).tanh(),
            None => s,
        }
    }

    /// Floats per token in the K/V layout.
    pub(super) fn kv_row(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Floats of one work item's query/output run: its group of query heads.
    pub(super) fn group_len(&self) -> usize {
        self.group * self.head_dim
    }

    pub(super) fn check_rows(&self, q: &[f32], out: &[f32], num_tokens: usize, what: &str) {
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
pub(super) fn check_query_start_loc(query_start_loc: &[u32], what: &str) -> usize {
    assert!(query_start_loc.first() == Some(&0), "{what}: query_start_loc must start with 0, got {:?}", query_start_loc.first());
    assert!(query_start_loc.windows(2).all(|w| w[0] <= w[1]), "{what}: query_start_loc is not non-decreasing");
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
pub(super) fn run_items<F>(out: &mut [f32], q: &[f32], shape: &Shape, work: usize, item: F)
where
    F: Fn(usize, usize, &[f32], &mut [f32], &mut Vec<f32>) + Sync,
{
    let threads = rayon::current_num_threads();
    let work = work.saturating_mul(shape.num_heads * shape.head_dim);
    let parallel = work >= PAR_MIN_WORK && threads >= 2;
    let num_tokens = out.len() / (shape.num_heads * shape.head_dim);
    let kv_per_item = if parallel && num_tokens < 4 * threads { 1 } else { shape.num_kv_heads };
    let items_per_token = shape.num_kv_heads / kv_per_item;
    let run = kv_per_item * shape.group_len();
    let split = |c: usize| (c / items_per_token, (c % items_per_token) * kv_per_item);
    if !parallel {
        let mut scratch = Vec::new();
        for (c, (q, o)) in q.chunks_exact(run).zip(out.chunks_exact_mut(run)).enumerate() {
            let (t, kv_head) = split(c);
            item(t, kv_head, q, o, &mut scratch);
        }
    } else {
        // Aim for a few items per split so small items do not drown in
        // fork/join overhead while large prefills still balance.
        // On the spin team, as the linears are: through rayon, a worker
        // woke beside the team's spinning helper (three threads, two cores).
        let n_items = out.len() / run;
        let per_part = (n_items / (8 * threads)).max(1);
        crate::spin_team::for_chunks_mut(out, per_part * run, &|p, part| {
            let mut scratch = Vec::new();
            let first = p * per_part;
            let q = &q[first * run..];
            for (j, (o, q)) in part.chunks_exact_mut(run).zip(q.chunks_exact(run)).enumerate() {
                let (t, kv_head) = split(first + j);
                item(t, kv_head, q, o, &mut scratch);
            }
        });
    }
}

/// Keys and values of one kv head: row `r` (a token) of the head starts at
/// `r * row_stride + head_off` in `k` and `v`.
pub(super) struct Rows<'a, T> {
    pub(super) k: &'a [T],
    pub(super) v: &'a [T],
    pub(super) row_stride: usize,
    pub(super) head_off: usize,
}

/// How an element type of the KV pools becomes `f32` in a register.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum ElemKind {
    /// Read as is.
    F32,
    /// `vcvtph2ps`.
    F16,
    /// A 16-bit shift into the high half.
    Bf16,
    /// FP8 E4M3 codes: bits moved into a binary16, then `vcvtph2ps`
    /// ([`vellum_base::fp8`]).
    Fp8E4m3,
}

/// An element type of the KV pools, read by the kernel as `f32`.
pub(super) trait KvElem: Copy + Send + Sync {
    /// Which type it is (the AVX-512 scores widen by hand).
    const KIND: ElemKind;

    /// The slice itself when the elements already are `f32`: the kernel then
    /// reads the pools in place. `None` for `f16`/`bf16`/FP8, which the
    /// kernel widens in registers or tile by tile into scratch.
    fn as_f32(x: &[Self]) -> Option<&[f32]>;

    /// `dst[i] = src[i] as f32` (same lengths; an FP8 code in units of
    /// [`fp8::F16_UNIT`]).
    fn widen(src: &[Self], dst: &mut [f32]);

    /// Whether widening costs less than a store and a reload (`bf16`: a
    /// shift), so that a row shared by a query group is widened per head
    /// rather than once into a buffer.
    const CHEAP_WIDEN: bool;

    /// One element as `f32` (tails of rows whose length is not a multiple
    /// of [`LANES`]).
    fn to_f32(x: Self) -> f32;

    /// The first [`LANES`] elements of `src` as `f32`, in registers: the
    /// fused tile reads the pools through this.
    ///
    /// # Safety
    /// For `f16` the CPU must have F16C (for FP8 also AVX2): only
    /// [`attend_group_simd`] (entered
    /// after [`crate::quant::has_simd`]) instantiates the fused tile.
    unsafe fn widen16(src: &[Self]) -> [f32; LANES];
}

impl KvElem for f32 {
    const KIND: ElemKind = ElemKind::F32;
    const CHEAP_WIDEN: bool = true;

    #[inline(always)]
    fn as_f32(x: &[f32]) -> Option<&[f32]> {
        Some(x)
    }

    #[inline(always)]
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[inline(always)]
    fn to_f32(x: f32) -> f32 {
        x
    }

    /// # Safety
    /// Nothing: a copy.
    #[inline(always)]
    unsafe fn widen16(src: &[f32]) -> [f32; LANES] {
        let mut d = [0.0; LANES];
        d.copy_from_slice(&src[..LANES]);
        d
    }
}

impl KvElem for f16 {
    const KIND: ElemKind = ElemKind::F16;
    const CHEAP_WIDEN: bool = false;

    #[inline(always)]
    fn as_f32(_: &[f16]) -> Option<&[f32]> {
        None
    }

    /// `half` uses the F16C instructions when the CPU has them.
    #[inline(always)]
    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }

    #[inline(always)]
    fn to_f32(x: f16) -> f32 {
        x.to_f32()
    }

    /// # Safety
    /// The CPU must have F16C (see [`KvElem::widen16`]); `src` holds 16 elements.
    #[inline(always)]
    unsafe fn widen16(src: &[f16]) -> [f32; LANES] {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: the caller guarantees F16C (see the trait).
            unsafe { widen16_f16c(&src[..LANES]) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let mut d = [0.0; LANES];
            src[..LANES].convert_to_f32_slice(&mut d);
            d
        }
    }
}

/// Sixteen `f16` to `f32` with two `vcvtph2ps`.
///
/// # Safety
/// The CPU must have AVX and F16C; `src` holds at least 16 elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn widen16_f16c(src: &[f16]) -> [f32; LANES] {
    use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    let mut d = [0.0f32; LANES];
    debug_assert!(src.len() >= LANES);
    // SAFETY: src holds 16 f16 (32 bytes, two unaligned 16-byte loads);
    // d holds 16 f32 (two unaligned 32-byte stores); F16C is present.
    unsafe {
        let lo = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().cast()));
        let hi = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(8).cast()));
        _mm256_storeu_ps(d.as_mut_ptr(), lo);
        _mm256_storeu_ps(d.as_mut_ptr().add(8), hi);
    }
    d
}

impl KvElem for bf16 {
    const KIND: ElemKind = ElemKind::Bf16;
    const CHEAP_WIDEN: bool = true;

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

    #[inline(always)]
    fn to_f32(x: bf16) -> f32 {
        f32::from_bits((x.to_bits() as u32) << 16)
    }

    /// # Safety
    /// Nothing: a shift.
    #[inline(always)]
    unsafe fn widen16(src: &[bf16]) -> [f32; LANES] {
        let mut d = [0.0; LANES];
        for (d, s) in d.iter_mut().zip(&src[..LANES]) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
        d
    }
}

/// Every FP8 E4M3 code in units of [`fp8::F16_UNIT`] (the value / 2⁸), as
/// the SIMD path widens it: the baseline path and row tails read this.
static FP8_F16_UNITS: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = f16::from_bits(fp8::to_f16_bits(c as u8)).to_f32_const();
        c += 1;
    }
    t
};

/// An FP8 pool is read in units of [`fp8::F16_UNIT`]: the caller folds that
/// factor and the layer's scale into the score scale and the outputs
/// ([`Shape::scale`], [`Shape::v_scale`]).
impl KvElem for Fp8E4m3 {
    const KIND: ElemKind = ElemKind::Fp8E4m3;
    const CHEAP_WIDEN: bool = false;

    #[inline(always)]
    fn as_f32(_: &[Fp8E4m3]) -> Option<&[f32]> {
        None
    }

    #[inline(always)]
    fn widen(src: &[Fp8E4m3], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = FP8_F16_UNITS[s.0 as usize];
        }
    }

    #[inline(always)]
    fn to_f32(x: Fp8E4m3) -> f32 {
        FP8_F16_UNITS[x.0 as usize]
    }

    /// # Safety
    /// The CPU must have AVX2 and F16C (see [`KvElem::widen16`]); `src`
    /// holds 16 elements.
    #[inline(always)]
    unsafe fn widen16(src: &[Fp8E4m3]) -> [f32; LANES] {
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: the caller guarantees AVX2 and F16C (see the trait).
            unsafe { widen16_fp8(&src[..LANES]) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let mut d = [0.0; LANES];
            Self::widen(&src[..LANES], &mut d);
            d
        }
    }
}

/// Sixteen FP8 E4M3 codes to `f32` in units of 2⁸: each byte zero-extended
/// to 16 bits, its sign moved to bit 15 and its seven other bits to 13..7
/// (a binary16 of the value / 2⁸), then two `vcvtph2ps`.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `src` holds at least 16 elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn widen16_fp8(src: &[Fp8E4m3]) -> [f32; LANES] {
    use std::arch::x86_64::*;
    let mut d = [0.0f32; LANES];
    debug_assert!(src.len() >= LANES);
    // SAFETY: src holds 16 bytes (one unaligned 16-byte load); d holds 16
    // f32 (two unaligned 32-byte stores); AVX2 and F16C are present.
    unsafe {
        let h = fp8_to_f16_bits(_mm_loadu_si128(src.as_ptr().cast()));
        _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
        _mm256_storeu_ps(d.as_mut_ptr().add(8), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)));
    }
    d
}

/// The binary16 bits ([`fp8::to_f16_bits`]) of sixteen FP8 codes: NaN
/// codes to a quiet NaN of their sign.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn fp8_to_f16_bits(codes: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let x = _mm256_cvtepu8_epi16(codes);
    let low = _mm256_and_si256(x, _mm256_set1_epi16(0x7f));
    let sign = _mm256_slli_epi16::<8>(_mm256_and_si256(x, _mm256_set1_epi16(0x80)));
    let rest = _mm256_slli_epi16::<7>(low);
    let nan = _mm256_cmpeq_epi16(low, _mm256_set1_epi16(0x7f));
    _mm256_or_si256(sign, _mm256_blendv_epi8(rest, _mm256_set1_epi16(0x7e00), nan))
}

/// [`attend_group`] on the CPU's SIMD path where it has one (AVX2, FMA and
/// F16C: the loops vectorise 8 wide, and `f16`/`bf16` pools are widened in
/// registers, fused into the tile), else the baseline build with `f16`/`bf16`
/// widened tile by tile into scratch. `VELLUM_CPU_KERNEL=scalar` forces the
/// baseline.
#[allow(clippy::too_many_arguments)] // Mirrors attend_group.
#[inline]
pub(super) fn attend<T: KvElem>(
    out: &mut [f32],
    q: &[f32],
    rows: &Rows<'_, T>,
    positions: std::ops::Range<usize>,
    run_len: usize,
    run_row: impl Fn(usize) -> usize,
    shape: &Shape,
    scratch: &mut Vec<f32>,
) {
    #[cfg(target_arch = "x86_64")]
    if crate::quant::Kernel::detect() != crate::quant::Kernel::Scalar {
        // SAFETY: Kernel::detect() offers a SIMD kernel only where
        // has_simd() found AVX2, FMA and F16C; Shape::new sets wide_tile
        // only where it offers Avx512Vnni (AVX-512 F, BW, VL and VNNI).
        return unsafe { attend_group_simd(out, q, rows, positions, run_len, run_row, shape, scratch) };
    }
    attend_group::<T, false>(out, q, rows, positions, run_len, run_row, shape, scratch)
}

/// [`attend_group`] compiled for AVX2 + FMA + F16C, with the fused tile.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C, and AVX-512 F and BW where
/// `shape.wide_tile` is set.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)] // Mirrors attend_group.
pub(super) unsafe fn attend_group_simd<T: KvElem>(
    out: &mut [f32],
    q: &[f32],
    rows: &Rows<'_, T>,
    positions: std::ops::Range<usize>,
    run_len: usize,
    run_row: impl Fn(usize) -> usize,
    shape: &Shape,
    scratch: &mut Vec<f32>,
) {
    attend_group::<T, true>(out, q, rows, positions, run_len, run_row, shape, scratch)
}

/// Attention of the query heads in `q` (`[n_kv * group, head_dim]`, the
/// groups of `n_kv = q.len() / (group * head_dim)` consecutive kv heads,
/// the first at `rows.head_off`) over context `positions`, written
/// to `out` (same shape as `q`).
///
/// The context is made of runs of `run_len` consecutive positions; run `r`
/// starts at row `run_row(r)` of `rows` (a block of the block table, or the
/// whole contiguous context). One pass over tiles of [`TILE`] positions with
/// an online softmax; `out` is the accumulator. `f32` pools are read in
/// place; `f16`/`bf16` pools are widened one tile at a time into two dense
/// `[TILE, n_kv * head_dim]` scratch buffers (K and V), which the same tile
/// code then reads — unless `SIMD`, where the tile reads them in place and
/// widens in registers (see [`KvElem::widen16`]) and its multiply-adds are
/// fused (`mul_add`): only [`attend_group_simd`], compiled for AVX2, FMA and
/// F16C, sets it.
#[allow(clippy::too_many_arguments)] // Private kernel; a struct would only rename the arguments.
#[inline(always)]
pub(super) fn attend_group<T: KvElem, const SIMD: bool>(
    out: &mut [f32],
    q: &[f32],
    rows: &Rows<'_, T>,
    positions: std::ops::Range<usize>,
    run_len: usize,
    run_row: impl Fn(usize) -> usize,
    shape: &Shape,
    scratch: &mut Vec<f32>,
) {
    let (first, n_ctx) = (positions.start, positions.end);
    // Query heads of the item.
    let n_q = q.len() / shape.head_dim;
    // Elements of one row of the item's kv heads.
    let row_len = q.len() / shape.group;
    let in_place = T::as_f32(rows.k).zip(T::as_f32(rows.v));
    let widen_to_scratch = in_place.is_none() && !SIMD;
    let widened_len = if widen_to_scratch { TILE * row_len } else { 0 };
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
        for_each_row!(runs, rows.row_stride, |_j, base| {
            prefetch(&rows.k[base..base + row_len]);
            if widen_to_scratch {
                prefetch(&rows.v[base..base + row_len]);
            }
        });
    };
    // Row runs of the current tile and of the next one.
    let mut runs = TileRuns::new(rows, first, (first + TILE).min(n_ctx), run_len, &run_row);
    prefetch_next(&runs);
    let mut tile_start = first;
    while tile_start < n_ctx {
        let tile_end = (tile_start + TILE).min(n_ctx);
        let tile_len = tile_end - tile_start;
        // The next tile's keys stream in while this one is computed: in the
        // paged layout every block starts a new stream that the hardware
        // prefetcher would only pick up after a few misses.
        let next = TileRuns::new(rows, tile_end, (tile_end + TILE).min(n_ctx), run_len, &run_row);
        prefetch_next(&next);
        match in_place {
            Some((k, v)) => {
                let rows = Rows { k, v, row_stride: rows.row_stride, head_off: rows.head_off };
                // SAFETY: f32 rows need no CPU feature to widen; SIMD (the
                // tile's FMA) is set only by attend_group_simd, entered on a
                // CPU with AVX2, FMA and F16C.
                unsafe { attend_tile::<f32, SIMD>(out, q, &rows, &runs, tile_len, shape, &mut state) };
            }
            // SAFETY: SIMD is set only by attend_group_simd, whose caller
            // checked for AVX2, FMA and F16C (KvElem::widen16's requirement
            // and the tile's FMA).
            None if SIMD => unsafe { attend_tile::<T, SIMD>(out, q, rows, &runs, tile_len, shape, &mut state) },
            None => {
                for_each_row!(runs, rows.row_stride, |j, base| {
                    let dst = j * row_len..(j + 1) * row_len;
                    T::widen(&rows.k[base..base + row_len], &mut k_tile[dst.clone()]);
                    T::widen(&rows.v[base..base + row_len], &mut v_tile[dst]);
                });
                let dense = Rows { k: &*k_tile, v: &*v_tile, row_stride: row_len, head_off: 0 };
                let dense_runs = TileRuns::one(tile_len);
                // SAFETY: f32 rows need no CPU feature to widen; here SIMD
                // is false (widen_to_scratch implies !SIMD), so no FMA.
                unsafe { attend_tile::<f32, SIMD>(out, q, &dense, &dense_runs, tile_len, shape, &mut state) };
            }
        }
        tile_start = tile_end;
        runs = next;
    }

    for (g, o) in out.chunks_exact_mut(shape.head_dim).enumerate() {
        let inv = shape.v_scale / state.l[g];
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

/// One tile of [`attend_group`]: scores, online-softmax rescaling of `out`,
/// value accumulation, reading rows of `T` through [`KvElem::widen16`];
/// `FMA` fuses the multiply-adds (the SIMD build).
///
/// Both inner loops keep several independent accumulators (four 16-lane
/// ones: eight AVX2 registers), so that they are bound by the FMA and load
/// ports rather than by the latency of one chain of additions.
///
/// # Safety
/// As [`KvElem::widen16`] for `T` (nothing for `f32`); with `FMA`, the CPU
/// must also have AVX2 and FMA (only [`attend_group_simd`] sets it), and
/// with `FMA` and `shape.wide_tile` AVX-512 F and BW.
#[allow(clippy::too_many_arguments)] // Private kernel; a struct would only rename the arguments.
#[inline(always)]
unsafe fn attend_tile<T: KvElem, const FMA: bool>(
    out: &mut [f32],
    q: &[f32],
    rows: &Rows<'_, T>,
    runs: &TileRuns,
    tile_len: usize,
    shape: &Shape,
    state: &mut SoftmaxState<'_>,
) {
    let hd = shape.head_dim;
    let group_len = shape.group_len();
    let row_len = q.len() / shape.group;
    let SoftmaxState { scores, m, l } = state;

    // 1. Scores of the tile: s[h, j] = scale * q_h · k_{j, kv(h)}; the
    //    item's kv heads of row j lie next to each other.
    // An f16 row is widened once per kv head into `k_buf` and shared by the
    // group's query heads (f32 rows are read in place, bf16 ones widened per
    // head: a shift is cheaper than the round trip through the buffer).
    let mut k_buf = [0.0f32; MAX_WIDENED_HEAD_DIM];
    let widen_once = !T::CHEAP_WIDEN && hd <= MAX_WIDENED_HEAD_DIM && shape.group > 1;
    let wide = cfg!(target_arch = "x86_64") && FMA && shape.wide_tile;
    #[cfg(target_arch = "x86_64")]
    if wide {
        // SAFETY: with FMA and wide_tile this function's contract
        // guarantees AVX2, FMA, F16C and AVX-512 F and BW.
        unsafe { wide::tile_scores(q, rows, runs, shape, scores) };
    }
    if !wide {
        for_each_row!(runs, rows.row_stride, |j, base| {
            prefetch(&rows.v[base..base + row_len]);
            for (kv, q_kv) in q.chunks_exact(group_len).enumerate() {
                let k_row = &rows.k[base + kv * hd..base + (kv + 1) * hd];
                if widen_once {
                    // SAFETY: forwarded from this function's contract.
                    unsafe { widen_row(k_row, &mut k_buf[..hd]) };
                }
                for (g, q_h) in q_kv.chunks_exact(hd).enumerate() {
                    // SAFETY: forwarded from this function's contract.
                    let d = if widen_once { unsafe { dot::<f32, FMA>(q_h, &k_buf[..hd]) } } else { unsafe { dot::<T, FMA>(q_h, k_row) } };
                    scores[(kv * shape.group + g) * TILE + j] = shape.score(d);
                }
            }
        });
    }

    // 2. Online softmax: rescale the running state to the new max.
    for g in 0..m.len() {
        let s = &mut scores[g * TILE..g * TILE + tile_len];
        let tile_max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let m_new = m[g].max(tile_max);
        let correction = (m[g] - m_new).exp(); // exp(-inf) = 0 on the first tile
        l[g] = l[g] * correction + exp_shifted(s, m_new);
        m[g] = m_new;
        if correction != 1.0 {
            out[g * hd..(g + 1) * hd].iter_mut().for_each(|o| *o *= correction);
        }
    }

    // 3. Accumulate the tile's values: out_g += Σ_j p[g, j] * v_j. The
    //    query heads of a group share their kv head's value rows: each
    //    16-value chunk of a row is loaded (and widened) once for up to
    //    four heads at a time.
    #[cfg(target_arch = "x86_64")]
    if wide {
        // SAFETY: as for tile_scores above.
        unsafe { wide::tile_values(out, scores, rows, runs, shape) };
        return;
    }
    if shape.group > 1 {
        for kv in 0..out.len() / group_len {
            for h in (0..shape.group).step_by(4) {
                let first = kv * shape.group + h;
                // SAFETY (each arm): forwarded from this function's contract.
                unsafe {
                    match (shape.group - h).min(4) {
                        1 => accumulate_values::<T, FMA, 1>(out, scores, rows, runs, kv * hd, first, hd),
                        2 => accumulate_values::<T, FMA, 2>(out, scores, rows, runs, kv * hd, first, hd),
                        3 => accumulate_values::<T, FMA, 3>(out, scores, rows, runs, kv * hd, first, hd),
                        _ => accumulate_values::<T, FMA, 4>(out, scores, rows, runs, kv * hd, first, hd),
                    }
                }
            }
        }
        return;
    }
    //    One head per kv head: BLOCK values of head_dim at a time (four
    //    16-lane accumulators that stay in registers across the tile's
    //    rows), then 16-lane chunks, then the tail.
    const BLOCK: usize = UNROLL * LANES;
    for (g, o) in out.chunks_exact_mut(hd).enumerate() {
        let p = &scores[g * TILE..g * TILE + tile_len];
        let v_off = (g / shape.group) * hd;
        let mut c = 0;
        while c + BLOCK <= hd {
            let mut acc = [[0.0f32; LANES]; UNROLL];
            for (u, a) in acc.iter_mut().enumerate() {
                a.copy_from_slice(&o[c + u * LANES..c + (u + 1) * LANES]);
            }
            for_each_row!(runs, rows.row_stride, |j, base| {
                let pj = p[j];
                let v_row = &rows.v[base + v_off + c..base + v_off + c + BLOCK];
                for (u, a) in acc.iter_mut().enumerate() {
                    // SAFETY: forwarded from this function's contract.
                    let v = unsafe { T::widen16(&v_row[u * LANES..(u + 1) * LANES]) };
                    for (a, x) in a.iter_mut().zip(v) {
                        *a = madd::<FMA>(pj, x, *a);
                    }
                }
            });
            for (u, a) in acc.iter().enumerate() {
                o[c + u * LANES..c + (u + 1) * LANES].copy_from_slice(a);
            }
            c += BLOCK;
        }
        while c + LANES <= hd {
            let mut acc = [0.0f32; LANES];
            acc.copy_from_slice(&o[c..c + LANES]);
            for_each_row!(runs, rows.row_stride, |j, base| {
                // SAFETY: forwarded from this function's contract.
                let v = unsafe { T::widen16(&rows.v[base + v_off + c..base + v_off + c + LANES]) };
                let pj = p[j];
                for (a, x) in acc.iter_mut().zip(v) {
                    *a = madd::<FMA>(pj, x, *a);
                }
            });
            o[c..c + LANES].copy_from_slice(&acc);
            c += LANES;
        }
        if c < hd {
            let o = &mut o[c..];
            for_each_row!(runs, rows.row_stride, |j, base| {
                axpy(o, p[j], &rows.v[base + v_off + c..base + v_off + hd]);
            });
        }
    }
}

/// `out_h += Σ_j p[h, j] · v_j` for the `N` query heads from `first` (one
/// kv head's, whose values start at `v_off` in a row): each 16-value chunk
/// of a value row is widened once and meets the `N` heads' accumulators
/// (`2N` AVX2 registers) in registers.
///
/// # Safety
/// As [`attend_tile`].
#[inline(always)]
#[allow(clippy::too_many_arguments)] // Private helper of attend_tile.
unsafe fn accumulate_values<T: KvElem, const FMA: bool, const N: usize>(
    out: &mut [f32],
    scores: &[f32],
    rows: &Rows<'_, T>,
    runs: &TileRuns,
    v_off: usize,
    first: usize,
    hd: usize,
) {
    let mut c = 0;
    while c + LANES <= hd {
        let mut acc = [[0.0f32; LANES]; N];
        for (i, a) in acc.iter_mut().enumerate() {
            a.copy_from_slice(&out[(first + i) * hd + c..(first + i) * hd + c + LANES]);
        }
        for_each_row!(runs, rows.row_stride, |j, base| {
            // SAFETY: forwarded from this function's contract.
            let v = unsafe { T::widen16(&rows.v[base + v_off + c..base + v_off + c + LANES]) };
            for (i, a) in acc.iter_mut().enumerate() {
                let pj = scores[(first + i) * TILE + j];
                for (a, x) in a.iter_mut().zip(v) {
                    *a = madd::<FMA>(pj, x, *a);
                }
            }
        });
        for (i, a) in acc.iter().enumerate() {
            out[(first + i) * hd + c..(first + i) * hd + c + LANES].copy_from_slice(a);
        }
        c += LANES;
    }
    accumulate_tail(out, scores, rows, runs, v_off, first..first + N, hd, c);
}

/// The value accumulation of heads `heads` past the last full 16-value
/// chunk (`c..hd`), element by element (unfused, as [`axpy`]).
#[inline(always)]
#[allow(clippy::too_many_arguments)] // Private helper of the value loops.
fn accumulate_tail<T: KvElem>(
    out: &mut [f32],
    scores: &[f32],
    rows: &Rows<'_, T>,
    runs: &TileRuns,
    v_off: usize,
    heads: std::ops::Range<usize>,
    hd: usize,
    c: usize,
) {
    if c >= hd {
        return;
    }
    for h in heads {
        let o = &mut out[h * hd + c..(h + 1) * hd];
        for_each_row!(runs, rows.row_stride, |j, base| {
            axpy(o, scores[h * TILE + j], &rows.v[base + v_off + c..base + v_off + hd]);
        });
    }
}

/// A test's xorshift stream of values in [−1, 1).
#[cfg(test)]
pub(super) fn test_values(seed: u32) -> impl FnMut() -> f32 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        (x >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    }
}

/// Runs `$body` for the rows of the [`TileRuns`] `$runs` in order, with `$j`
/// the row's index in the tile (from 0) and `$base` its offset in the pools.
///
/// A macro rather than a method taking a closure: a closure that LLVM does
/// not inline is compiled without the target features of the function it
/// sits in, so the SIMD build's inner loops ran on 128-bit SSE2 that way.
macro_rules! for_each_row {
    ($runs:expr, $row_stride:expr, |$j:ident, $base:ident| $body:block) => {{
        let (runs, row_stride): (&TileRuns, usize) = (&$runs, $row_stride);
        let mut $j = 0usize;
        for &(first, n) in &runs.runs[..runs.len] {
            let mut $base = first;
            for _ in 0..n {
                $body
                $base += row_stride;
                $j += 1;
            }
        }
        let _ = $j;
    }};
}
use for_each_row;

/// The rows of one tile as runs of consecutive rows: `(offset, n)` is `n`
/// rows whose head rows start at `offset`, `offset + row_stride`, … in
/// `rows.k`/`rows.v` — one run per block touched (one in all for a
/// contiguous context). Resolved once per tile, walked by every pass.
#[derive(Clone, Copy)]
pub(super) struct TileRuns {
    runs: [(usize, usize); TILE],
    len: usize,
}

impl TileRuns {
    /// Runs of positions `start..end` (at most [`TILE`] of them): run `r` of
    /// `run_len` positions starts at row `run_row(r)`.
    #[inline(always)]
    fn new<T>(rows: &Rows<'_, T>, start: usize, end: usize, run_len: usize, run_row: &impl Fn(usize) -> usize) -> Self {
        debug_assert!(end - start <= TILE || start >= end);
        let mut t = TileRuns { runs: [(0, 0); TILE], len: 0 };
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
        let mut t = TileRuns { runs: [(0, 0); TILE], len: 1 };
        t.runs[0] = (0, n);
        t
    }
}

/// Lanes of the vectorised accumulators.
const LANES: usize = 16;

/// Independent 16-lane accumulators of the inner loops (`dot`, the value
/// accumulation): 8 AVX2 registers, enough to cover the FMA latency.
const UNROLL: usize = 4;

/// Head sizes up to this widen a half-size key row once for the whole
/// query group (a stack buffer); larger ones widen it per query head.
const MAX_WIDENED_HEAD_DIM: usize = 256;

/// `dst[i] = src[i] as f32`, sixteen at a time through [`KvElem::widen16`].
///
/// # Safety
/// As [`KvElem::widen16`] for `T`.
#[inline(always)]
unsafe fn widen_row<T: KvElem>(src: &[T], dst: &mut [f32]) {
    for (d, s) in dst.chunks_exact_mut(LANES).zip(src.chunks_exact(LANES)) {
        // SAFETY: forwarded from this function's contract.
        d.copy_from_slice(&unsafe { T::widen16(s) });
    }
    let n = src.len() / LANES * LANES;
    for (d, &s) in dst[n..].iter_mut().zip(&src[n..]) {
        *d = T::to_f32(s);
    }
}

/// `a · b` with [`UNROLL`] × [`LANES`] independent `f32` partial sums
/// (vectorisable, and not bound by the latency of one chain of additions),
/// `b` widened from `T` sixteen at a time; `FMA` fuses the multiply-adds.
///
/// # Safety
/// As [`KvElem::widen16`] for `T`; with `FMA`, the CPU must also have AVX2
/// and FMA.
#[inline(always)]
unsafe fn dot<T: KvElem, const FMA: bool>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [[0.0f32; LANES]; UNROLL];
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut c = 0;
    while c + UNROLL * LANES <= n {
        for (u, acc) in acc.iter_mut().enumerate() {
            let at = c + u * LANES;
            // SAFETY: forwarded from this function's contract.
            let y = unsafe { T::widen16(&b[at..at + LANES]) };
            for ((s, &x), y) in acc.iter_mut().zip(&a[at..at + LANES]).zip(y) {
                *s = madd::<FMA>(x, y, *s);
            }
        }
        c += UNROLL * LANES;
    }
    while c + LANES <= n {
        // SAFETY: forwarded from this function's contract.
        let y = unsafe { T::widen16(&b[c..c + LANES]) };
        for ((s, &x), y) in acc[0].iter_mut().zip(&a[c..c + LANES]).zip(y) {
            *s = madd::<FMA>(x, y, *s);
        }
        c += LANES;
    }
    let mut tail = 0.0f32;
    for (x, &y) in a[c..].iter().zip(&b[c..]) {
        tail += x * T::to_f32(y);
    }
    let [a0, a1, a2, a3] = acc;
    let mut sum = [0.0f32; LANES];
    for i in 0..LANES {
        sum[i] = (a0[i] + a1[i]) + (a2[i] + a3[i]);
    }
    #[cfg(target_arch = "x86_64")]
    if FMA {
        // SAFETY: with FMA this function's contract guarantees AVX2 (and
        // so AVX).
        return unsafe { reduce_lanes_avx(&sum) } + tail;
    }
    reduce_lanes(sum) + tail
}

/// [`reduce_lanes`] in registers: the same pairwise order (lane `i` plus
/// lane `i + 8`, then `+ 4`, `+ 2`, `+ 1`), so the same sum, without the
/// store and the narrower reloads LLVM makes of the array version (a
/// store-forwarding stall per dot product).
///
/// # Safety
/// The CPU must have AVX.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn reduce_lanes_avx(acc: &[f32; LANES]) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: acc holds 16 floats (two unaligned 8-float loads); the
    // caller guarantees AVX (these intrinsics need nothing newer).
    unsafe {
        let s8 = _mm256_add_ps(_mm256_loadu_ps(acc.as_ptr()), _mm256_loadu_ps(acc.as_ptr().add(8)));
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_movehdup_ps(s2));
        _mm_cvtss_f32(s1)
    }
}

/// `a * b + c`, fused (one rounding) when `FMA` (the SIMD build, where it is
/// one instruction), else two operations (a fused multiply-add without the
/// instruction is a slow library call).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
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
/// Through [`vellum_base::exp_f32`] (branch-free, within 2 ulp), so that
/// LLVM vectorises the loop; `x - m ≤ 0` here, and arguments below -87
/// (masked scores among them) give 0.
#[inline(always)]
fn exp_shifted(s: &mut [f32], m: f32) -> f32 {
    for x in s.iter_mut() {
        *x = vellum_base::exp_f32(*x - m);
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
fn axpy<T: KvElem>(y: &mut [f32], a: f32, x: &[T]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * T::to_f32(x);
    }
}

/// Hints the CPU to load `x` into the cache (one prefetch per 64-byte line).
#[inline(always)]
fn prefetch<T>(x: &[T]) {
    #[cfg(target_arch = "x86_64")]
    for line in x.chunks(64 / std::mem::size_of::<T>()) {
        // SAFETY: prefetching never faults and `line` is a valid slice.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line.as_ptr().cast());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every FP8 code widens to the same `f32` in registers as through the
    /// table, and the table is the code's value / 2⁸.
    #[test]
    fn fp8_codes_widen_alike_in_registers_and_table_or_skip() {
        for c in 0..=255u8 {
            if c & 0x7f != 0x7f {
                assert_eq!(FP8_F16_UNITS[c as usize] * fp8::F16_UNIT, fp8::to_f32(c), "code {c:#04x}");
            }
        }
        let simd = cfg!(target_arch = "x86_64") && crate::quant::has_simd();
        if !crate::runs_or_skips(simd, "fp8_codes_widen_alike_in_registers_and_table_or_skip", "AVX2") {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        for start in (0..256).step_by(LANES) {
            let codes: Vec<Fp8E4m3> = (start..start + LANES).map(|c| Fp8E4m3(c as u8)).collect();
            // SAFETY: has_simd() found AVX2 and F16C; 16 codes.
            let got = unsafe { widen16_fp8(&codes) };
            for (c, g) in codes.iter().zip(got) {
                assert_eq!(g.to_bits(), FP8_F16_UNITS[c.0 as usize].to_bits(), "code {:#04x}", c.0);
            }
        }
    }

    /// The fused SIMD tile, the baseline's widen-to-scratch tile and the
    /// `f32` kernel on the widened values agree, for `f16`, `bf16` and FP8, with
    /// a head size that leaves a tail after the 16-lane chunks, GQA, a
    /// soft-cap and a context of several partial tiles.
    #[test]
    fn fused_and_scratch_tiles_agree_with_f32_for_narrow_pools() {
        let (heads, kv_heads, hd, n_ctx) = (6, 2, 72, 150);
        let shape = Shape { softcap: Some(30.0), ..Shape::new(heads, kv_heads, hd, "test") };
        let row = shape.kv_row();
        let mut rnd = test_values(0x2545_f491);
        let q: Vec<f32> = (0..heads * hd).map(|_| rnd()).collect();
        let k: Vec<f32> = (0..n_ctx * row).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..n_ctx * row).map(|_| rnd()).collect();
        /// The kernel on `k`, `v` through its SIMD build or its baseline one.
        fn run<T: KvElem>(q: &[f32], k: &[T], v: &[T], shape: &Shape, n_ctx: usize, simd: bool) -> Vec<f32> {
            let rows = Rows { k, v, row_stride: shape.kv_row(), head_off: 0 };
            let mut out = vec![0.0; q.len()];
            let mut scratch = Vec::new();
            if simd {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the caller checked has_simd().
                unsafe {
                    attend_group_simd(&mut out, q, &rows, 0..n_ctx, n_ctx, |_| 0, shape, &mut scratch)
                };
            } else {
                attend_group::<T, false>(&mut out, q, &rows, 0..n_ctx, n_ctx, |_| 0, shape, &mut scratch);
            }
            out
        }
        fn max_diff(a: &[f32], b: &[f32]) -> f32 {
            a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max)
        }
        /// The pools stored as `T`: both of its paths against the f32
        /// kernel on the same (rounded) values.
        fn check<T: KvElem>(q: &[f32], k: &[f32], v: &[f32], shape: &Shape, n_ctx: usize, narrow: fn(f32) -> T, simd: bool) {
            let (kt, vt): (Vec<T>, Vec<T>) = (k.iter().map(|&a| narrow(a)).collect(), v.iter().map(|&a| narrow(a)).collect());
            let widen = |x: &[T]| x.iter().map(|&a| T::to_f32(a)).collect::<Vec<f32>>();
            let reference = run::<f32>(q, &widen(&kt), &widen(&vt), shape, n_ctx, false);
            let scratch_path = max_diff(&run::<T>(q, &kt, &vt, shape, n_ctx, false), &reference);
            assert!(scratch_path < 1e-5, "scratch path off by {scratch_path}");
            if simd {
                let fused = max_diff(&run::<T>(q, &kt, &vt, shape, n_ctx, true), &reference);
                assert!(fused < 1e-5, "fused path off by {fused}");
            } else {
                eprintln!("no AVX2/FMA/F16C: the fused path is not checked on this CPU");
            }
        }
        let simd = cfg!(target_arch = "x86_64") && crate::quant::has_simd();
        check::<f16>(&q, &k, &v, &shape, n_ctx, f16::from_f32, simd);
        check::<bf16>(&q, &k, &v, &shape, n_ctx, bf16::from_f32, simd);
        check::<Fp8E4m3>(&q, &k, &v, &shape, n_ctx, |x| Fp8E4m3::from_f32(64.0 * x), simd);
        // The f32 kernel also agrees between its SIMD and baseline builds.
        let base = run::<f32>(&q, &k, &v, &shape, n_ctx, false);
        if simd {
            let d = max_diff(&run::<f32>(&q, &k, &v, &shape, n_ctx, true), &base);
            assert!(d < 1e-5, "f32 SIMD build off by {d}");
        }
    }
}
