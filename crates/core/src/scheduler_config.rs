//! Configuration of the scheduler.

use crate::{Error, Result};

/// Which request goes first when the token budget or memory is short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulingPolicy {
    /// First come, first served (thesis Algorithm 1).
    Fcfs,
    /// Thesis §4.5.3: a FIFO-filled staging queue of this size, and
    /// shortest-remaining-tokens-first over staging + running.
    TwoLevel {
        /// Requests moved from waiting to staging at once (default 8).
        staging_queue_size: usize,
    },
    /// Lower priority value first; FCFS among equal values.
    Priority,
}

/// What happens to a running sequence group when memory runs out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Free its blocks; recompute prompt and output later in one pass.
    Recompute,
    /// Move all its blocks to the host pool; bring them back later.
    Swap,
}

/// Budgets and policy of the scheduler.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Most sequences running in one step.
    pub max_num_seqs: usize,
    /// Token budget of one step.
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output) accepted.
    pub max_model_len: usize,
    /// Ordering policy.
    pub policy: SchedulingPolicy,
    /// Split long prompts across steps and mix them with decodes.
    pub enable_chunked_prefill: bool,
    /// Most tokens one prefill may take in a step (0 = only the budget).
    pub long_prefill_token_threshold: usize,
    /// Most tokens all prefills together (prompts, and recomputations after
    /// a preemption) may take in a step beside its decodes (0 = only the
    /// budget): Sarathi-Serve's prefill budget. A step lasts about its
    /// decodes plus its prompt chunk's compute, so this bounds how long a
    /// prompt stalls the decodes beside it whatever their number. A
    /// sequence with more than one token to compute besides its drafts is
    /// a prefill (a last chunk of one token runs as a decode would); a beam
    /// search recomputing its candidates together is held to the step's
    /// budget alone, as they must run whole. Speculative verifications are
    /// decodes here.
    pub max_num_prefill_tokens: usize,
    /// Recompute (default) or swap.
    pub preemption_mode: PreemptionMode,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 2048,
            policy: SchedulingPolicy::Fcfs,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            max_num_prefill_tokens: 0,
            preemption_mode: PreemptionMode::Recompute,
        }
    }
}

/// The fewest prefill tokens [`prefill_budget_for`] gives a step.
pub const MIN_AUTO_PREFILL_TOKENS: usize = 256;

/// A step's prefill budget ([`SchedulerConfig::max_num_prefill_tokens`])
/// from the compute its prompt tokens may take: the largest power of two,
/// at least [`MIN_AUTO_PREFILL_TOKENS`], whose `flops_per_token` stay
/// within `step_flops`; 0 (no budget of its own) where that reaches
/// `max_tokens`, the whole step's budget.
///
/// Why: a step that carries a prompt chunk lasts about its decodes plus the
/// chunk's compute, and the decodes wait for all of it. On a GPU a prompt
/// token costs `2 · parameters` FLOPs of tensor-core time, so a token
/// budget that suits a small model stretches a large model's steps: Llama
/// 3 8B at 2,048 tokens a step is ~29 TFLOP, ~50 ms of an H100, beside
/// ~13 ms decode steps (docs/benchmarks.md, "A prefill budget from the
/// model's size"). A budget in FLOPs keeps the stretch alike at every
/// model size.
pub fn prefill_budget_for(flops_per_token: f64, step_flops: f64, max_tokens: usize) -> usize {
    let mut tokens = MIN_AUTO_PREFILL_TOKENS;
    while tokens < max_tokens && (tokens * 2) as f64 * flops_per_token <= step_flops {
        tokens *= 2;
    }
    if tokens >= max_tokens {
        0
    } else {
        tokens
    }
}

impl SchedulerConfig {
    /// Checks that the budgets are positive and consistent.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, message: String| Err(Error::InvalidConfig { field, message });
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs", "must be at least 1".into());
        }
        if self.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens", "must be at least 1".into());
        }
        if self.max_model_len == 0 {
            return bad("max_model_len", "must be at least 1".into());
        }
        if !self.enable_chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            return bad(
                "max_num_batched_tokens",
                format!(
                    "without chunked prefill it must be at least max_model_len ({}), got {}",
                    self.max_model_len, self.max_num_batched_tokens
                ),
            );
        }
        // Without chunks a prompt above the cap could never be scheduled.
        if !self.enable_chunked_prefill && self.long_prefill_token_threshold > 0 && self.long_prefill_token_threshold < self.max_model_len {
            return bad(
                "long_prefill_token_threshold",
                format!(
                    "without chunked prefill it must be 0 or at least max_model_len ({}), got {}",
                    self.max_model_len, self.long_prefill_token_threshold
                ),
            );
        }
        if !self.enable_chunked_prefill && self.max_num_prefill_tokens > 0 && self.max_num_prefill_tokens < self.max_model_len {
            return bad(
                "max_num_prefill_tokens",
                format!(
                    "without chunked prefill it must be 0 or at least max_model_len ({}), got {}",
                    self.max_model_len, self.max_num_prefill_tokens
                ),
            );
        }
        if let SchedulingPolicy::TwoLevel { staging_queue_size: 0 } = self.policy {
            return bad("staging_queue_size", "must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_budgets_follow_the_flops_from_the_floor_up_to_the_step() {
        let step = 8e12;
        // Llama 3 8B's layers (7.0 G weights), Llama 3.2 3B's (2.8 G), 1B's
        // (0.97 G), SmolLM2-135M's (0.11 G), a 70B's (68.5 G).
        let budget = |params: f64| prefill_budget_for(2.0 * params, step, 2048);
        assert_eq!(budget(6.98e9), 512);
        assert_eq!(budget(2.82e9), 1024);
        assert_eq!(budget(0.97e9), 0, "the whole step may be prompt: no budget of its own");
        assert_eq!(budget(0.106e9), 0);
        assert_eq!(budget(68.5e9), MIN_AUTO_PREFILL_TOKENS, "the floor");
        assert_eq!(prefill_budget_for(1.0, step, 200), 0, "a step below the floor");
        let capped = SchedulerConfig {
            enable_chunked_prefill: false,
            max_num_prefill_tokens: 512,
            max_num_batched_tokens: 4096,
            max_model_len: 4096,
            ..Default::default()
        };
        assert!(capped.validate().is_err_and(|e| e.to_string().contains("max_num_prefill_tokens")), "a cap no prompt could pass");
    }

    #[test]
    fn validation() {
        SchedulerConfig::default().validate().unwrap();
        let t =
            SchedulerConfig { enable_chunked_prefill: false, long_prefill_token_threshold: 64, max_model_len: 512, ..Default::default() };
        assert!(t.validate().is_err_and(|e| e.to_string().contains("long_prefill_token_threshold")), "a cap no prompt could pass");
        let c = SchedulerConfig { enable_chunked_prefill: false, max_num_batched_tokens: 512, ..Default::default() };
        assert!(matches!(c.validate(), Err(Error::InvalidConfig { field: "max_num_batched_tokens", .. })));
        let c = SchedulerConfig { policy: SchedulingPolicy::TwoLevel { staging_queue_size: 0 }, ..Default::default() };
        assert!(c.validate().is_err());
    }
}
