//! The block decoders against a second reading of each format, written
//! element by element from its definition (where value `i` finds its bits,
//! its scale and its min), on random blocks. The kernels above follow ggml's
//! loop order instead; both must give the same f32 values.

use super::*;
use vellum_base::SeededRng;

fn h(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

fn f16_at(b: &[u8], at: usize) -> f64 {
    f64::from(f16::from_le_bytes([b[at], b[at + 1]]).to_f32())
}

/// Bit `bit` of the little-endian bit string `bytes`.
fn bit(bytes: &[u8], bit: usize) -> u32 {
    u32::from((bytes[bit / 8] >> (bit % 8)) & 1)
}

/// Bits `at..at + n` (LSB first) of byte `byte` of `bytes`.
fn bits(bytes: &[u8], byte: usize, at: usize, n: usize) -> u32 {
    u32::from(bytes[byte] >> at) & ((1 << n) - 1)
}

/// Value `i` of one block, from the format's definition, in f64.
fn reference(ty: GgmlType, b: &[u8], i: usize) -> f64 {
    match ty {
        GgmlType::Q8_0 => f16_at(b, 0) * f64::from(b[2 + i] as i8),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            // Four low bits: nibble (i % 16) of the quant bytes, low half for i < 16.
            let qs = match ty {
                GgmlType::Q4_0 => 2,
                GgmlType::Q4_1 | GgmlType::Q5_0 => 4 + 2 * usize::from(ty == GgmlType::Q5_0),
                _ => 8,
            };
            let mut q = bits(b, qs + i % 16, 4 * (i / 16), 4);
            if matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1) {
                let qh = if ty == GgmlType::Q5_0 { 2 } else { 4 };
                q |= bit(&b[qh..qh + 4], i) << 4;
            }
            let d = f16_at(b, 0);
            match ty {
                GgmlType::Q4_0 => d * (f64::from(q) - 8.0),
                GgmlType::Q5_0 => d * (f64::from(q) - 16.0),
                _ => d * f64::from(q) + f16_at(b, 2),
            }
        }
        GgmlType::Q2_K | GgmlType::Q3_K => {
            // Sub-blocks of 16; 2-bit quant at byte (i / 128)·32 + i % 32, bit pair (i % 128) / 32.
            let (sub, byte, pair) = (i / 16, (i / 128) * 32 + i % 32, (i % 128) / 32);
            if ty == GgmlType::Q2_K {
                let q = bits(&b[16..80], byte, 2 * pair, 2);
                let (sc, m) = (bits(b, sub, 0, 4), bits(b, sub, 4, 4));
                f16_at(b, 80) * f64::from(sc) * f64::from(q) - f16_at(b, 82) * f64::from(m)
            } else {
                let q = bits(&b[32..96], byte, 2 * pair, 2) as i32;
                // The high bit: bit (i / 32) of hmask byte i % 32; set means no −4.
                let high = bits(&b[0..32], i % 32, i / 32, 1);
                let scales = &b[96..108];
                let low = if sub < 8 { bits(scales, sub, 0, 4) } else { bits(scales, sub - 8, 4, 4) };
                let top = bits(scales, 8 + sub % 4, 2 * (sub / 4), 2);
                let s = (low | top << 4) as i32 - 32;
                f16_at(b, 108) * f64::from(s) * f64::from(q - if high == 1 { 0 } else { 4 })
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            // Sub-blocks of 32; chunk of 64 = sub / 2; low nibble for even sub-blocks.
            let sub = i / 32;
            let scales = &b[4..16];
            let (sc, m) = if sub < 4 {
                (bits(scales, sub, 0, 6), bits(scales, sub + 4, 0, 6))
            } else {
                (bits(scales, sub + 4, 0, 4) | bits(scales, sub - 4, 6, 2) << 4, bits(scales, sub + 4, 4, 4) | bits(scales, sub, 6, 2) << 4)
            };
            let qs = if ty == GgmlType::Q4_K { 16 } else { 48 };
            let mut q = bits(&b[qs..], (sub / 2) * 32 + i % 32, 4 * (sub % 2), 4);
            if ty == GgmlType::Q5_K {
                q |= bits(&b[16..48], i % 32, sub, 1) << 4;
            }
            f16_at(b, 0) * f64::from(sc) * f64::from(q) - f16_at(b, 2) * f64::from(m)
        }
        GgmlType::Q6_K => {
            // Halves of 128; within one, quarter (i % 128) / 32 picks the ql byte
            // (quarters 0, 2 from bytes 0..32, 1, 3 from 32..64) and nibble, and the qh bit pair.
            let (n, r) = (i / 128, i % 128);
            let (quarter, l) = (r / 32, r % 32);
            let low = bits(&b[n * 64..], l + 32 * (quarter % 2), 4 * (quarter / 2), 4);
            let high = bits(&b[128 + n * 32..], l, 2 * quarter, 2);
            let q = (low | high << 4) as i32 - 32;
            let sc = b[192 + i / 16] as i8;
            f16_at(b, 208) * f64::from(sc) * f64::from(q)
        }
        _ => unreachable!("no reference for {ty}"),
    }
}

/// A random block of `ty` whose f16 fields hold small finite values.
fn random_block(ty: GgmlType, rng: &mut SeededRng) -> Vec<u8> {
    let (_, nb) = ty.block_layout();
    let mut b: Vec<u8> = (0..nb).map(|_| rng.below(256) as u8).collect();
    let halves: &[usize] = match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[0],
    };
    for &at in halves {
        b[at..at + 2].copy_from_slice(&h(rng.signed_f32() * 0.1));
    }
    b
}

const QUANTIZED: [GgmlType; 10] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

#[test]
fn every_quantized_type_matches_its_definition_on_random_blocks() {
    let mut rng = SeededRng::new(13);
    for ty in QUANTIZED {
        assert!(ty.is_dequantizable(), "{ty}");
        let (block, _) = ty.block_layout();
        for _ in 0..50 {
            let b = random_block(ty, &mut rng);
            let got = dequantize(ty, &b, block).unwrap();
            for (i, &g) in got.iter().enumerate() {
                let want = reference(ty, &b, i);
                // Both sides round the same f32 products; f64 differs by the last bits.
                assert!((f64::from(g) - want).abs() <= 1e-6 * want.abs().max(1e-3), "{ty} value {i}: {g} vs {want}");
            }
        }
    }
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
fn q5_0_high_bits() {
    // d = 1, every nibble 0, high bits set for elements 0 and 16 only.
    let mut b = h(1.0).to_vec();
    b.extend((1u32 | 1 << 16).to_le_bytes());
    b.extend([0u8; 16]);
    let v = dequantize(GgmlType::Q5_0, &b, 32).unwrap();
    assert_eq!((v[0], v[1], v[16], v[17]), (0.0, -16.0, 0.0, -16.0));
}

#[test]
fn plain_types_and_bad_lengths() {
    let b: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(dequantize(GgmlType::F32, &b, 2).unwrap(), vec![1.5, -2.0]);
    assert_eq!(dequantize(GgmlType::BF16, &bf16::from_f32(3.0).to_le_bytes(), 1).unwrap(), vec![3.0]);
    assert_eq!(dequantize(GgmlType::F16, &h(-0.5), 1).unwrap(), vec![-0.5]);
    assert!(dequantize(GgmlType::F32, &b, 3).is_none());
    assert!(dequantize(GgmlType::Q8_0, &[0; 34], 16).is_none());
    assert!(dequantize(GgmlType::Q6_K, &[0; 210], 128).is_none());
    assert!(dequantize(GgmlType::Q6_K, &[0; 209], 256).is_none());
    assert!(dequantize(GgmlType::IQ2_XXS, &[0; 66], 256).is_none());
}
