//! Outlier channels: the few input channels of a linear layer whose
//! activations dwarf the rest, multiplied in float32 beside the int8 kernel.
//!
//! int8 activations take one scale per block of 32 values, set by the
//! block's largest magnitude. A transformer's linear inputs have a few
//! channels that are consistently far larger than the others (the
//! "massive activations" of the residual stream, large norm weights), and
//! a block holding one rounds its other 31 values in steps sized for the
//! outlier. Most of the int8 path's error comes from there: with each
//! block's largest value taken out (emulated), the KL divergence to the
//! float32 path falls eightfold on SmolLM2.
//!
//! The channels are the same from token to token, so they are chosen once,
//! per weight, by a calibration pass over a fixed text
//! (`ModelExecutor::calibrate`): while [`OutlierChannels::record`] runs,
//! each channel's score is the largest `|x| / rms(row)` it shows; the
//! first call after calibration keeps the `k / 64` best-scoring channels
//! and copies their weight columns out as f32 (`[C, n]`). From then on a
//! product is
//!
//! ```text
//! y = int8(x with the C channels zeroed) · Wᵀ   +   x[:, C] · W[:, C]ᵀ (f32, fused multiply-adds)
//! ```
//!
//! so those channels no longer set any block's scale. Each output's f32 sum
//! runs over the channels in one order with fused multiply-adds, whatever
//! the batch or the thread split, so a row's result stays bitwise
//! independent of the batch it came in. A weight never calibrated (a
//! backend used without the engine's calibration, the int16 and float32
//! paths) keeps plain int8.
//!
//! Cost at `k / 64` channels: a sixty-fourth of the multiply-adds in f32,
//! and `4·C·n` bytes per weight (3–4% of a Q4/Q8 weight's bytes).

use std::sync::{Mutex, OnceLock};

use crate::quant::QuantWeight;

/// One input channel of every this many becomes an outlier channel.
pub const CHANNELS_PER_OUTLIER: usize = 64;

/// The same for the LM head (an embedding used as one, or `lm_head`): its
/// vocabulary-wide product is most of a decode step's multiply-adds at
/// batch (Gemma 3: 262,144 rows), so its f32 share costs the most. Half as
/// many channels there keep most of the gain (KL to the float32 path, k/64
/// → k/128 in the head: SmolLM2 0.00076 → 0.00083, Gemma 3 0.00057 →
/// 0.00063; none in the head: 0.00143 and 0.00090).
pub const CHANNELS_PER_OUTLIER_LM_HEAD: usize = 128;

/// Calibration statistics of one weight's input, then its outlier channels.
#[derive(Debug)]
pub struct OutlierChannels {
    /// One channel of every this many becomes an outlier channel.
    per: usize,
    /// Per input channel, the largest `|x| / rms(row)` recorded; empty
    /// until a calibration pass records.
    scores: Mutex<Vec<f32>>,
    /// Fixed by the first product after calibration: `None` if nothing was
    /// recorded.
    fixed: OnceLock<Option<Outliers>>,
}

/// The chosen channels and their weight columns.
#[derive(Clone, Debug, PartialEq)]
pub struct Outliers {
    /// Input channels, ascending.
    pub channels: Vec<usize>,
    /// `[channels.len(), n]`: entry `j·n + o` is `W[o, channels[j]]`.
    pub columns: Vec<f32>,
}

impl Clone for OutlierChannels {
    fn clone(&self) -> Self {
        let scores = self.scores.lock().map(|s| s.clone()).unwrap_or_default();
        let fixed = OnceLock::new();
        if let Some(f) = self.fixed.get() {
            let _ = fixed.set(f.clone());
        }
        Self { per: self.per, scores: Mutex::new(scores), fixed }
    }
}

impl Default for OutlierChannels {
    fn default() -> Self {
        Self::one_in(CHANNELS_PER_OUTLIER)
    }
}

impl OutlierChannels {
    /// Nothing recorded yet; `k / per` channels once calibrated.
    pub fn one_in(per: usize) -> Self {
        Self { per: per.max(1), scores: Mutex::default(), fixed: OnceLock::new() }
    }

    /// Records the rows of `x` (`[m, k]`): each channel's score becomes the
    /// larger of itself and `|x| / rms(row)`. Ignored once the channels
    /// are fixed.
    pub fn record(&self, x: &[f32], m: usize, k: usize) {
        if self.fixed.get().is_some() || k == 0 {
            return;
        }
        let Ok(mut scores) = self.scores.lock() else { return };
        if scores.len() != k {
            *scores = vec![0.0; k];
        }
        for row in x.chunks_exact(k).take(m) {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / k as f32;
            if !(ms > 0.0 && ms.is_finite()) {
                continue;
            }
            let inv = 1.0 / ms.sqrt();
            for (s, v) in scores.iter_mut().zip(row) {
                *s = s.max(v.abs() * inv);
            }
        }
    }

    /// The outlier channels of `w`, fixed from the recorded scores at the
    /// first call (the `k / per` highest, ties to the lower channel, and
    /// their columns of `w`); `None` when nothing was recorded.
    pub fn fixed(&self, w: &QuantWeight) -> Option<&Outliers> {
        self.fixed
            .get_or_init(|| {
                let scores = self.scores.lock().ok()?;
                choose(&scores, w.k / self.per).map(|channels| Outliers::of(w, channels))
            })
            .as_ref()
    }
}

/// The `count` highest-scoring channels, ascending; `None` for no scores
/// or no channels.
fn choose(scores: &[f32], count: usize) -> Option<Vec<usize>> {
    if scores.is_empty() || count == 0 {
        return None;
    }
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut channels: Vec<usize> = order.into_iter().take(count).collect();
    channels.sort_unstable();
    Some(channels)
}

impl Outliers {
    /// `channels`' columns of `w`, exactly the stored values.
    fn of(w: &QuantWeight, channels: Vec<usize>) -> Self {
        let (n, k, c) = (w.n, w.k, channels.len());
        let mut columns = vec![0.0f32; c * n];
        let mut row = vec![0.0f32; k];
        for o in 0..n {
            w.dequantize_row(o, &mut row);
            for (j, &ch) in channels.iter().enumerate() {
                columns[j * n + o] = row[ch];
            }
        }
        Self { channels, columns }
    }

    /// Adds `xs[r] · columns` to rows `rows`, columns `cols` of `y`
    /// (`[·, n]`), where `xs` holds each row's values of the outlier
    /// channels (`channels.len()` per row, from row 0); each cell's sum
    /// runs over the channels in order with fused multiply-adds, so the
    /// same bits whatever the rows, the columns or the vector width.
    ///
    /// # Safety
    /// `y` points at rows `0..rows.end` of `n` floats; no other thread
    /// touches their columns `cols` meanwhile; `cols.end <= n`;
    /// `xs.len() >= rows.end · channels.len()`.
    pub unsafe fn add_products(&self, y: *mut f32, n: usize, xs: &[f32], rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) {
        let c = self.channels.len();
        let t = Tile { columns: &self.columns, n, c, cols };
        for r0 in rows.clone().step_by(ROWS) {
            let r1 = (r0 + ROWS).min(rows.end);
            // SAFETY: rows r0..r1 of y exist; the caller gives us `cols`.
            unsafe { t.add(y.add(r0 * n), &xs[r0 * c..r1 * c], r1 - r0) };
        }
    }
}

/// Rows of `y` that [`Tile::add`] updates at once (each column vector it
/// loads serves all of them).
const ROWS: usize = 4;

/// The columns of one call of [`Outliers::add_products`].
struct Tile<'a> {
    columns: &'a [f32],
    n: usize,
    c: usize,
    cols: std::ops::Range<usize>,
}

impl Tile<'_> {
    /// `y[i·n + o] = fma(xs[i·c + c − 1], col[c − 1][o], … fma(xs[i·c], col[0][o], y[i·n + o]))`
    /// for `i < rows`, `o ∈ cols`.
    ///
    /// # Safety
    /// `y` points at `rows` rows of `n` floats whose columns `cols` are this
    /// call's alone; `xs.len() == rows · c`; `rows <= ROWS`.
    unsafe fn add(&self, y: *mut f32, xs: &[f32], rows: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F; the rest is the caller's.
                return unsafe { self.add_avx512(y, xs, rows) };
            }
            if crate::quant::has_simd() {
                // SAFETY: the CPU has AVX2 and FMA; the rest is the caller's.
                return unsafe { self.add_avx2(y, xs, rows) };
            }
        }
        // SAFETY: the caller's.
        unsafe { self.add_scalar(y, xs, rows, self.cols.start) }
    }

    /// [`Tile::add`] one value at a time from column `from` on (`mul_add` is
    /// the same correctly rounded operation as the vector instructions).
    ///
    /// # Safety
    /// As [`Tile::add`].
    unsafe fn add_scalar(&self, y: *mut f32, xs: &[f32], rows: usize, from: usize) {
        for i in 0..rows {
            for o in from..self.cols.end {
                // SAFETY: o < cols.end <= n, i < rows.
                let cell = unsafe { &mut *y.add(i * self.n + o) };
                let mut acc = *cell;
                for j in 0..self.c {
                    acc = xs[i * self.c + j].mul_add(self.columns[j * self.n + o], acc);
                }
                *cell = acc;
            }
        }
    }

    /// [`Tile::add`] sixteen columns at a time.
    ///
    /// # Safety
    /// As [`Tile::add`]; the CPU must support AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn add_avx512(&self, y: *mut f32, xs: &[f32], rows: usize) {
        use std::arch::x86_64::*;
        let mut o = self.cols.start;
        while o + 16 <= self.cols.end {
            // SAFETY: columns o..o + 16 of rows < `rows` lie in y, and of the
            // c column rows in `columns` (o + 16 <= n).
            unsafe {
                let mut acc = [_mm512_setzero_ps(); ROWS];
                for (i, a) in acc.iter_mut().enumerate().take(rows) {
                    *a = _mm512_loadu_ps(y.add(i * self.n + o));
                }
                for j in 0..self.c {
                    let w = _mm512_loadu_ps(self.columns.as_ptr().add(j * self.n + o));
                    for (i, a) in acc.iter_mut().enumerate().take(rows) {
                        *a = _mm512_fmadd_ps(_mm512_set1_ps(xs[i * self.c + j]), w, *a);
                    }
                }
                for (i, a) in acc.iter().enumerate().take(rows) {
                    _mm512_storeu_ps(y.add(i * self.n + o), *a);
                }
            }
            o += 16;
        }
        // SAFETY: as above, for the columns left.
        unsafe { self.add_scalar(y, xs, rows, o) }
    }

    /// [`Tile::add`] eight columns at a time.
    ///
    /// # Safety
    /// As [`Tile::add`]; the CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn add_avx2(&self, y: *mut f32, xs: &[f32], rows: usize) {
        use std::arch::x86_64::*;
        let mut o = self.cols.start;
        while o + 8 <= self.cols.end {
            // SAFETY: as in `add_avx512`, eight columns.
            unsafe {
                let mut acc = [_mm256_setzero_ps(); ROWS];
                for (i, a) in acc.iter_mut().enumerate().take(rows) {
                    *a = _mm256_loadu_ps(y.add(i * self.n + o));
                }
                for j in 0..self.c {
                    let w = _mm256_loadu_ps(self.columns.as_ptr().add(j * self.n + o));
                    for (i, a) in acc.iter_mut().enumerate().take(rows) {
                        *a = _mm256_fmadd_ps(_mm256_set1_ps(xs[i * self.c + j]), w, *a);
                    }
                }
                for (i, a) in acc.iter().enumerate().take(rows) {
                    _mm256_storeu_ps(y.add(i * self.n + o), *a);
                }
            }
            o += 8;
        }
        // SAFETY: as above, for the columns left.
        unsafe { self.add_scalar(y, xs, rows, o) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::QuantKind;

    fn weight(n: usize, k: usize) -> QuantWeight {
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
        QuantWeight::quantize(&w, n, k, QuantKind::Q8)
    }

    #[test]
    fn the_highest_scoring_channels_are_chosen_and_their_columns_copied() {
        let (n, k) = (24, 128);
        let w = weight(n, k);
        let oc = OutlierChannels::default();
        let mut x = vec![0.1f32; 2 * k];
        x[5] = 40.0;
        x[k + 77] = -30.0;
        oc.record(&x, 2, k);
        let o = oc.fixed(&w).expect("recorded");
        assert_eq!(o.channels, vec![5, 77]);
        let mut row = vec![0.0; k];
        for r in 0..n {
            w.dequantize_row(r, &mut row);
            assert_eq!(o.columns[r], row[5]);
            assert_eq!(o.columns[n + r], row[77]);
        }
        // Fixed: later records change nothing.
        oc.record(&[9.0; 128], 1, k);
        assert_eq!(oc.fixed(&w).map(|o| o.channels.clone()), Some(vec![5, 77]));
    }

    #[test]
    fn nothing_recorded_means_no_outlier_channels() {
        assert!(OutlierChannels::default().fixed(&weight(8, 64)).is_none());
        // Fewer than 64 inputs: no channel to spare.
        let oc = OutlierChannels::default();
        oc.record(&[1.0; 32], 1, 32);
        assert!(oc.fixed(&weight(8, 32)).is_none());
    }

    #[test]
    fn products_add_the_columns_in_one_order_whatever_the_split() {
        let (m, n, k) = (3, 37, 128);
        let w = weight(n, k);
        let oc = OutlierChannels::default();
        let x: Vec<f32> = (0..m * k).map(|i| if i % k == 9 || i % k == 100 { 25.0 } else { (i % 13) as f32 / 13.0 }).collect();
        oc.record(&x, m, k);
        let o = oc.fixed(&w).expect("recorded");
        let expect: Vec<f32> = (0..m * n)
            .map(|i| {
                let (r, c) = (i / n, i % n);
                o.channels.iter().enumerate().fold(1.0f32, |acc, (j, &ch)| x[r * k + ch].mul_add(o.columns[j * n + c], acc))
            })
            .collect();
        let x = &x;
        let xs: Vec<f32> = (0..m).flat_map(|r| o.channels.iter().map(move |&ch| x[r * k + ch])).collect();
        // Cut points of the columns and of the rows: every split gives the same bits.
        let splits: [&[usize]; 3] = [&[0, n], &[0, 16, n], &[0, 5, 13, n]];
        for split in splits {
            let row_splits: [&[usize]; 2] = [&[0, m], &[0, 1, m]];
            for rows in row_splits {
                let mut y = vec![1.0f32; m * n];
                for cols in split.windows(2) {
                    for r in rows.windows(2) {
                        // SAFETY: y is [m, n]; one range at a time.
                        unsafe { o.add_products(y.as_mut_ptr(), n, &xs, r[0]..r[1], cols[0]..cols[1]) };
                    }
                }
                assert_eq!(y, expect);
            }
        }
    }
}
