//! Fitting the cost model to the paper's measured system.
//!
//! The paper reports (§6.2, Fig. 13a) that serving OPT-13B on the ShareGPT
//! trace at 2 req/s, vLLM batches 2.2× as many requests as Orca (Oracle) and
//! 4.3× as many as Orca (Max). At that rate Orca (Oracle) is memory-bound —
//! its batch is capped by reservations — while the paged manager batches
//! what arrives, a number that grows with how long each request runs, i.e.
//! with the system's step time (Little's law). The ratio therefore pins the
//! measured system's speed: [`calibrate`] finds the factor on the
//! first-principles [`CostModel`] for which the simulated ratio is the
//! paper's, by bisection on a log scale (the ratio grows with the factor
//! until the paged manager too is memory-bound).

use crate::cost_model::CostModel;
use crate::simulator::{simulate, AllocatorKind, SimConfig};
use crate::workload::Workload;
use serde::Serialize;

/// vLLM over Orca (Oracle) batched requests, ShareGPT at 2 req/s (paper §6.2).
pub const PAPER_FIG13A_RATIO_VS_ORACLE: f64 = 2.2;
/// vLLM over Orca (Max), same setting.
pub const PAPER_FIG13A_RATIO_VS_MAX: f64 = 4.3;

/// The outcome of a fit.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    /// The fitted factor on [`CostModel::first_principles`].
    pub time_scale: f64,
    /// The fitted model.
    pub cost_model: CostModel,
    /// Paged and Orca (Oracle) batched requests at the fitted scale.
    pub paged_batched: f64,
    /// Orca (Oracle)'s.
    pub oracle_batched: f64,
    /// Orca (Max)'s (a check: not fitted).
    pub max_batched: f64,
    /// Simulations run.
    pub simulations: usize,
}

impl Calibration {
    /// Paged over Orca (Oracle) batched requests.
    pub fn ratio_vs_oracle(&self) -> f64 {
        self.paged_batched / self.oracle_batched.max(f64::MIN_POSITIVE)
    }

    /// Paged over Orca (Max) batched requests.
    pub fn ratio_vs_max(&self) -> f64 {
        self.paged_batched / self.max_batched.max(f64::MIN_POSITIVE)
    }
}

/// Batched requests of `allocator` on the Fig. 13a setting of `base` with
/// the first-principles model scaled by `scale`.
fn batched(base: &SimConfig, allocator: AllocatorKind, scale: f64) -> f64 {
    let config = SimConfig {
        workload: Workload::ShareGpt,
        request_rate: 2.0,
        allocator,
        n: 1,
        beam_width: 0,
        cost_model: CostModel::first_principles().scaled(scale),
        ..base.clone()
    };
    simulate(&config).avg_batched_requests
}

/// Fits the time scale so that paged / Orca (Oracle) batched requests on
/// the ShareGPT-like trace at 2 req/s equals `target` (the paper's 2.2),
/// with `base`'s duration, seed and KV capacity.
pub fn calibrate(base: &SimConfig, target: f64) -> Calibration {
    let ratio =
        |scale: f64| batched(base, AllocatorKind::Paged, scale) / batched(base, AllocatorKind::OrcaOracle, scale).max(f64::MIN_POSITIVE);
    let (mut lo, mut hi) = (0.25f64, 8.0f64);
    let mut simulations = 0;
    for _ in 0..12 {
        let mid = (lo * hi).sqrt();
        simulations += 2;
        if ratio(mid) < target {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    // Two decimals: the fit is only as good as the paper's "2.2×".
    let scale = ((lo * hi).sqrt() * 100.0).round() / 100.0;
    Calibration {
        time_scale: scale,
        cost_model: CostModel::first_principles().scaled(scale),
        paged_batched: batched(base, AllocatorKind::Paged, scale),
        oracle_batched: batched(base, AllocatorKind::OrcaOracle, scale),
        max_batched: batched(base, AllocatorKind::OrcaMax, scale),
        simulations: simulations + 3,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost_model::FITTED_TIME_SCALE;

    #[test]
    fn the_default_cost_model_reproduces_fig_13a() {
        // The committed constant is what the fit gives (600 s, seed 0).
        let base = SimConfig::default();
        let got = batched(&base, AllocatorKind::Paged, FITTED_TIME_SCALE) / batched(&base, AllocatorKind::OrcaOracle, FITTED_TIME_SCALE);
        assert!((got - PAPER_FIG13A_RATIO_VS_ORACLE).abs() < 0.2, "paged / Oracle = {got:.2}, paper {PAPER_FIG13A_RATIO_VS_ORACLE}");
        // The first-principles model is too fast: the paged manager is not
        // yet memory-bound there, and the ratio falls short.
        let fast = batched(&base, AllocatorKind::Paged, 1.0) / batched(&base, AllocatorKind::OrcaOracle, 1.0);
        assert!(fast < 1.5, "first principles: {fast:.2}");
    }
}
