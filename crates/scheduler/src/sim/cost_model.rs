//! Step time of the fake executor.

use serde::Serialize;

/// `step_time = fixed + per_token · batched tokens + per_context_token · Σ context`.
///
/// The default resembles OPT-13B in fp16 on one A100 (the paper's Table 1
/// setup): reading the 26 GB of weights once per step at ~1.5 TB/s costs
/// ~17 ms; each batched token costs 2 · 13e9 FLOPs at ~150 TFLOP/s
/// effective, ~0.17 ms; attention reads ~0.8 MB of KV per context token
/// (2 · 40 layers · 5120 · 2 bytes), ~0.55 µs at 1.5 TB/s.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CostModel {
    /// Seconds per step regardless of its size.
    pub fixed_s: f64,
    /// Seconds per token computed in the step.
    pub per_token_s: f64,
    /// Seconds per token of context read by attention.
    pub per_context_token_s: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self { fixed_s: 0.017, per_token_s: 0.000_17, per_context_token_s: 0.000_000_55 }
    }
}

impl CostModel {
    /// Time of a step computing `num_tokens` tokens over `num_context_tokens`.
    pub fn step_time(&self, num_tokens: usize, num_context_tokens: usize) -> f64 {
        self.fixed_s + self.per_token_s * num_tokens as f64 + self.per_context_token_s * num_context_tokens as f64
    }
}
