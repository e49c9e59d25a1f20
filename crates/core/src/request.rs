//! A request in the unified representation (thesis §4.4).
//!
//! ```text
//!   token_ids:  [ p0 p1 p2 p3 p4 p5 | o0 o1 | d0 d1 ]
//!                 prompt              output  drafts (speculative, unverified)
//!               |<-------- num_computed_tokens -->|
//!               |<-------------- num_total_tokens ------------------>|
//! ```
//!
//! Every scheduling behaviour of Table 4.1 is one of the methods below, and
//! each of them only moves `num_computed_tokens` and/or `num_total_tokens`:
//!
//! | Table 4.1 row          | method                                  |
//! |------------------------|-----------------------------------------|
//! | Prefill                | [`RequestState::advance`] with Δ = L_prompt |
//! | Decode                 | [`RequestState::advance`] with Δ = 1    |
//! | Chunked prefill        | [`RequestState::advance`] with Δ < L_prompt |
//! | Preemption             | [`RequestState::preempt`]               |
//! | Streaming prefill      | [`RequestState::extend_prompt`]         |
//! | Prefix caching         | [`RequestState::apply_prefix_hit`]      |
//! | Prefill disaggregation | [`RequestState::apply_remote_prefill`]  |
//! | Speculative decoding   | [`RequestState::add_draft_tokens`] then [`RequestState::apply_speculative_result`] |

use crate::{Error, Result, TokenId};

/// Token ids and the two counters of one sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestState {
    token_ids: Vec<TokenId>,
    num_prompt_tokens: usize,
    num_computed_tokens: usize,
    /// Trailing entries of `token_ids` that are speculative drafts.
    num_draft_tokens: usize,
}

impl RequestState {
    /// A new request: `num_computed_tokens = 0`, `num_total_tokens = L_prompt`.
    pub fn new(prompt_token_ids: Vec<TokenId>) -> Self {
        let num_prompt_tokens = prompt_token_ids.len();
        Self { token_ids: prompt_token_ids, num_prompt_tokens, num_computed_tokens: 0, num_draft_tokens: 0 }
    }

    /// Tokens whose KV has been computed and stored.
    pub fn num_computed_tokens(&self) -> usize {
        self.num_computed_tokens
    }

    /// Prompt plus output tokens (plus drafts under speculative decoding).
    pub fn num_total_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// `num_total_tokens - num_computed_tokens`: the most Δ a step may take.
    pub fn num_remaining_tokens(&self) -> usize {
        self.token_ids.len() - self.num_computed_tokens
    }

    /// Length of the prompt.
    pub fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    /// Number of generated (accepted) tokens.
    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens - self.num_draft_tokens
    }

    /// Number of unverified draft tokens at the end of the sequence.
    pub fn num_draft_tokens(&self) -> usize {
        self.num_draft_tokens
    }

    /// All token ids: prompt, output, drafts.
    pub fn token_ids(&self) -> &[TokenId] {
        &self.token_ids
    }

    /// The prompt's token ids.
    pub fn prompt_token_ids(&self) -> &[TokenId] {
        &self.token_ids[..self.num_prompt_tokens]
    }

    /// The generated (accepted) token ids.
    pub fn output_token_ids(&self) -> &[TokenId] {
        &self.token_ids[self.num_prompt_tokens..self.token_ids.len() - self.num_draft_tokens]
    }

    /// True while part of the prompt is still uncomputed.
    pub fn is_prefilling(&self) -> bool {
        self.num_computed_tokens < self.num_prompt_tokens
    }

    /// Prefill, chunked prefill and decode: the step computed Δ more tokens.
    ///
    /// Requires `0 < Δ ≤ num_total_tokens - num_computed_tokens`.
    pub fn advance(&mut self, delta: usize) -> Result<()> {
        if delta == 0 || delta > self.num_remaining_tokens() {
            return Err(Error::InvalidTransition(format!(
                "advance by {delta} with {} of {} tokens computed (Δ must be in 1..={})",
                self.num_computed_tokens,
                self.token_ids.len(),
                self.num_remaining_tokens()
            )));
        }
        self.num_computed_tokens += delta;
        Ok(())
    }

    /// A token was sampled: `num_total_tokens += 1`.
    ///
    /// Only legal once every token is computed (the sampled token is the
    /// model's answer to the whole sequence) and with no pending drafts.
    pub fn append_output_token(&mut self, token: TokenId) -> Result<()> {
        if self.num_computed_tokens != self.token_ids.len() || self.num_draft_tokens != 0 {
            return Err(Error::InvalidTransition(format!(
                "append output token with {} of {} tokens computed and {} drafts",
                self.num_computed_tokens,
                self.token_ids.len(),
                self.num_draft_tokens
            )));
        }
        self.token_ids.push(token);
        Ok(())
    }

    /// Preemption by recompute: `num_computed_tokens ← 0`. Prompt and output
    /// are kept; the next prefill recomputes all of them in one pass.
    /// Pending drafts are dropped (they were never verified).
    pub fn preempt(&mut self) {
        self.token_ids.truncate(self.token_ids.len() - self.num_draft_tokens);
        self.num_draft_tokens = 0;
        self.num_computed_tokens = 0;
    }

    /// Prefix caching: `num_computed_tokens ← L_cached`.
    ///
    /// Only for a request with nothing computed, and never the whole sequence:
    /// the last token must be computed to yield logits.
    pub fn apply_prefix_hit(&mut self, num_cached_tokens: usize) -> Result<()> {
        if self.num_computed_tokens != 0 || num_cached_tokens >= self.token_ids.len() {
            return Err(Error::InvalidTransition(format!(
                "prefix hit of {num_cached_tokens} tokens on a request with {} of {} computed",
                self.num_computed_tokens,
                self.token_ids.len()
            )));
        }
        self.num_computed_tokens = num_cached_tokens;
        Ok(())
    }

    /// Streaming prefill: more prompt arrives, `num_total_tokens += L_new`.
    /// Only before the first output token.
    pub fn extend_prompt(&mut self, new_tokens: &[TokenId]) -> Result<()> {
        if self.token_ids.len() != self.num_prompt_tokens {
            return Err(Error::InvalidTransition("extend_prompt after output tokens or drafts exist".to_string()));
        }
        self.token_ids.extend_from_slice(new_tokens);
        self.num_prompt_tokens += new_tokens.len();
        Ok(())
    }

    /// Prefill disaggregation: another instance computed the prompt and sent
    /// its KV and first token: `num_computed_tokens ← L_prompt`,
    /// `num_total_tokens ← L_prompt + 1`.
    pub fn apply_remote_prefill(&mut self, first_token: TokenId) -> Result<()> {
        if self.token_ids.len() != self.num_prompt_tokens || self.num_computed_tokens != 0 {
            return Err(Error::InvalidTransition("remote prefill on a request that already progressed".to_string()));
        }
        self.num_computed_tokens = self.num_prompt_tokens;
        self.token_ids.push(first_token);
        Ok(())
    }

    /// Speculative decoding, part 1: a drafter proposes `L_draft` tokens,
    /// `num_total_tokens += L_draft`. The next step schedules
    /// Δ = 1 + L_draft to verify them.
    pub fn add_draft_tokens(&mut self, drafts: &[TokenId]) -> Result<()> {
        if self.num_draft_tokens != 0 || self.num_remaining_tokens() != 1 {
            return Err(Error::InvalidTransition(format!(
                "add drafts with {} drafts pending and {} tokens remaining (need 0 and 1)",
                self.num_draft_tokens,
                self.num_remaining_tokens()
            )));
        }
        self.token_ids.extend_from_slice(drafts);
        self.num_draft_tokens = drafts.len();
        Ok(())
    }

    /// Speculative decoding: the drafts are withdrawn unverified (the step
    /// had no budget for them): `num_total_tokens -= L_draft`.
    pub fn drop_draft_tokens(&mut self) {
        self.token_ids.truncate(self.token_ids.len() - self.num_draft_tokens);
        self.num_draft_tokens = 0;
    }

    /// The tokens that are known for sure: prompt and output, drafts left out.
    pub fn verified_token_ids(&self) -> &[TokenId] {
        &self.token_ids[..self.token_ids.len() - self.num_draft_tokens]
    }

    /// Speculative decoding, part 2: the verification step computed Δ tokens
    /// and rejected the last `L_rejected` drafts; the target model's own next
    /// token `bonus` is appended:
    /// `num_computed_tokens += Δ - L_rejected`,
    /// `num_total_tokens += L_draft - L_rejected + 1` (counted from before
    /// the drafts were added).
    pub fn apply_speculative_result(&mut self, delta: usize, num_rejected: usize, bonus: TokenId) -> Result<()> {
        if num_rejected > self.num_draft_tokens || delta != self.num_remaining_tokens() {
            return Err(Error::InvalidTransition(format!(
                "speculative result Δ={delta}, rejected={num_rejected} with {} drafts and {} remaining",
                self.num_draft_tokens,
                self.num_remaining_tokens()
            )));
        }
        self.num_computed_tokens += delta - num_rejected;
        self.token_ids.truncate(self.token_ids.len() - num_rejected);
        self.num_draft_tokens = 0;
        self.token_ids.push(bonus);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(n: usize) -> RequestState {
        RequestState::new((0..n as u32).collect())
    }

    #[test]
    fn prefill_is_one_bulk_step() {
        let mut r = req(6);
        assert_eq!((r.num_computed_tokens(), r.num_total_tokens()), (0, 6));
        r.advance(6).unwrap();
        r.append_output_token(42).unwrap();
        assert_eq!((r.num_computed_tokens(), r.num_total_tokens()), (6, 7));
        assert_eq!(r.output_token_ids(), &[42]);
    }

    #[test]
    fn decode_is_delta_one() {
        let mut r = req(3);
        r.advance(3).unwrap();
        r.append_output_token(7).unwrap();
        assert_eq!(r.num_remaining_tokens(), 1);
        r.advance(1).unwrap();
        r.append_output_token(8).unwrap();
        assert_eq!((r.num_computed_tokens(), r.num_total_tokens()), (4, 5));
        assert!(r.advance(2).is_err(), "decode can take at most the one remaining token");
    }

    #[test]
    fn chunked_prefill_is_delta_below_prompt_length() {
        let mut r = req(10);
        r.advance(4).unwrap();
        assert!(r.is_prefilling());
        assert!(r.append_output_token(1).is_err(), "no sample before the prompt is done");
        r.advance(4).unwrap();
        r.advance(2).unwrap();
        assert!(!r.is_prefilling());
        r.append_output_token(1).unwrap();
        assert_eq!(r.num_total_tokens(), 11);
    }

    #[test]
    fn preemption_resets_computed_and_keeps_tokens() {
        let mut r = req(5);
        r.advance(5).unwrap();
        r.append_output_token(9).unwrap();
        r.advance(1).unwrap();
        r.append_output_token(10).unwrap();
        r.preempt();
        assert_eq!((r.num_computed_tokens(), r.num_total_tokens()), (0, 7));
        // Recompute prompt and outputs in one pass.
        r.advance(7).unwrap();
        assert_eq!(r.output_token_ids(), &[9, 10]);
    }

    #[test]
    fn streaming_prefill_grows_total() {
        let mut r = req(4);
        r.advance(4).unwrap();
        r.extend_prompt(&[100, 101]).unwrap();
        assert_eq!((r.num_computed_tokens(), r.num_total_tokens()), (4, 6));
        assert_eq!(r.num_prompt_tokens(), 6);
        r.advance(2).unwrap();
        r.append_output_token(5).unwrap();
        assert!(r.extend_prompt(&[1]).is_err());
    }

    #[test]
    fn prefix_hit_sets_computed_but_never_everything() {
        let mut r = req(40);
        r.apply_prefix_hit(32).unwrap();
        assert_eq!((r.num_computed_tokens(), r.num_total_tokens()), (32, 40));
        let mut full = req(32);
        assert!(full.apply_prefix_hit(32).is_err(), "last token must be computed");
    }

    #[test]
    fn remote_prefill_jumps_to_first_token() {
        let mut r = req(8);
        r.apply_remote_prefill(77).unwrap();
        assert_eq!((r.num_computed_tokens(), r.num_total_tokens()), (8, 9));
        assert_eq!(r.output_token_ids(), &[77]);
    }

    #[test]
    fn speculative_decoding_counts_rejections() {
        let mut r = req(5);
        r.advance(5).unwrap();
        r.append_output_token(1).unwrap(); // computed 5, total 6
        let drafts = [2, 3, 4];
        r.add_draft_tokens(&drafts).unwrap(); // total 9
        let delta = r.num_remaining_tokens();
        assert_eq!(delta, 1 + drafts.len());
        r.advance(0).unwrap_err();
        // Verification rejects the last draft; the target model says 9.
        r.apply_speculative_result(delta, 1, 9).unwrap();
        // computed: 5 + 4 - 1 = 8; total: 6 + 3 - 1 + 1 = 9.
        assert_eq!((r.num_computed_tokens(), r.num_total_tokens()), (8, 9));
        assert_eq!(r.output_token_ids(), &[1, 2, 3, 9]);
        assert_eq!(r.num_remaining_tokens(), 1);
    }

    #[test]
    fn dropped_drafts_leave_a_plain_decode() {
        let mut r = req(3);
        r.advance(3).unwrap();
        r.append_output_token(1).unwrap();
        r.add_draft_tokens(&[5, 6]).unwrap();
        assert_eq!(r.verified_token_ids(), &[0, 1, 2, 1]);
        r.drop_draft_tokens();
        assert_eq!((r.num_computed_tokens(), r.num_total_tokens(), r.num_draft_tokens()), (3, 4, 0));
        r.advance(1).unwrap();
        r.append_output_token(2).unwrap();
    }

    #[test]
    fn preempt_drops_pending_drafts() {
        let mut r = req(2);
        r.advance(2).unwrap();
        r.append_output_token(1).unwrap();
        r.add_draft_tokens(&[5, 6]).unwrap();
        r.preempt();
        assert_eq!(r.token_ids(), &[0, 1, 1]);
        assert_eq!(r.num_draft_tokens(), 0);
    }
}
