//! How a quantized weight sits on the device: the file's blocks split into
//! a plane of codes and a plane of scales, so that every kernel reads them
//! with aligned, coalesced 8- and 16-byte loads.
//!
//! A GGUF block interleaves its scale with its codes (Q8_0: a 2-byte scale,
//! then 32 one-byte codes — 34 bytes, so no block after the first is even
//! 4-byte aligned). [`repack`] rewrites a `[n, k]` weight losslessly into
//!
//! | format | `codes` | `scales` (f16 bits) | weight |
//! |---|---|---|---|
//! | [`QuantFormat::Q8`] (Q8_0) | `[n, k]` int8 | `[n, k/32]`: `d` | `d · q` |
//! | [`QuantFormat::Q4`] (Q4_0, Q4_1) | `[n, k/2]` bytes: code `2i` in the low nibble of byte `i`, `2i + 1` in the high | `[n, k/32]` pairs `(d, m)` | `d · q + m` |
//! | [`QuantFormat::F32`] (every other type, dequantized) | `[n, k]` f32, little-endian | none | the value |
//!
//! The same bytes as the file (34 or 20 a block of 32), the same values:
//! Q4_0's `d · (q − 8)` is `d · q + m` with `m = −8d`, exact in f16. The
//! kernels (`kernels/cuda/common.cuh`, "weight layouts") decode exactly
//! this; the GPU suite checks them against [`dequantize_repacked`].

use vellum_ops::quant::GgmlType;

/// The device layout of a weight's values (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// int8 codes, an f16 scale per 32.
    Q8,
    /// 4-bit codes, an f16 scale and min per 32.
    Q4,
    /// f32 values.
    F32,
}

impl QuantFormat {
    /// Bytes of `codes` for a `[n, k]` weight.
    pub fn code_bytes(self, n: usize, k: usize) -> usize {
        match self {
            QuantFormat::Q8 => n * k,
            QuantFormat::Q4 => n * k / 2,
            QuantFormat::F32 => n * k * 4,
        }
    }

    /// 16-bit words of `scales` for a `[n, k]` weight.
    pub fn scale_words(self, n: usize, k: usize) -> usize {
        match self {
            QuantFormat::Q8 => n * k / 32,
            QuantFormat::Q4 => n * k / 16,
            QuantFormat::F32 => 0,
        }
    }

    /// The entry-point suffix of the kernels that read it.
    pub fn suffix(self) -> &'static str {
        match self {
            QuantFormat::Q8 => "q8",
            QuantFormat::Q4 => "q4",
            QuantFormat::F32 => "f32",
        }
    }

    /// The format a GGUF type is kept in natively, if any (the others are
    /// dequantized, to f32 or to bf16, by the caller).
    pub fn native(dtype: GgmlType) -> Option<Self> {
        match dtype {
            GgmlType::Q8_0 => Some(QuantFormat::Q8),
            GgmlType::Q4_0 | GgmlType::Q4_1 => Some(QuantFormat::Q4),
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
    /// The scale plane (f16 bits); empty for [`QuantFormat::F32`].
    pub scales: Vec<u16>,
}

/// Why [`repack`] refused a weight.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RepackError {
    /// The type has no native layout ([`QuantFormat::native`] is `None`).
    #[error("{0} has no native CUDA layout")]
    NoNativeLayout(GgmlType),
    /// `k` is not a whole number of blocks of 32.
    #[error("rows of {0} values are not whole blocks of 32")]
    RowNotBlocks(usize),
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
/// device layout: codes and scales in planes, values unchanged.
pub fn repack(dtype: GgmlType, data: &[u8], n: usize, k: usize) -> Result<Repacked, RepackError> {
    let format = QuantFormat::native(dtype).ok_or(RepackError::NoNativeLayout(dtype))?;
    if !k.is_multiple_of(32) {
        return Err(RepackError::RowNotBlocks(k));
    }
    let (_, block_bytes) = dtype.block_layout();
    let blocks = n * k / 32;
    if data.len() != blocks * block_bytes {
        return Err(RepackError::Length { dtype, n, k, got: data.len() });
    }
    let mut codes = vec![0u8; format.code_bytes(n, k)];
    let mut scales = vec![0u16; format.scale_words(n, k)];
    // Blocks are independent: large weights split over the cores (an 8B
    // model is 8.5 GB of them).
    let (code_bytes, scale_words) = (format.code_bytes(1, 32), format.scale_words(1, 32));
    let threads = if data.len() < (16 << 20) { 1 } else { std::thread::available_parallelism().map_or(1, |t| t.get()).min(16) };
    let per = blocks.div_ceil(threads).max(1);
    let overflow = std::sync::atomic::AtomicU32::new(0);
    std::thread::scope(|scope| {
        for ((d, c), s) in data.chunks(per * block_bytes).zip(codes.chunks_mut(per * code_bytes)).zip(scales.chunks_mut(per * scale_words))
        {
            let overflow = &overflow;
            scope.spawn(move || {
                if let Some(bad) = repack_blocks(dtype, d, c, s) {
                    overflow.store(bad.to_bits(), std::sync::atomic::Ordering::Relaxed);
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

/// Repacks whole blocks of `data` into `codes` and `scales` (the matching
/// slices of the planes); a Q4_0 scale whose min overflows is returned.
fn repack_blocks(dtype: GgmlType, data: &[u8], codes: &mut [u8], scales: &mut [u16]) -> Option<f32> {
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
                // GGUF: byte j holds code j (low nibble) and code j + 16
                // (high). Here: byte i holds codes 2i and 2i + 1.
                for (i, out) in c.iter_mut().enumerate() {
                    let code = |j: usize| if j < 16 { nibbles[j] & 0x0f } else { nibbles[j - 16] >> 4 };
                    *out = code(2 * i) | (code(2 * i + 1) << 4);
                }
            }
        }
        _ => unreachable!("QuantFormat::native admitted {dtype}"),
    }
    None
}

/// The values a kernel decodes from a repacked `[n, k]` weight, in f32
/// (row-major), computed as the kernels compute them: `d · q` (exact in
/// f32) for Q8, `fma(d, q, m)` for Q4.
pub fn dequantize_repacked(r: &Repacked, n: usize, k: usize) -> Vec<f32> {
    let f16 = |b: u16| half::f16::from_bits(b).to_f32();
    let mut out = Vec::with_capacity(n * k);
    match r.format {
        QuantFormat::Q8 => {
            for (i, &c) in r.codes.iter().enumerate() {
                out.push(f16(r.scales[i / 32]) * f32::from(c as i8));
            }
        }
        QuantFormat::Q4 => {
            for i in 0..n * k {
                let byte = r.codes[i / 2];
                let q = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                let b = i / 32;
                out.push(f16(r.scales[2 * b]).mul_add(f32::from(q), f16(r.scales[2 * b + 1])));
            }
        }
        QuantFormat::F32 => out.extend(r.codes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
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
        let (_, bb) = dtype.block_layout();
        let mut data = bytes(seed, n * k / 32 * bb);
        let halves = if dtype == GgmlType::Q4_1 { 2 } else { 1 };
        for (i, block) in data.chunks_exact_mut(bb).enumerate() {
            for h in 0..halves {
                let v = half::f16::from_f32(if h == 0 { 0.001 + (i % 97) as f32 * 1e-4 } else { -0.05 + (i % 13) as f32 * 1e-3 });
                block[2 * h..2 * h + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        data
    }

    #[test]
    fn repacked_weights_decode_to_the_gguf_values_bit_for_bit() {
        let (n, k) = (7, 96);
        for (seed, dtype) in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1].into_iter().enumerate() {
            let data = blocks(dtype, n, k, seed as u64 + 3);
            let want = dequantize(dtype, &data, n * k).expect("dequantizes");
            let r = repack(dtype, &data, n, k).expect("repacks");
            assert_eq!(r.codes.len(), r.format.code_bytes(n, k));
            assert_eq!(r.scales.len(), r.format.scale_words(n, k));
            // Same bytes as the file: codes + scales = the blocks.
            assert_eq!(r.codes.len() + 2 * r.scales.len(), data.len() + if dtype == GgmlType::Q4_0 { 2 * n * k / 32 } else { 0 });
            let got = dequantize_repacked(&r, n, k);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // d·q is exact in f32, so fma(d, q, m) rounds d·q + m once,
                // as ggml's d·q + m does: the same value.
                assert!(g == w, "{dtype} value {i}: {g} vs {w}");
            }
        }
    }

    #[test]
    fn a_large_weight_split_over_threads_repacks_as_block_by_block() {
        // 17 MB of Q8_0 and of Q4_1: past the size that splits the work.
        for dtype in [GgmlType::Q8_0, GgmlType::Q4_1] {
            let (n, k) = (520, 32 * 1024);
            let data = blocks(dtype, n, k, 9);
            let r = repack(dtype, &data, n, k).expect("repacks");
            let (_, bb) = dtype.block_layout();
            let (cb, sw) = (r.format.code_bytes(1, 32), r.format.scale_words(1, 32));
            for (b, block) in data.chunks_exact(bb).enumerate().step_by(997) {
                let one = repack(dtype, block, 1, 32).expect("one block");
                assert_eq!(&r.codes[b * cb..(b + 1) * cb], &one.codes[..], "{dtype} block {b} codes");
                assert_eq!(&r.scales[b * sw..(b + 1) * sw], &one.scales[..], "{dtype} block {b} scales");
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
        assert_eq!(repack(GgmlType::Q6_K, &[], 0, 256), Err(RepackError::NoNativeLayout(GgmlType::Q6_K)));
        assert_eq!(repack(GgmlType::Q8_0, &[0; 34], 1, 48), Err(RepackError::RowNotBlocks(48)));
        assert!(matches!(repack(GgmlType::Q8_0, &[0; 33], 1, 32), Err(RepackError::Length { got: 33, .. })));
        let mut block = vec![0u8; 18];
        block[..2].copy_from_slice(&half::f16::from_f32(10000.0).to_le_bytes());
        assert!(matches!(repack(GgmlType::Q4_0, &block, 1, 32), Err(RepackError::MinOverflow(_))));
    }
}
