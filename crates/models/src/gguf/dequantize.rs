//! Conversion of ggml tensor data to f32.
//!
//! Block layouts (little-endian, `d` and `m` are f16):
//!
//! ```text
//! Q8_0 (34 B / 32 values):  d | q[32] as i8            value_i = q_i * d
//! Q4_0 (18 B / 32 values):  d | nibbles[16]            value_i = (q_i - 8) * d
//! Q4_1 (20 B / 32 values):  d | m | nibbles[16]        value_i = q_i * d + m
//!   nibbles[j] & 0x0f is element j, nibbles[j] >> 4 is element j + 16
//! ```

use super::ggml_type::GgmlType;
use half::{bf16, f16};

/// Converts `n_elements` values of type `ty` from `bytes` to f32.
///
/// Returns `None` if the type is not supported (see
/// [`GgmlType::is_dequantizable`]) or if `bytes` does not hold exactly
/// `n_elements` values; the caller names the tensor in its error.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Option<Vec<f32>> {
    let (block, block_bytes) = ty.block_layout();
    if n_elements % block != 0 || bytes.len() != (n_elements / block).checked_mul(block_bytes)? {
        return None;
    }
    let mut out = Vec::with_capacity(n_elements);
    match ty {
        GgmlType::F32 => out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        GgmlType::F16 => out.extend(bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())),
        GgmlType::BF16 => out.extend(bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())),
        GgmlType::Q8_0 => {
            for b in bytes.chunks_exact(block_bytes) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                out.extend(b[2..].iter().map(|&q| f32::from(q as i8) * d));
            }
        }
        GgmlType::Q4_0 => {
            for b in bytes.chunks_exact(block_bytes) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                let qs = &b[2..];
                out.extend(qs.iter().map(|&q| (f32::from(q & 0x0f) - 8.0) * d));
                out.extend(qs.iter().map(|&q| (f32::from(q >> 4) - 8.0) * d));
            }
        }
        GgmlType::Q4_1 => {
            for b in bytes.chunks_exact(block_bytes) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                let m = f16::from_le_bytes([b[2], b[3]]).to_f32();
                let qs = &b[4..];
                out.extend(qs.iter().map(|&q| f32::from(q & 0x0f) * d + m));
                out.extend(qs.iter().map(|&q| f32::from(q >> 4) * d + m));
            }
        }
        _ => return None,
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q8_0_block() {
        let mut b = h(0.5).to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let v = dequantize(GgmlType::Q8_0, &b, 32).unwrap();
        assert_eq!(v[0], -8.0);
        assert_eq!(v[31], 7.5);
    }

    #[test]
    fn q4_0_nibble_order() {
        let mut b = h(2.0).to_vec();
        // Element j in the low nibble of byte j, element j+16 in the high one.
        b.extend((0..16u8).map(|j| (15 - j) << 4 | j));
        let v = dequantize(GgmlType::Q4_0, &b, 32).unwrap();
        assert_eq!(v[0], -16.0);
        assert_eq!(v[15], 14.0);
        assert_eq!(v[16], 14.0);
        assert_eq!(v[31], -16.0);
    }

    #[test]
    fn q4_1_scale_and_min() {
        let mut b = h(0.25).to_vec();
        b.extend(h(-1.0));
        b.extend((0..16u8).map(|j| 3 << 4 | j));
        let v = dequantize(GgmlType::Q4_1, &b, 32).unwrap();
        assert_eq!(v[0], -1.0);
        assert_eq!(v[4], 0.0);
        assert_eq!(v[16], -0.25);
    }

    #[test]
    fn plain_types_and_bad_lengths() {
        let b: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(dequantize(GgmlType::F32, &b, 2).unwrap(), vec![1.5, -2.0]);
        assert_eq!(dequantize(GgmlType::BF16, &bf16::from_f32(3.0).to_le_bytes(), 1).unwrap(), vec![3.0]);
        assert_eq!(dequantize(GgmlType::F16, &h(-0.5), 1).unwrap(), vec![-0.5]);
        assert!(dequantize(GgmlType::F32, &b, 3).is_none());
        assert!(dequantize(GgmlType::Q8_0, &[0; 34], 16).is_none());
        assert!(dequantize(GgmlType::Q6_K, &[0; 210], 256).is_none());
    }
}
