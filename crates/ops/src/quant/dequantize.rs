//! Conversion of ggml tensor data to f32.
//!
//! Block layouts, little-endian; `d`, `m`, `dmin` are f16 and every product
//! is computed in f32, in ggml's order, so the values equal ggml's own:
//!
//! ```text
//! Q8_0 (34 B / 32):   d | q[32] i8                          x_i = d·q_i
//! Q4_0 (18 B / 32):   d | nib[16]                           x_i = d·(q_i − 8)
//! Q4_1 (20 B / 32):   d | m | nib[16]                       x_i = d·q_i + m
//! Q5_0 (22 B / 32):   d | qh u32 | nib[16]                  x_i = d·(q_i − 16)
//! Q5_1 (24 B / 32):   d | m | qh u32 | nib[16]              x_i = d·q_i + m
//!   nib[j] & 0x0f is q_j, nib[j] >> 4 is q_{j+16}; for Q5 bit i of qh is
//!   bit 4 of q_i.
//!
//! Super-blocks of 256 values (K-quants), split into sub-blocks with their
//! own scale (and min):
//! Q2_K (84 B):  sc[16] | qs[64] | d | dmin        16 × 16, x = d·(sc&15)·q − dmin·(sc>>4), q 2-bit
//! Q3_K (110 B): hmask[32] | qs[64] | sc[12] | d   16 × 16, x = d·(s−32)·(q − 4·!hbit), q 2-bit + hbit
//! Q4_K (144 B): d | dmin | sc[12] | qs[128]       8 × 32,  x = d·s·q − dmin·m, q 4-bit
//! Q5_K (176 B): d | dmin | sc[12] | qh[32] | qs[128]  8 × 32, as Q4_K with a 5th bit
//! Q6_K (210 B): ql[128] | qh[64] | sc[16] i8 | d  16 × 16, x = d·sc·(q − 32), q 6-bit
//! ```
//!
//! Within a K-quant super-block the quants of 128 values share bytes: in
//! Q2_K/Q3_K byte `l` of a 32-byte group holds values `l`, `l+32`, `l+64`,
//! `l+96` in its bit pairs; in Q4_K/Q5_K byte `l` of a 32-byte group holds
//! value `l` (low nibble) and `l+32` (high nibble) of a 64-value chunk; Q6_K
//! spreads 128 values over 64 low-nibble bytes and 32 high-bit bytes.
//! Q3_K/Q4_K/Q5_K pack 6-bit scales into 12 bytes (see [`scale_min_k4`]
//! and [`q3_k_scales`]).

use super::ggml_type::GgmlType;
use half::{bf16, f16};

/// Converts `n_elements` values of type `ty` from `bytes` to f32.
///
/// Returns `None` if the type is not supported (see
/// [`GgmlType::is_dequantizable`]) or if `bytes` does not hold exactly
/// `n_elements` values; the caller names the tensor in its error.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Option<Vec<f32>> {
    let mut out = vec![0.0; n_elements];
    dequantize_into(ty, bytes, &mut out)?;
    Some(out)
}

/// Converts `bytes` of type `ty` into `out`, whose length says how many
/// values `bytes` must hold. `None` as for [`dequantize`]; `out` is then
/// left unspecified.
#[inline(always)]
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Option<()> {
    let (block, block_bytes) = ty.block_layout();
    if !out.len().is_multiple_of(block) || bytes.len() != (out.len() / block).checked_mul(block_bytes)? {
        return None;
    }
    // Each arm calls its kernel directly (no function pointer), so a caller
    // compiled with wider vector instructions (the CPU backend's AVX2
    // wrapper) inlines and vectorizes the kernel's loops.
    match ty {
        GgmlType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => each_block(bytes, out, block, block_bytes, q8_0),
        GgmlType::Q4_0 => each_block(bytes, out, block, block_bytes, q4_0),
        GgmlType::Q4_1 => each_block(bytes, out, block, block_bytes, q4_1),
        GgmlType::Q5_0 => each_block(bytes, out, block, block_bytes, q5_0),
        GgmlType::Q5_1 => each_block(bytes, out, block, block_bytes, q5_1),
        GgmlType::Q2_K => each_block(bytes, out, block, block_bytes, q2_k),
        GgmlType::Q3_K => each_block(bytes, out, block, block_bytes, q3_k),
        GgmlType::Q4_K => each_block(bytes, out, block, block_bytes, q4_k),
        GgmlType::Q5_K => each_block(bytes, out, block, block_bytes, q5_k),
        GgmlType::Q6_K => each_block(bytes, out, block, block_bytes, q6_k),
        _ => return None,
    }
    Some(())
}

/// `kernel` on every block of `bytes`, into the matching values of `out`.
#[inline(always)]
fn each_block(bytes: &[u8], out: &mut [f32], block: usize, block_bytes: usize, kernel: impl Fn(&[u8], &mut [f32])) {
    for (b, o) in bytes.chunks_exact(block_bytes).zip(out.chunks_exact_mut(block)) {
        kernel(b, o);
    }
}

#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

#[inline]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

#[inline(always)]
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = f32::from(q as i8) * d;
    }
}

#[inline(always)]
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[2..18].iter().enumerate() {
        lo[j] = (f32::from(q & 0x0f) - 8.0) * d;
        hi[j] = (f32::from(q >> 4) - 8.0) * d;
    }
}

#[inline(always)]
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[4..20].iter().enumerate() {
        lo[j] = f32::from(q & 0x0f) * d + m;
        hi[j] = f32::from(q >> 4) * d + m;
    }
}

/// The 5-bit quants of a Q5_0/Q5_1 block: `qh` holds bit 4 of each.
#[inline]
fn q5_values(qh: u32, qs: &[u8], j: usize) -> (u8, u8) {
    let h0 = ((qh >> j) & 1) as u8;
    let h1 = ((qh >> (j + 16)) & 1) as u8;
    ((qs[j] & 0x0f) | h0 << 4, (qs[j] >> 4) | h1 << 4)
}

#[inline(always)]
fn q5_0(b: &[u8], y: &mut [f32]) {
    let (d, qh, qs) = (half(b, 0), u32_at(b, 2), &b[6..22]);
    for j in 0..16 {
        let (x0, x1) = q5_values(qh, qs, j);
        y[j] = f32::from(x0 as i8 - 16) * d;
        y[j + 16] = f32::from(x1 as i8 - 16) * d;
    }
}

#[inline(always)]
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m, qh, qs) = (half(b, 0), half(b, 2), u32_at(b, 4), &b[8..24]);
    for j in 0..16 {
        let (x0, x1) = q5_values(qh, qs, j);
        y[j] = f32::from(x0) * d + m;
        y[j + 16] = f32::from(x1) * d + m;
    }
}

#[inline(always)]
fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (half(b, 80), half(b, 82));
    let mut is = 0;
    for (half_block, q) in qs.chunks_exact(32).enumerate() {
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * f32::from(sc & 0x0f), dmin * f32::from(sc >> 4));
                let base = half_block * 128 + (shift / 2) * 32 + part * 16;
                for l in 0..16 {
                    y[base + l] = dl * f32::from((q[part * 16 + l] >> shift) & 3) - ml;
                }
            }
        }
    }
}

/// The sixteen 6-bit Q3_K scales from their 12 packed bytes: scale `i` has
/// its low nibble in byte `i % 8` (low half for `i < 8`, high half after)
/// and its top two bits in byte `8 + i % 4`, at bit `2·(i / 4)`.
pub(crate) fn q3_k_scales(packed: &[u8]) -> [i8; 16] {
    let mut s = [0i8; 16];
    for (i, out) in s.iter_mut().enumerate() {
        let low = if i < 8 { packed[i] & 0x0f } else { packed[i - 8] >> 4 };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        *out = (low | high << 4) as i8 - 32;
    }
    s
}

#[inline(always)]
fn q3_k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    let scales = q3_k_scales(&b[96..108]);
    let d = half(b, 108);
    let mut is = 0;
    let mut m = 1u8;
    for (half_block, q) in qs.chunks_exact(32).enumerate() {
        for shift in [0, 2, 4, 6] {
            for part in 0..2 {
                let dl = d * f32::from(scales[is]);
                is += 1;
                let base = half_block * 128 + (shift / 2) * 32 + part * 16;
                for l in 0..16 {
                    let k = part * 16 + l;
                    let low = ((q[k] >> shift) & 3) as i8;
                    let sub = if hmask[k] & m != 0 { 0 } else { 4 };
                    y[base + l] = dl * f32::from(low - sub);
                }
            }
            m <<= 1;
        }
    }
}

/// Scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block, 6 bits
/// each, packed into 12 bytes: sub-blocks 0–3 in the low 6 bits of bytes
/// `j` (scale) and `j+4` (min); 4–7 in the nibbles of byte `j+4` with their
/// top two bits in the spare bits 6–7 of bytes `j−4` and `j`.
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

#[inline(always)]
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin, scales, qs) = (half(b, 0), half(b, 2), &b[4..16], &b[16..144]);
    for (chunk, q) in qs.chunks_exact(32).enumerate() {
        let (sc0, m0) = scale_min_k4(2 * chunk, scales);
        let (sc1, m1) = scale_min_k4(2 * chunk + 1, scales);
        let (d0, min0) = (d * f32::from(sc0), dmin * f32::from(m0));
        let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let out = &mut y[chunk * 64..chunk * 64 + 64];
        for l in 0..32 {
            out[l] = d0 * f32::from(q[l] & 0x0f) - min0;
            out[l + 32] = d1 * f32::from(q[l] >> 4) - min1;
        }
    }
}

#[inline(always)]
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin, scales, qh, qs) = (half(b, 0), half(b, 2), &b[4..16], &b[16..48], &b[48..176]);
    for (chunk, q) in qs.chunks_exact(32).enumerate() {
        let (sc0, m0) = scale_min_k4(2 * chunk, scales);
        let (sc1, m1) = scale_min_k4(2 * chunk + 1, scales);
        let (d0, min0) = (d * f32::from(sc0), dmin * f32::from(m0));
        let (d1, min1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (u0, u1) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        let out = &mut y[chunk * 64..chunk * 64 + 64];
        for l in 0..32 {
            let h0 = if qh[l] & u0 != 0 { 16 } else { 0 };
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            out[l] = d0 * f32::from((q[l] & 0x0f) + h0) - min0;
            out[l + 32] = d1 * f32::from((q[l] >> 4) + h1) - min1;
        }
    }
}

#[inline(always)]
fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half(b, 208);
    for n in 0..2 {
        let (ql, qh, sc) = (&ql[n * 64..], &qh[n * 32..], &sc[n * 8..]);
        let out = &mut y[n * 128..n * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            out[l] = d * f32::from(sc[is] as i8) * f32::from(q1);
            out[l + 32] = d * f32::from(sc[is + 2] as i8) * f32::from(q2);
            out[l + 64] = d * f32::from(sc[is + 4] as i8) * f32::from(q3);
            out[l + 96] = d * f32::from(sc[is + 6] as i8) * f32::from(q4);
        }
    }
}

#[cfg(test)]
mod tests;
