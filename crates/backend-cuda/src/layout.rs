//! How a quantized weight sits on the device: the file's blocks split into
//! a plane of codes and a plane of scales, so that every kernel reads them
//! with aligned, coalesced 8- and 16-byte loads.
//!
//! A GGUF block interleaves its scales with its codes (Q8_0: a 2-byte scale,
//! then 32 one-byte codes — 34 bytes, so no block after the first is even
//! 4-byte aligned; the K-quants pack 6-bit scales and split codes across
//! bytes). [`repack`] rewrites a `[n, k]` weight into
//!
//! | format | `codes` | `scales` (16-bit words), per row | weight |
//! |---|---|---|---|
//! | [`QuantFormat::Q8`] (Q8_0) | `[n, k]` int8 | `k/32` × f16 `d` | `d·q` |
//! | [`QuantFormat::Q4`] (Q4_0, Q4_1) | `[n, k/2]` nibbles | `k/32` × f16 pair `(d, m)` | `fma(d, q, m)` |
//! | [`QuantFormat::Q4K`] (Q4_K) | `[n, k/2]` nibbles | `k/32` × `(sc, m)` bytes, then `k/256` × f16 pair `(d, dmin)` | `fma(d·sc, q, −dmin·m)` |
//! | [`QuantFormat::Q5K`] (Q5_K) | `[n, k]` bytes 0..31 | as Q4K | as Q4K |
//! | [`QuantFormat::Q6K`] (Q6_K) | `[n, k]` int8 `q − 32` | `k/16` × int8 `sc`, then `k/256` × f16 `d` | `(d·sc)·q` |
//! | [`QuantFormat::F32`] (every other type, dequantized) | `[n, k]` f32 | none | the value |
//!
//! Nibbles are in natural order: code `2i` in the low nibble of byte `i`,
//! `2i + 1` in the high. Q8_0, Q4_0 and Q4_1 keep the file's bytes (Q4_0's
//! `d·(q − 8)` is `d·q + m` with `m = −8d`, exact in f16); Q4_K keeps them
//! within 3% (its 6-bit scales become bytes), Q5_K and Q6_K take a byte a
//! code (5.6 and 8.6 bits a weight against the file's 5.5 and 6.6) so that
//! 16 codes are one aligned load. The values are the file's, bit for bit:
//! each formula is ggml's, in ggml's order (`d·sc` and `dmin·m` exact in
//! f32, one rounding after). The kernels (`kernels/cuda/common.cuh`,
//! "weight layouts") decode exactly this; [`dequantize_repacked`] is the
//! host's copy of them, checked against ggml's dequantization here and
//! against the kernels' own source compiled for the host
//! (`tests/decode_on_host.rs`).

use vellum_ops::quant::{scale_min_k4, GgmlType};

/// The device layout of a weight's values (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// int8 codes, an f16 scale per 32.
    Q8,
    /// 4-bit codes, an f16 scale and min per 32.
    Q4,
    /// Q4_K: 4-bit codes, 6-bit scale and min per 32 (as bytes), f16 `d`
    /// and `dmin` per 256.
    Q4K,
    /// Q5_K: 5-bit codes a byte each, scales as Q4K.
    Q5K,
    /// Q6_K: signed 6-bit codes a byte each, an int8 scale per 16, f16 `d`
    /// per 256.
    Q6K,
    /// f32 values.
    F32,
}

impl QuantFormat {
    /// Bytes of `codes` for a `[n, k]` weight.
    pub fn code_bytes(self, n: usize, k: usize) -> usize {
        match self {
            QuantFormat::Q8 | QuantFormat::Q5K | QuantFormat::Q6K => n * k,
            QuantFormat::Q4 | QuantFormat::Q4K => n * k / 2,
            QuantFormat::F32 => n * k * 4,
        }
    }

    /// 16-bit words of `scales` for a `[n, k]` weight.
    pub fn scale_words(self, n: usize, k: usize) -> usize {
        n * match self {
            QuantFormat::Q8 => k / 32,
            QuantFormat::Q4 => k / 16,
            QuantFormat::Q4K | QuantFormat::Q5K => k / 32 + k / 128,
            QuantFormat::Q6K => k / 32 + k / 256,
            QuantFormat::F32 => 0,
        }
    }

    /// Values a row must be a whole number of.
    pub fn block(self) -> usize {
        match self {
            QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K => 256,
            _ => 32,
        }
    }

    /// The entry-point suffix of the kernels that read it.
    pub fn suffix(self) -> &'static str {
        match self {
            QuantFormat::Q8 => "q8",
            QuantFormat::Q4 => "q4",
            QuantFormat::Q4K => "q4k",
            QuantFormat::Q5K => "q5k",
            QuantFormat::Q6K => "q6k",
            QuantFormat::F32 => "f32",
        }
    }

    /// The format a GGUF type is kept in natively, if any (the others are
    /// dequantized, to f32 or to bf16, by the caller).
    pub fn native(dtype: GgmlType) -> Option<Self> {
        match dtype {
            GgmlType::Q8_0 => Some(QuantFormat::Q8),
            GgmlType::Q4_0 | GgmlType::Q4_1 => Some(QuantFormat::Q4),
            GgmlType::Q4_K => Some(QuantFormat::Q4K),
            GgmlType::Q5_K => Some(QuantFormat::Q5K),
            GgmlType::Q6_K => Some(QuantFormat::Q6K),
            _ => None,
        }
    }
}

/// A weight in its device layout, still on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Repacked {
    /// The layout.
    pub format: QuantFormat,
    /// The code plane.
    pub codes: Vec<u8>,
    /// The scale plane (16-bit words); empty for [`QuantFormat::F32`].
    pub scales: Vec<u16>,
}

/// Why [`repack`] refused a weight.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RepackError {
    /// The type has no native layout ([`QuantFormat::native`] is `None`).
    #[error("{0} has no native CUDA layout")]
    NoNativeLayout(GgmlType),
    /// `k` is not a whole number of the type's blocks.
    #[error("rows of {0} values are not whole blocks of {1}")]
    RowNotBlocks(usize, usize),
    /// The bytes do not hold `n · k` values of the type.
    #[error("{got} bytes for [{n}, {k}] in {dtype}")]
    Length {
        /// The type.
        dtype: GgmlType,
        /// Rows.
        n: usize,
        /// Columns.
        k: usize,
        /// Bytes given.
        got: usize,
    },
    /// Q4_0's min `−8d` overflows f16 (a scale beyond ±8188).
    #[error("a Q4_0 scale of {0} has no f16 min (−8·d overflows)")]
    MinOverflow(f32),
}

/// Splits `[n, k]` weights of `dtype` (GGUF blocks, row after row) into the
/// device layout: codes and scales in planes, values unchanged. Rows are
/// independent: a large weight is split over the cores (an 8B model is
/// 8.5 GB of them).
pub fn repack(dtype: GgmlType, data: &[u8], n: usize, k: usize) -> Result<Repacked, RepackError> {
    let format = QuantFormat::native(dtype).ok_or(RepackError::NoNativeLayout(dtype))?;
    let (block, block_bytes) = dtype.block_layout();
    if k == 0 || !k.is_multiple_of(block) {
        return Err(RepackError::RowNotBlocks(k, block));
    }
    let row_bytes = k / block * block_bytes;
    if data.len() != n * row_bytes {
        return Err(RepackError::Length { dtype, n, k, got: data.len() });
    }
    let mut codes = vec![0u8; format.code_bytes(n, k)];
    let mut scales = vec![0u16; format.scale_words(n, k)];
    let (code_row, scale_row) = (format.code_bytes(1, k), format.scale_words(1, k));
    let threads = if data.len() < (16 << 20) { 1 } else { std::thread::available_parallelism().map_or(1, |t| t.get()).min(16) };
    let rows_per = n.div_ceil(threads).max(1);
    let overflow = std::sync::atomic::AtomicU32::new(0);
    std::thread::scope(|scope| {
        let parts = data
            .chunks(rows_per * row_bytes)
            .zip(codes.chunks_mut(rows_per * code_row))
            .zip(scales.chunks_mut((rows_per * scale_row).max(1)));
        for ((d, c), s) in parts {
            let overflow = &overflow;
            scope.spawn(move || {
                for (r, (row, codes)) in d.chunks_exact(row_bytes).zip(c.chunks_exact_mut(code_row)).enumerate() {
                    let scales = &mut s[r * scale_row..(r + 1) * scale_row];
                    if let Some(bad) = repack_row(dtype, row, codes, scales, k) {
                        overflow.store(bad.to_bits(), std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let bad = overflow.into_inner();
    if bad != 0 {
        return Err(RepackError::MinOverflow(f32::from_bits(bad)));
    }
    Ok(Repacked { format, codes, scales })
}

/// Packs two codes a byte: `code(2i)` low, `code(2i + 1)` high.
fn pack_nibbles(out: &mut [u8], code: impl Fn(usize) -> u8) {
    for (i, b) in out.iter_mut().enumerate() {
        *b = code(2 * i) | (code(2 * i + 1) << 4);
    }
}

/// Repacks one row of blocks (`k` values) into its codes and its scales
/// (the row's slices of the planes); a Q4_0 scale whose min overflows is
/// returned.
fn repack_row(dtype: GgmlType, data: &[u8], codes: &mut [u8], scales: &mut [u16], k: usize) -> Option<f32> {
    let word = |b: &[u8], i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    match dtype {
        GgmlType::Q8_0 => {
            for ((block, c), s) in data.chunks_exact(34).zip(codes.chunks_exact_mut(32)).zip(scales.iter_mut()) {
                *s = word(block, 0);
                c.copy_from_slice(&block[2..]);
            }
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let q4_0 = dtype == GgmlType::Q4_0;
            let block_bytes = if q4_0 { 18 } else { 20 };
            for ((block, c), s) in data.chunks_exact(block_bytes).zip(codes.chunks_exact_mut(16)).zip(scales.chunks_exact_mut(2)) {
                let d = word(block, 0);
                let (m, nibbles) = if q4_0 {
                    let m = half::f16::from_f32(-8.0 * half::f16::from_bits(d).to_f32());
                    if !m.is_finite() {
                        return Some(half::f16::from_bits(d).to_f32());
                    }
                    (m.to_bits(), &block[2..18])
                } else {
                    (word(block, 2), &block[4..20])
                };
                s[0] = d;
                s[1] = m;
                // GGUF: byte j holds code j (low nibble) and code j + 16 (high).
                pack_nibbles(c, |j| if j < 16 { nibbles[j] & 0x0f } else { nibbles[j - 16] >> 4 });
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let q5 = dtype == GgmlType::Q5_K;
            let (sub, sup) = scales.split_at_mut(k / 32);
            let block_bytes = if q5 { 176 } else { 144 };
            for (sb, block) in data.chunks_exact(block_bytes).enumerate() {
                sup[2 * sb] = word(block, 0);
                sup[2 * sb + 1] = word(block, 2);
                let packed = &block[4..16];
                for j in 0..8 {
                    let (sc, m) = scale_min_k4(j, packed);
                    sub[8 * sb + j] = u16::from(sc) | (u16::from(m) << 8);
                }
                // Value v of the super-block: chunk v / 64, byte v % 32 of
                // its 32, the low nibble for the first 32 values, the high
                // for the next; Q5_K's fifth bit in qh[v % 32], bit 2·chunk
                // (+1 for the high half).
                let (qh, qs) = if q5 { (&block[16..48], &block[48..176]) } else { (&block[..0], &block[16..144]) };
                let code = |v: usize| {
                    let (chunk, l, high) = (v / 64, v % 32, (v % 64) >= 32);
                    let byte = qs[32 * chunk + l];
                    let low = if high { byte >> 4 } else { byte & 0x0f };
                    let bit = if q5 && (qh[l] >> (2 * chunk + usize::from(high))) & 1 == 1 { 16 } else { 0 };
                    low + bit
                };
                if q5 {
                    for (v, c) in codes[256 * sb..256 * (sb + 1)].iter_mut().enumerate() {
                        *c = code(v);
                    }
                } else {
                    pack_nibbles(&mut codes[128 * sb..128 * (sb + 1)], code);
                }
            }
        }
        GgmlType::Q6_K => {
            let (sub, sup) = scales.split_at_mut(k / 32);
            for (sb, block) in data.chunks_exact(210).enumerate() {
                let (ql, qh, sc) = (&block[0..128], &block[128..192], &block[192..208]);
                sup[sb] = word(block, 208);
                // 16 int8 scales, two to a word, in value order.
                for (j, w) in sub[8 * sb..8 * (sb + 1)].iter_mut().enumerate() {
                    *w = u16::from(sc[2 * j]) | (u16::from(sc[2 * j + 1]) << 8);
                }
                // Value v: half v / 128; within it l = v % 32 and quarter
                // (v % 128) / 32 pick the nibble of ql and the bit pair of qh
                // (ggml's q1..q4). Its scale is sc[v / 16], as packed above.
                for (v, c) in codes[256 * sb..256 * (sb + 1)].iter_mut().enumerate() {
                    let (h, l, quarter) = (v / 128, v % 32, (v % 128) / 32);
                    let (ql, qh) = (&ql[64 * h..], &qh[32 * h..]);
                    let low = match quarter {
                        0 => ql[l] & 0x0f,
                        1 => ql[l + 32] & 0x0f,
                        2 => ql[l] >> 4,
                        _ => ql[l + 32] >> 4,
                    };
                    let high = (qh[l] >> (2 * quarter)) & 3;
                    *c = ((low | (high << 4)) as i8 - 32) as u8;
                }
            }
        }
        _ => unreachable!("QuantFormat::native admitted {dtype}"),
    }
    None
}

/// The values a kernel decodes from a repacked `[n, k]` weight, in f32
/// (row-major), computed as the kernels compute them.
pub fn dequantize_repacked(r: &Repacked, n: usize, k: usize) -> Vec<f32> {
    let f16 = |b: u16| half::f16::from_bits(b).to_f32();
    let nib = |i: usize| {
        let byte = r.codes[i / 2];
        if i.is_multiple_of(2) {
            byte & 0x0f
        } else {
            byte >> 4
        }
    };
    let stride = r.format.scale_words(1, k);
    let mut out = Vec::with_capacity(n * k);
    for i in 0..n * k {
        let (row, kk) = (i / k.max(1), i % k.max(1));
        let col = &r.scales[(row * stride).min(r.scales.len())..];
        out.push(match r.format {
            QuantFormat::Q8 => f16(r.scales[i / 32]) * f32::from(r.codes[i] as i8),
            QuantFormat::Q4 => f16(r.scales[2 * (i / 32)]).mul_add(f32::from(nib(i)), f16(r.scales[2 * (i / 32) + 1])),
            QuantFormat::Q4K | QuantFormat::Q5K => {
                let sm = col[kk / 32];
                let (d, dmin) = (f16(col[k / 32 + 2 * (kk / 256)]), f16(col[k / 32 + 2 * (kk / 256) + 1]));
                let (d0, min0) = (d * f32::from(sm as u8), dmin * f32::from((sm >> 8) as u8));
                let q = if r.format == QuantFormat::Q4K { nib(i) } else { r.codes[i] };
                d0.mul_add(f32::from(q), -min0)
            }
            QuantFormat::Q6K => {
                let sc = (col[kk / 32] >> (8 * ((kk / 16) % 2))) as u8 as i8;
                let d = f16(col[k / 32 + kk / 256]);
                d * f32::from(sc) * f32::from(r.codes[i] as i8)
            }
            QuantFormat::F32 => f32::from_le_bytes([r.codes[4 * i], r.codes[4 * i + 1], r.codes[4 * i + 2], r.codes[4 * i + 3]]),
        });
    }
    out
}

/// `values` (row-major f32) as an [`QuantFormat::F32`] weight.
pub fn f32_layout(values: &[f32]) -> Repacked {
    Repacked { format: QuantFormat::F32, codes: values.iter().flat_map(|v| v.to_le_bytes()).collect(), scales: Vec::new() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vellum_ops::quant::dequantize;

    /// xorshift64*: reproducible bytes without a dependency.
    fn bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s ^= s >> 12;
                s ^= s << 25;
                s ^= s >> 27;
                (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
            })
            .collect()
    }

    /// Random blocks of `dtype` whose f16 fields are finite, small scales.
    fn blocks(dtype: GgmlType, n: usize, k: usize, seed: u64) -> Vec<u8> {
        let (block, bb) = dtype.block_layout();
        let mut data = bytes(seed, n * k / block * bb);
        let halves: &[usize] = match dtype {
            GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
            GgmlType::Q6_K => &[208],
            _ => &[0],
        };
        for (i, block) in data.chunks_exact_mut(bb).enumerate() {
            for (h, &at) in halves.iter().enumerate() {
                let v = half::f16::from_f32(if h == 0 { 0.001 + (i % 97) as f32 * 1e-4 } else { -0.05 + (i % 13) as f32 * 1e-3 });
                block[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        data
    }

    const TYPES: [GgmlType; 6] = [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K];

    #[test]
    fn repacked_weights_decode_to_the_gguf_values_bit_for_bit() {
        let (n, k) = (7, 512);
        for (seed, dtype) in TYPES.into_iter().enumerate() {
            let data = blocks(dtype, n, k, seed as u64 + 3);
            let want = dequantize(dtype, &data, n * k).expect("dequantizes");
            let r = repack(dtype, &data, n, k).expect("repacks");
            assert_eq!(r.codes.len(), r.format.code_bytes(n, k));
            assert_eq!(r.scales.len(), r.format.scale_words(n, k));
            if matches!(dtype, GgmlType::Q8_0 | GgmlType::Q4_1) {
                // The file's own bytes, rearranged.
                assert_eq!(r.codes.len() + 2 * r.scales.len(), data.len());
            }
            let got = dequantize_repacked(&r, n, k);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // Each formula is ggml's with its exact products first, so
                // the one rounding after is the same.
                assert!(g == w, "{dtype} value {i}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn a_large_weight_split_over_threads_repacks_as_row_by_row() {
        // 17 MB and more: past the size that splits the work.
        for dtype in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q6_K] {
            let (n, k) = (520, 32 * 1024);
            let data = blocks(dtype, n, k, 9);
            let r = repack(dtype, &data, n, k).expect("repacks");
            let (block, bb) = dtype.block_layout();
            let row = k / block * bb;
            let (cb, sw) = (r.format.code_bytes(1, k), r.format.scale_words(1, k));
            for i in (0..n).step_by(97) {
                let one = repack(dtype, &data[i * row..(i + 1) * row], 1, k).expect("one row");
                assert_eq!(&r.codes[i * cb..(i + 1) * cb], &one.codes[..], "{dtype} row {i} codes");
                assert_eq!(&r.scales[i * sw..(i + 1) * sw], &one.scales[..], "{dtype} row {i} scales");
            }
        }
    }

    #[test]
    fn q4_codes_are_in_natural_order_two_a_byte() {
        // One Q4_1 block: d = 1, m = 0, code j = j % 16 in GGUF's order
        // (byte j: code j low, code j + 16 high).
        let mut block = vec![0u8; 20];
        block[..2].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
        for j in 0..16 {
            block[4 + j] = (j as u8) | ((((j + 16) % 16) as u8) << 4);
        }
        let r = repack(GgmlType::Q4_1, &block, 1, 32).expect("repacks");
        let values: Vec<f32> = dequantize_repacked(&r, 1, 32);
        assert_eq!(values, (0..32).map(|j| (j % 16) as f32).collect::<Vec<_>>());
        assert_eq!(r.codes[0], 0x10, "codes 0 and 1 share byte 0");
    }

    #[test]
    fn types_without_a_native_layout_and_bad_shapes_are_typed_errors() {
        assert_eq!(repack(GgmlType::Q3_K, &[], 0, 256), Err(RepackError::NoNativeLayout(GgmlType::Q3_K)));
        assert_eq!(repack(GgmlType::Q8_0, &[0; 34], 1, 48), Err(RepackError::RowNotBlocks(48, 32)));
        assert_eq!(repack(GgmlType::Q6_K, &[0; 210], 1, 32), Err(RepackError::RowNotBlocks(32, 256)));
        assert!(matches!(repack(GgmlType::Q8_0, &[0; 33], 1, 32), Err(RepackError::Length { got: 33, .. })));
        let mut block = vec![0u8; 18];
        block[..2].copy_from_slice(&half::f16::from_f32(10000.0).to_le_bytes());
        assert!(matches!(repack(GgmlType::Q4_0, &block, 1, 32), Err(RepackError::MinOverflow(_))));
    }
}
