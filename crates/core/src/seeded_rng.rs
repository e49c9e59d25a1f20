//! A small seeded random generator (SplitMix64), with no dependency: the
//! sampler's per-request generator (same seed, same text, whatever else is in
//! the batch) and the simulator's reproducible traces.

/// Seeded pseudo-random numbers.
#[derive(Clone, Debug)]
pub struct SeededRng(u64);

impl SeededRng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x853c_49e6_748f_ea9b)
    }

    /// 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize % n.max(1)
    }

    /// Uniform in [-1, 1), as f32 (test data, random weights).
    pub fn signed_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` values of [`SeededRng::signed_f32`].
    pub fn signed_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.signed_f32()).collect()
    }

    /// Shuffles `xs` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            xs.swap(i, self.below(i + 1));
        }
    }

    /// Exponential with the given rate (Poisson inter-arrival times).
    pub fn exponential(&mut self, rate: f64) -> f64 {
        -(1.0 - self.uniform()).ln() / rate
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Log-normal with the given mean and log-space standard deviation.
    pub fn lognormal_with_mean(&mut self, mean: f64, sigma: f64) -> f64 {
        let mu = mean.ln() - sigma * sigma / 2.0;
        (mu + sigma * self.normal()).exp()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments_are_right() {
        let mut r = SeededRng::new(7);
        let n = 200_000;
        let mean_exp: f64 = (0..n).map(|_| r.exponential(4.0)).sum::<f64>() / n as f64;
        assert!((mean_exp - 0.25).abs() < 0.005, "{mean_exp}");
        let mean_ln: f64 = (0..n).map(|_| r.lognormal_with_mean(161.0, 1.0)).sum::<f64>() / n as f64;
        assert!((mean_ln - 161.0).abs() < 3.0, "{mean_ln}");
        assert_eq!(SeededRng::new(1).next_u64(), SeededRng::new(1).next_u64(), "seeded");
    }
}
