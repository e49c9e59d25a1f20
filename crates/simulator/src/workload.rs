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
    /// Every request the same lengths, as `vellum bench serve --input-len
    /// --output-len` sends them.
    Fixed {
        /// Prompt tokens.
        prompt_len: usize,
        /// Output tokens.
        output_len: usize,
    },
}

impl Workload {
    /// Target means (input, output) and the log-space spread of both.
    /// The spreads are fixed a priori (long-tailed, as the paper's Fig. 11
    /// histograms), not fitted to any result.
    fn shape(self) -> (f64, f64, f64) {
        match self {
            Workload::ShareGpt => (161.0, 338.0, 1.0),
            Workload::Alpaca => (19.0, 58.0, 0.6),
            Workload::Fixed { prompt_len, output_len } => (prompt_len as f64, output_len as f64, 0.0),
        }
    }

    /// Parses `sharegpt`, `alpaca` or `fixed:IN:OUT` (IN, OUT ≥ 1).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "sharegpt" => Some(Workload::ShareGpt),
            "alpaca" => Some(Workload::Alpaca),
            _ => {
                let (prompt, output) = s.strip_prefix("fixed:")?.split_once(':')?;
                let (prompt_len, output_len) = (prompt.parse().ok()?, output.parse().ok()?);
                (prompt_len >= 1 && output_len >= 1).then_some(Workload::Fixed { prompt_len, output_len })
            }
        }
    }

    /// One request's (prompt, output) lengths, kept to `prompt + output ≤
    /// max_model_len` (a request over the limit is drawn again; a fixed
    /// workload over it is cut to fit).
    fn draw(self, rng: &mut Rng, max_model_len: usize) -> (usize, usize) {
        if let Workload::Fixed { prompt_len, output_len } = self {
            let prompt_len = prompt_len.min(max_model_len.saturating_sub(1)).max(1);
            return (prompt_len, output_len.min(max_model_len.saturating_sub(prompt_len)).max(1));
        }
        let (mean_in, mean_out, sigma) = self.shape();
        loop {
            let p = rng.lognormal_with_mean(mean_in, sigma).round().max(1.0) as usize;
            let o = rng.lognormal_with_mean(mean_out, sigma).round().max(1.0) as usize;
            if p + o <= max_model_len {
                return (p, o);
            }
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
    let mut rng = Rng::new(seed);
    let mut t = 0.0;
    let mut trace = Vec::new();
    loop {
        t += rng.exponential(rate);
        if t > duration_s {
            return trace;
        }
        let (prompt_len, output_len) = workload.draw(&mut rng, max_model_len);
        trace.push(TraceRequest { arrival_s: t, prompt_len, output_len });
    }
}

/// `count` requests for closed-loop clients (`vellum bench serve
/// --max-concurrency`): their lengths, each arriving when a client is free
/// (`arrival_s` 0 here; the simulation sets it).
pub fn generate_requests(workload: Workload, count: usize, max_model_len: usize, seed: u64) -> Vec<TraceRequest> {
    let mut rng = Rng::new(seed);
    (0..count)
        .map(|_| {
            let (prompt_len, output_len) = workload.draw(&mut rng, max_model_len);
            TraceRequest { arrival_s: 0.0, prompt_len, output_len }
        })
        .collect()
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

    #[test]
    fn a_fixed_workload_sends_the_same_lengths() {
        assert_eq!(Workload::parse("fixed:128:64"), Some(Workload::Fixed { prompt_len: 128, output_len: 64 }));
        for bad in ["fixed:0:4", "fixed:4", "fixed:a:4", "fixed"] {
            assert_eq!(Workload::parse(bad), None, "{bad}");
        }
        let r = generate_requests(Workload::Fixed { prompt_len: 128, output_len: 64 }, 5, 2048, 3);
        assert!(r.len() == 5 && r.iter().all(|x| (x.prompt_len, x.output_len) == (128, 64)), "{r:?}");
        // Cut to fit the model's length.
        let r = generate_requests(Workload::Fixed { prompt_len: 100, output_len: 100 }, 1, 150, 3);
        assert_eq!((r[0].prompt_len, r[0].output_len), (100, 50));
    }
}
