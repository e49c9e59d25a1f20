//! FP8 E4M3 (the OCP 8-bit float of NVIDIA's Hopper and of vLLM's
//! `--kv-cache-dtype fp8`): the element of an FP8 KV cache, rounded and
//! read the same way by every backend.
//!
//! ```text
//! bit   7    6 5 4 3    2 1 0
//!       s    e e e e    m m m          bias 7, no infinities
//!
//! e = 0          (-1)^s · 2⁻⁶ · m/8            subnormals, step 2⁻⁹
//! e = 1 ..= 15   (-1)^s · 2^(e-7) · (1 + m/8)  up to 1.75 · 2⁸ = 448
//! e = 15, m = 7  NaN (0x7f, 0xff)
//! ```
//!
//! **Reading a code as half precision.** Put the seven bits `e m` at bits
//! 13..7 of an IEEE binary16 and the sign at bit 15: the exponent field
//! becomes `0 e`, the mantissa `m` followed by seven zeros, and the half is
//! exactly the E4M3 value divided by 2⁸ (bias 15 against 7), subnormals
//! included. The kernels widen a code that way (one shift and a hardware
//! half-to-float conversion) and fold the 2⁸ into the layer's scale:
//! [`to_f16_units`] is what they compute, [`F16_UNIT`] the factor.
//!
//! **NaN.** A NaN key or value is stored as a NaN code (the range has no
//! infinities; larger magnitudes saturate), and the widening maps the two
//! NaN codes to a binary16 NaN (one compare and select more than the shift),
//! so a model that writes NaN into its cache sees NaN come out of attention
//! on the CPU and CUDA backends, as with a 16-bit cache (WGSL also widens
//! the code to NaN, but lets a device assume that arithmetic sees none).

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// A code read through [`to_f16_units`] is its value divided by this.
pub const F16_UNIT: f32 = 256.0;

/// The code of `x`, rounded to nearest with ties to even; magnitudes past
/// [`E4M3_MAX`] (infinities included) saturate to ±448, NaN stays NaN.
pub fn from_f32(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    if a < 2f32.powi(-6) {
        // Subnormal: a multiple of 2⁻⁹ (the scaling by 2⁹ is exact); 8 is
        // the smallest normal, code 0x08, by the same arithmetic.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal in f32 too: exponent e - 7 in 2⁻⁶ ..= 2⁸, mantissa to 3 bits.
    let bits = a.to_bits();
    let e = ((bits >> 23) as i32 - 127 + 7) as u32;
    let m = bits & 0x7f_ffff;
    let (q, rest) = (m >> 20, m & 0xf_ffff);
    let up = rest > 0x8_0000 || (rest == 0x8_0000 && q & 1 == 1);
    // A carry out of the mantissa moves to the next exponent, as it should;
    // below 448 it never reaches the NaN code (448 rounds from at most 464).
    let code = (e << 3) + q + u32::from(up);
    sign | code.min(0x7e) as u8
}

/// The value of `code` (NaN for 0x7f and 0xff).
pub fn to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((code >> 3) & 0xf), f32::from(code & 7));
    if e == 15 && m == 7.0 {
        return f32::NAN;
    }
    sign * if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) }
}

/// The binary16 bits whose value is `code`'s divided by [`F16_UNIT`] (see
/// the module doc); for a NaN code, a quiet binary16 NaN of its sign.
pub const fn to_f16_bits(code: u8) -> u16 {
    let sign = ((code & 0x80) as u16) << 8;
    if code & 0x7f == 0x7f {
        sign | 0x7e00
    } else {
        sign | (((code & 0x7f) as u16) << 7)
    }
}

/// `code`'s value divided by [`F16_UNIT`], as the kernels read it.
pub fn to_f16_units(code: u8) -> f32 {
    f16_to_f32(to_f16_bits(code))
}

/// An IEEE binary16 as `f32` (exact), for [`to_f16_units`] without a
/// dependency on a half-precision crate.
fn f16_to_f32(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((h >> 10) & 0x1f), f32::from(h & 0x3ff));
    sign * match e {
        0 => m * 2f32.powi(-24),
        31 if m == 0.0 => f32::INFINITY,
        31 => f32::NAN,
        _ => (1.0 + m / 1024.0) * 2f32.powi(e - 15),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codes() -> impl Iterator<Item = u8> {
        (0..=255u8).filter(|c| c & 0x7f != 0x7f)
    }

    #[test]
    fn every_code_reads_back_as_itself() {
        for c in codes() {
            let x = to_f32(c);
            // -0 is its own code.
            assert_eq!(from_f32(x), c, "code {c:#04x} = {x}");
        }
        assert!(to_f32(0x7f).is_nan() && to_f32(0xff).is_nan());
    }

    #[test]
    fn the_values_are_those_of_the_format() {
        assert_eq!(to_f32(0x7e), 448.0);
        assert_eq!(to_f32(0x08), 2f32.powi(-6));
        assert_eq!(to_f32(0x01), 2f32.powi(-9));
        assert_eq!(to_f32(0x38), 1.0);
        assert_eq!(to_f32(0xb8), -1.0);
        assert_eq!(to_f32(0x3c), 1.5);
    }

    #[test]
    fn half_bits_are_the_value_over_256() {
        for c in codes() {
            assert_eq!(to_f16_units(c) * F16_UNIT, to_f32(c), "code {c:#04x}");
        }
        assert!(to_f16_units(0x7f).is_nan() && to_f16_units(0xff).is_nan(), "NaN codes widen to NaN");
    }

    #[test]
    fn rounding_is_to_nearest_even_and_saturates() {
        // Midpoints between neighbouring codes go to the even mantissa.
        for c in codes().filter(|&c| c < 0x7e) {
            let (lo, hi) = (to_f32(c), to_f32(c + 1));
            let mid = (lo + hi) / 2.0;
            let even = if c & 1 == 0 { c } else { c + 1 };
            assert_eq!(from_f32(mid), even, "midpoint of {c:#04x} and {:#04x}", c + 1);
            assert_eq!(from_f32(lo + (hi - lo) * 0.25), c);
            assert_eq!(from_f32(lo + (hi - lo) * 0.75), c + 1);
        }
        for x in [448.0, 460.0, 464.0, 1e6, f32::INFINITY] {
            assert_eq!(from_f32(x), 0x7e, "{x}");
            assert_eq!(from_f32(-x), 0xfe, "-{x}");
        }
        assert_eq!(from_f32(2f32.powi(-11)), 0, "a quarter of the smallest subnormal rounds to zero");
        assert_eq!(from_f32(3.0 * 2f32.powi(-11)), 1);
        assert_eq!(from_f32(f32::NAN) & 0x7f, 0x7f);
    }

    #[test]
    fn relative_error_is_at_most_one_sixteenth_in_the_normal_range() {
        let mut x = 2f32.powi(-6);
        while x < E4M3_MAX {
            let r = to_f32(from_f32(x));
            assert!(((r - x) / x).abs() <= 1.0 / 16.0, "{x} -> {r}");
            x *= 1.0137;
        }
    }
}
