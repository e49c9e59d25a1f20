//! Elementary functions in f32 written to vectorize, shared by the
//! samplers (a pass of `exp` over a 262,144-token vocabulary per row), the
//! CPU backend's attention softmax and its GELU activation.

/// `exp(x)` in f32, within 2 ulp for `x ∈ [−80, 88]`; 0 below −87 (also
/// for −∞), +∞ above 88, NaN for NaN. Cody–Waite reduction `x = n·ln 2 + r`,
/// `|r| ≤ ln 2 / 2`, then Cephes' degree-5 polynomial for `eʳ − 1 − r`;
/// `2ⁿ` is built in the exponent bits. Branch-free, so it vectorizes.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2²³: adding it rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 88.0);
    let shifted = xc * LOG2E + ROUND;
    let n = shifted - ROUND;
    let ni = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    let scale = f32::from_bits(((ni + 127) << 23) as u32);
    let y = er * scale;
    if x < -87.0 {
        0.0
    } else if x > 88.0 {
        f32::INFINITY
    } else {
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_polynomial_exp_is_within_two_ulp_of_f64() {
        let mut worst = 0f64;
        // Below −80 the results near the smallest normal lose bits to subnormal rounding.
        let mut x = -80.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            let ulp = (want as f32).abs() as f64 * f32::EPSILON as f64;
            worst = worst.max((got - want).abs() / ulp);
            x += 0.001_37;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert!((exp_f32(-86.5) as f64 - (-86.5f64).exp()).abs() < 1e-40);
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(-88.0), 0.0);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
    }
}
