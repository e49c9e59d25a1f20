//! Per-step input of a backend: plain host data, uploaded as is.
//!
//! For a batch of sequences `s = 0..S` with `q_s` new tokens each:
//!
//! ```text
//! token_ids / positions / slot_mapping:  [ s0: q0 tokens | s1: q1 tokens | ... ]
//! query_start_loc:                       [0, q0, q0+q1, ..., Σq]       (S + 1)
//! context_lens[s]:                       tokens in KV after the step (computed + new)
//! block_tables:                          S rows of `block_table_stride` entries,
//!                                        row s lists the physical blocks of s
//! slot = block_id * block_size + (position % block_size)
//! ```
//!
//! A model with several KV-cache groups (local and global layers, see
//! [`KvCacheGroups`](crate::KvCacheGroups)) has a slot mapping and a set of
//! block tables per group, stored group after group: `slot_mapping` is
//! `[G, tokens]`, `block_tables` is `[G, S, block_table_stride]`.

use crate::{BlockId, Error, HostBlockId, Result, TokenId};

/// Copy one block's K/V (every layer) onto another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockCopy {
    /// Source block.
    pub src: BlockId,
    /// Destination block.
    pub dst: BlockId,
}

/// A block moving between the device pool and the host pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockSwap {
    /// The block in the device pool.
    pub device: BlockId,
    /// The block in the host pool.
    pub host: HostBlockId,
}

/// Block movements of one step, applied in field order before the forward
/// pass: swap-outs, swap-ins, then copies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockOps {
    /// Device → host.
    pub swap_out: Vec<BlockSwap>,
    /// Host → device.
    pub swap_in: Vec<BlockSwap>,
    /// Device → device (copy-on-write).
    pub copies: Vec<BlockCopy>,
}

impl BlockOps {
    /// True when there is nothing to move.
    pub fn is_empty(&self) -> bool {
        self.swap_out.is_empty() && self.swap_in.is_empty() && self.copies.is_empty()
    }
}

/// Everything a backend needs to run one forward pass over a mixed batch of
/// prefill chunks and decodes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ForwardBatch {
    /// New tokens, sequence after sequence.
    pub token_ids: Vec<TokenId>,
    /// Position of each new token in its sequence.
    pub positions: Vec<u32>,
    /// KV slot each new token's K/V is written to, `[G, tokens]`.
    pub slot_mapping: Vec<u32>,
    /// Offsets of each sequence's tokens in `token_ids` (length S + 1).
    pub query_start_loc: Vec<u32>,
    /// Per sequence: tokens in the KV cache once this step wrote its own.
    pub context_lens: Vec<u32>,
    /// Row-major `[G, S, block_table_stride]` physical block ids (padding,
    /// and entries that slid out of a window: 0).
    pub block_tables: Vec<u32>,
    /// Entries per row of `block_tables`.
    pub block_table_stride: usize,
    /// KV-cache groups `G` (`0` reads as `1`).
    pub num_kv_groups: usize,
    /// Token rows whose logits are returned, in order.
    pub logits_indices: Vec<u32>,
    /// Block movements to apply first.
    pub block_ops: BlockOps,
    /// Every logits row is a greedy sample that needs its argmax alone
    /// ([`SamplingParams::argmax_suffices`](crate::SamplingParams::argmax_suffices)):
    /// the executor may return [`StepOutput::argmax`](crate::StepOutput::argmax)
    /// instead of the logits (a GPU then copies a token a row, not a row of
    /// the vocabulary).
    pub argmax_only: bool,
    /// The rows of `logits_indices` are pooling rows: the executor returns
    /// their final hidden states (after the model's last norm, before the
    /// LM head) in [`StepOutput::hidden_states`](crate::StepOutput::hidden_states)
    /// instead of logits. An engine serves either pooling or generation
    /// requests, so a batch holds one kind of row.
    pub hidden_states: bool,
    /// Empty, or one entry per logits row: the backend samples every row
    /// itself and returns [`StepOutput::samples`](crate::StepOutput::samples)
    /// (a token, and the logprobs asked for) instead of the logits, where
    /// it can ([`ModelExecutor::samples_on_device`](crate::ModelExecutor::samples_on_device)).
    pub sampling: Vec<RowSampling>,
    /// The penalty entries that the rows of `sampling` point into.
    pub penalties: Vec<PenaltyEntry>,
}

/// How the backend samples one logits row ([`ForwardBatch::sampling`]):
/// the request's parameters and the uniform number the host sampler would
/// draw next from the request's generator, so that the device draws the
/// token the host would.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RowSampling {
    /// 0: greedy (the largest score, the lowest id among equals).
    pub temperature: f32,
    /// Candidates kept by rank; 0 (or at least the vocabulary): no cut.
    pub top_k: u32,
    /// Nucleus cut (1: none).
    pub top_p: f32,
    /// Candidates below `min_p` times the top probability are dropped (0: none).
    pub min_p: f32,
    /// The draw, in [0, 1) (unused when greedy).
    pub uniform: f64,
    /// Top entries returned with their logprobs.
    pub num_logprobs: u32,
    /// Whether the sampled token's logprob is returned (else NaN).
    pub logprob: bool,
    /// This row's entries of [`ForwardBatch::penalties`]: `start..end`.
    pub penalties: (u32, u32),
}

/// One token's penalties on a row, applied in the host sampler's order:
/// the repetition penalty (a positive score divided by it, a negative one
/// multiplied), then `subtract` (frequency × count + presence), then the
/// logit bias. One entry per token of a row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PenaltyEntry {
    /// The token.
    pub token: TokenId,
    /// Repetition penalty (1: none).
    pub repetition: f32,
    /// Subtracted after it (0: none).
    pub subtract: f32,
    /// Added last (0: none).
    pub bias: f32,
}

impl PenaltyEntry {
    /// Score `x` of the entry's token after its penalties, each operation
    /// rounded on its own (as the device kernel does it).
    pub fn apply(&self, mut x: f32) -> f32 {
        if self.repetition != 1.0 {
            x = if x > 0.0 { x / self.repetition } else { x * self.repetition };
        }
        if self.subtract != 0.0 {
            x -= self.subtract;
        }
        if self.bias != 0.0 {
            x += self.bias;
        }
        x
    }
}

impl ForwardBatch {
    /// Number of sequences in the batch.
    pub fn num_seqs(&self) -> usize {
        self.query_start_loc.len().saturating_sub(1)
    }

    /// Number of new tokens in the batch.
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// KV-cache groups: sets of slot mappings and block tables.
    pub fn kv_groups(&self) -> usize {
        self.num_kv_groups.max(1)
    }

    /// A uniform decode step: one new token per sequence and every row's
    /// logits, in order; not a pooling step. The steps a GPU backend can
    /// replay as recorded graphs (its other conditions — batch size,
    /// context — aside), and the ones `/metrics` counts apart. A
    /// speculative verification (several tokens for a sequence) or a
    /// prompt chunk of more than one token is not one; a one-token prompt
    /// chunk is.
    pub fn is_uniform_decode(&self) -> bool {
        let t = self.num_tokens();
        t > 0
            && t == self.num_seqs()
            && !self.hidden_states
            && self.query_start_loc.iter().enumerate().all(|(i, &q)| q as usize == i)
            && self.logits_indices.len() == t
            && self.logits_indices.iter().enumerate().all(|(i, &r)| r as usize == i)
    }

    /// Checks the batch's shape once before a device backend uploads it
    /// (lengths agree, `query_start_loc` is an offset list, each sequence's
    /// blocks fit its table row) and returns the largest value of each kind
    /// of index, which the kernels that read through it check against their
    /// tables ([`StepBounds::check_below`]). A device kernel indexes without
    /// bounds checks, so these are what keep a bad batch from reading or
    /// writing outside a buffer.
    pub fn step_bounds(&self, block_size: usize) -> Result<StepBounds> {
        let (t, s, groups, stride) = (self.num_tokens(), self.num_seqs(), self.kv_groups(), self.block_table_stride);
        let bad = |what: String| Err(Error::Backend(format!("step: {what}")));
        if self.positions.len() != t || self.slot_mapping.len() != groups * t {
            return bad(format!(
                "{t} tokens of {groups} KV groups but {} positions and {} slots",
                self.positions.len(),
                self.slot_mapping.len()
            ));
        }
        if self.context_lens.len() != s || self.block_tables.len() < groups * s * stride {
            return bad("context lengths or block tables do not match the sequences".into());
        }
        let offsets = self.query_start_loc.first().is_none_or(|&q| q == 0)
            && self.query_start_loc.windows(2).all(|w| w[0] <= w[1])
            && self.query_start_loc.last().map_or(0, |&e| e as usize) == t;
        if !offsets {
            return bad("query_start_loc is not an offset list from 0 to the token count".into());
        }
        if let Some(&r) = self.logits_indices.iter().find(|&&r| r as usize >= t) {
            return bad(format!("logits row {r} of {t} tokens"));
        }
        let mut token_seq = Vec::with_capacity(t);
        let mut max_block = None::<u32>;
        for i in 0..s {
            let queries = self.query_start_loc[i + 1] - self.query_start_loc[i];
            let ctx = self.context_lens[i] as usize;
            let blocks = ctx.div_ceil(block_size.max(1));
            if queries as usize > ctx || blocks > stride {
                return bad(format!("sequence {i} has {queries} queries, a context of {ctx} and {stride} table entries"));
            }
            token_seq.extend(std::iter::repeat_n(i as u32, queries as usize));
            for g in 0..groups {
                let start = (g * s + i) * stride;
                max_block = max_block.max(self.block_tables[start..start + blocks].iter().copied().max());
            }
        }
        Ok(StepBounds {
            token_seq,
            max_id: self.token_ids.iter().copied().max(),
            max_position: self.positions.iter().copied().max(),
            max_logits_row: self.logits_indices.iter().copied().max(),
            max_slot: self.slot_mapping.iter().copied().max(),
            max_block,
        })
    }
}

/// What [`ForwardBatch::step_bounds`] found: each token's sequence, and the
/// largest index of each kind (`None` when there is none).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepBounds {
    /// Per token: the sequence it belongs to.
    pub token_seq: Vec<u32>,
    /// Largest token id (checked against the vocabulary).
    pub max_id: Option<u32>,
    /// Largest position (checked against the RoPE table).
    pub max_position: Option<u32>,
    /// Largest logits row (checked against the step's tokens).
    pub max_logits_row: Option<u32>,
    /// Largest KV slot (checked against the pool's slots).
    pub max_slot: Option<u32>,
    /// Largest block a sequence reads (checked against the pool's blocks).
    pub max_block: Option<u32>,
}

impl StepBounds {
    /// `Ok` when `max` (one of this struct's fields) is below `limit`:
    /// `what` names the index and `table` what it indexes, for the error.
    pub fn check_below(max: Option<u32>, limit: usize, what: &str, table: &str) -> Result<()> {
        match max {
            Some(m) if m as usize >= limit => Err(Error::Backend(format!("{what} {m} outside {table} of {limit}"))),
            _ => Ok(()),
        }
    }

    /// Every block of `copies` is below `num_blocks`: the check each
    /// backend makes before its `copy_blocks` touches a pool.
    pub fn check_copies(copies: &[BlockCopy], num_blocks: usize) -> Result<()> {
        match copies.iter().find(|c| c.src.index() >= num_blocks || c.dst.index() >= num_blocks) {
            Some(c) => Err(Error::Backend(format!("copy_blocks: {} -> {} outside the pool of {num_blocks} blocks", c.src, c.dst))),
            None => Ok(()),
        }
    }

    /// Every block of `swaps` is inside its pool (device or host): the
    /// check each backend makes before its `swap_blocks`.
    pub fn check_swaps(swaps: &[BlockSwap], num_blocks: usize, num_host_blocks: usize) -> Result<()> {
        match swaps.iter().find(|s| s.device.index() >= num_blocks || s.host.index() >= num_host_blocks) {
            Some(s) => Err(Error::Backend(format!(
                "swap_blocks: {s:?} outside the pools ({num_blocks} device blocks, {num_host_blocks} host blocks)"
            ))),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two sequences (2 tokens, then 1) over blocks of 4, one KV group.
    fn batch() -> ForwardBatch {
        ForwardBatch {
            token_ids: vec![5, 9, 7],
            positions: vec![0, 1, 4],
            slot_mapping: vec![12, 13, 20],
            query_start_loc: vec![0, 2, 3],
            context_lens: vec![2, 5],
            block_tables: vec![3, 0, 4, 6],
            block_table_stride: 2,
            num_kv_groups: 1,
            logits_indices: vec![1, 2],
            block_ops: BlockOps::default(),
            argmax_only: false,
            hidden_states: false,
            ..ForwardBatch::default()
        }
    }

    #[test]
    fn a_uniform_decode_is_one_token_and_one_logits_row_per_sequence() {
        let decode = ForwardBatch {
            token_ids: vec![5, 9],
            positions: vec![3, 7],
            query_start_loc: vec![0, 1, 2],
            context_lens: vec![4, 8],
            logits_indices: vec![0, 1],
            ..ForwardBatch::default()
        };
        assert!(decode.is_uniform_decode());
        // Two tokens and two logits rows for one sequence (a verification
        // of a draft, or prompt logprobs): as many rows as tokens, not one a
        // sequence.
        let verify =
            ForwardBatch { token_ids: vec![5, 9, 4], query_start_loc: vec![0, 2, 3], logits_indices: vec![0, 1, 2], ..decode.clone() };
        assert!(!verify.is_uniform_decode());
        assert!(!ForwardBatch { logits_indices: vec![1, 0], ..decode.clone() }.is_uniform_decode(), "rows out of order");
        assert!(!ForwardBatch { logits_indices: vec![1], ..decode.clone() }.is_uniform_decode(), "a row without logits");
        assert!(!ForwardBatch { hidden_states: true, ..decode.clone() }.is_uniform_decode(), "pooling");
        assert!(!batch().is_uniform_decode(), "a prompt chunk of two tokens");
        assert!(!ForwardBatch::default().is_uniform_decode(), "an empty batch");
    }

    #[test]
    fn step_bounds_of_a_valid_batch() {
        let b = batch().step_bounds(4).unwrap();
        assert_eq!(b.token_seq, [0, 0, 1]);
        assert_eq!((b.max_id, b.max_position, b.max_logits_row, b.max_slot), (Some(9), Some(4), Some(2), Some(20)));
        // Sequence 0 reads one block (3), sequence 1 two (4, 6): the padding 0 is not read.
        assert_eq!(b.max_block, Some(6));
        assert!(StepBounds::check_below(b.max_block, 7, "block", "the pool").is_ok());
        let err = StepBounds::check_below(b.max_block, 6, "block", "the pool").unwrap_err();
        assert!(err.to_string().contains("block 6 outside the pool of 6"), "{err}");
    }

    #[test]
    fn step_bounds_refuse_inconsistent_batches() {
        let cases: [fn(&mut ForwardBatch); 9] = [
            |b| {
                b.positions.pop();
            },
            |b| b.query_start_loc = vec![0, 2, 1],
            |b| b.query_start_loc = vec![0, 2, 4],
            |b| b.query_start_loc = vec![1, 2, 3], // not from 0
            |b| {
                // No offsets for three tokens.
                b.query_start_loc.clear();
                b.context_lens.clear();
            },
            |b| b.logits_indices = vec![3], // past the tokens
            |b| b.logits_indices = vec![0, 7],
            |b| b.context_lens[0] = 1, // 2 queries in a context of 1
            |b| b.context_lens[1] = 9, // 3 blocks in a row of 2
        ];
        for (i, spoil) in cases.iter().enumerate() {
            let mut b = batch();
            spoil(&mut b);
            assert!(b.step_bounds(4).is_err(), "case {i}");
        }
    }
}
