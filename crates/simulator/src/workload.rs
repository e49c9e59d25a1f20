//! Synthetic request traces shaped like the paper's datasets (§6.1, Fig. 11).

use serde::Serialize;
use vellum_base::SeededRng as Rng;

/// Which dataset the lengths imitate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// ShareGPT: long conversations; mean input ≈ 161, output ≈ 338 tokens.
    ShareGpt,
    /// Alpaca: short instructions; mean input ≈ 19, output ≈ 58 tokens.
    Alpaca,
}

impl Workload {
    /// Target means (input, output) and the log-space spread of both.
    /// The spreads are fixed a priori (long-tailed, as the paper's Fig. 11
    /// histograms), not fitted to any result.
    fn shape(self) -> (f64, f64, f64) {
        match self {
            Workload::ShareGpt => (161.0, 338.0, 1.0),
            Workload::Alpaca => (19.0, 58.0, 0.6),
        }
    }

    /// Parses `sharegpt` or `alpaca`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "sharegpt" => Some(Workload::ShareGpt),
            "alpaca" => Some(Workload::Alpaca),
            _ => None,
        }
    }
}

/// One request of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TraceRequest {
    /// Arrival time in seconds.
    pub arrival_s: f64,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Tokens the request will generate.
    pub output_len: usize,
}

/// Poisson arrivals at `rate` per second for `duration_s`; lengths drawn
/// log-normal around the workload's means and, as the paper filters its
/// datasets, kept to `prompt + output ≤ max_model_len` (a request over the
/// limit is drawn again).
pub fn generate_trace(workload: Workload, rate: f64, duration_s: f64, max_model_len: usize, seed: u64) -> Vec<TraceRequest> {
    let (mean_in, mean_out, sigma) = workload.shape();
    let mut rng = Rng::new(seed);
    let mut t = 0.0;
    let mut trace = Vec::new();
    loop {
        t += rng.exponential(rate);
        if t > duration_s {
            return trace;
        }
        let (prompt_len, output_len) = loop {
            let p = rng.lognormal_with_mean(mean_in, sigma).round().max(1.0) as usize;
            let o = rng.lognormal_with_mean(mean_out, sigma).round().max(1.0) as usize;
            if p + o <= max_model_len {
                break (p, o);
            }
        };
        trace.push(TraceRequest { arrival_s: t, prompt_len, output_len });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn means_and_rate_are_close_to_the_targets() {
        let tr = generate_trace(Workload::ShareGpt, 10.0, 2000.0, 2048, 1);
        let n = tr.len() as f64;
        assert!((n / 2000.0 - 10.0).abs() < 0.3, "rate {}", n / 2000.0);
        let mi = tr.iter().map(|r| r.prompt_len).sum::<usize>() as f64 / n;
        let mo = tr.iter().map(|r| r.output_len).sum::<usize>() as f64 / n;
        // The 2048 filter trims the far tail a little.
        assert!((140.0..175.0).contains(&mi) && (300.0..350.0).contains(&mo), "{mi} {mo}");
        let a = generate_trace(Workload::Alpaca, 10.0, 2000.0, 2048, 1);
        let mi = a.iter().map(|r| r.prompt_len).sum::<usize>() as f64 / a.len() as f64;
        assert!((17.0..21.0).contains(&mi), "{mi}");
        assert_eq!(tr, generate_trace(Workload::ShareGpt, 10.0, 2000.0, 2048, 1), "seeded");
    }
}
