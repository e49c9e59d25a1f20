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
            preemption_mode: PreemptionMode::Recompute,
        }
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
