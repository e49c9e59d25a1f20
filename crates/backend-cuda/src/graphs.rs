//! CUDA graphs for engine steps (thesis §4.6.3; vLLM's full graphs): the
//! host-side bookkeeping, with no device in it.
//!
//! A step of a small model is hundreds of launches whose cost on the host
//! (~3 µs each) exceeds the kernels' own time. A CUDA graph records a
//! step's launches once and replays them with one call. A replay repeats
//! the recorded launches exactly (grids, shared memory, buffer addresses),
//! so what a step's launches depend on must be the same at every replay:
//! - **the step's tokens**: a batch of `n` tokens is padded to the smallest
//!   capture size `≥ n` ([`CaptureSizes`]); each padding token is a
//!   sequence of its own that reads block 0, writes no KV slot, and whose
//!   logits are dropped;
//! - **the logits rows**: padded the same way (a decode step's rows are
//!   its tokens; a mixed step's are the sequences that sample);
//! - **the longest context**, which picks the attention kernel and its
//!   partitions: rounded up to a power of two ([`context_bucket`]); the
//!   kernels read each sequence's own length from the device, so a larger
//!   bound only adds partitions that return at once;
//! - **the inputs' addresses**: each [`GraphKey`] owns persistent input
//!   buffers that a step's padded inputs ([`PaddedStep`]) are copied into
//!   before the replay.
//!
//! The paged-attention kernels take every per-token fact (its sequence,
//! its query offset, its context) from those buffers, so a mixed step —
//! prompt chunks beside decodes, a speculative verification — replays as
//! well as a uniform decode ([`CudaGraphMode::Full`], vLLM's `FULL`). By
//! default only uniform decode steps are recorded ([`CudaGraphMode::FullDecodeOnly`],
//! vLLM's `FULL_DECODE_ONLY`), at start; a mixed key is recorded lazily,
//! after [`MIXED_WARMUP_RUNS`] eager runs, so that a shape met once or
//! twice costs no recording.
//!
//! A key runs eagerly the first time(s) it is seen (compiling its kernels),
//! is recorded next, and replayed from then on ([`GraphCache`]). The bounds
//! the ops check while a step is recorded (the vocabulary, the RoPE table,
//! the KV pool) are kept as [`Limits`], and every replayed step is checked
//! against them first, so that a replay indexes no more freely than the
//! eager ops would. Pooling steps and tensor-parallel ranks run eagerly.

use std::collections::HashMap;
use vellum_base::{CudaGraphMode, ForwardBatch, StepBounds};

/// The smallest context bound a recorded step is keyed by (one partition
/// of paged attention v2).
pub const MIN_CONTEXT_BUCKET: usize = 512;

/// The longest context a step is recorded for (vLLM's
/// `max_seq_len_to_capture`); a batch with a longer one runs eagerly. It
/// bounds the persistent inputs every shape keeps (block tables of
/// `rows × 8192 / block_size` entries at most).
pub const MAX_CONTEXT_TO_CAPTURE: usize = 8192;

/// Eager runs of a uniform decode key before it is recorded: the first
/// compiles its kernels and warms cuBLAS outside the capture.
pub const WARMUP_RUNS: u32 = 1;

/// Eager runs of a mixed key before it is recorded: a recording costs a few
/// steps' time, which a shape met only once or twice would not repay.
pub const MIXED_WARMUP_RUNS: u32 = 3;

/// Most mixed keys recorded: their shapes (tokens × logits rows × context
/// bound) are many more than the decode sizes, and each recorded key keeps
/// its inputs on the device; a mixed shape past these runs eagerly.
pub const MAX_MIXED_GRAPHS: usize = 64;

/// The token counts steps are padded to and recorded at (vLLM's
/// `cudagraph_capture_sizes`), ascending; logits rows are padded to them
/// too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureSizes(Vec<usize>);

impl CaptureSizes {
    /// vLLM's default list: 1, 2, 4, then every multiple of 8 up to `max`.
    pub fn up_to(max: usize) -> Self {
        Self(vellum_base::default_capture_sizes(max))
    }

    /// The sizes given (`--cuda-graph-sizes`), sorted; `None` when one is 0.
    pub fn new(mut sizes: Vec<usize>) -> Option<Self> {
        if sizes.contains(&0) {
            return None;
        }
        sizes.sort_unstable();
        sizes.dedup();
        Some(Self(sizes))
    }

    /// The smallest size that holds `rows` rows, if any.
    pub fn padded(&self, rows: usize) -> Option<usize> {
        self.0.iter().copied().find(|&s| s >= rows)
    }

    /// The sizes, ascending.
    pub fn sizes(&self) -> &[usize] {
        &self.0
    }
}

impl Default for CaptureSizes {
    /// Up to 512 rows, as vLLM's default (a size is recorded only when a
    /// batch of it runs).
    fn default() -> Self {
        Self::up_to(vellum_base::DEFAULT_MAX_CAPTURE_SIZE)
    }
}

/// The longest context rounded up to a power of two, at least
/// [`MIN_CONTEXT_BUCKET`].
pub fn context_bucket(max_context: usize) -> usize {
    max_context.max(MIN_CONTEXT_BUCKET).next_power_of_two()
}

/// What a recorded step's launches depend on besides its inputs' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    /// Tokens after padding (a decode step's rows: one token a sequence).
    pub rows: usize,
    /// Logits rows after padding (`rows` for a decode step).
    pub logits_rows: usize,
    /// A mixed step: its sequences, query offsets and logits rows are
    /// uploaded at every replay (a decode key's never change).
    pub mixed: bool,
    /// [`context_bucket`] of the batch's longest context.
    pub context_bucket: usize,
    /// KV-cache groups (block tables per sequence).
    pub groups: usize,
    /// Tokens per KV block.
    pub block_size: usize,
}

impl GraphKey {
    /// The key of `batch` when `mode` replays it: a uniform decode batch
    /// (one new token per sequence, every row's logits, in order), or under
    /// [`CudaGraphMode::Full`] any batch but a pooling step (one without
    /// logits rows takes one); of no more tokens than the largest capture
    /// size, no sequence without a new token, and no context past
    /// [`MAX_CONTEXT_TO_CAPTURE`]. `None`: it runs eagerly.
    pub fn of(batch: &ForwardBatch, sizes: &CaptureSizes, block_size: usize, mode: CudaGraphMode) -> Option<Self> {
        let t = batch.num_tokens();
        if batch.num_seqs() > t {
            // A sequence without a new token: the padding's one-token
            // sequences would not fit the key's sequence buffers.
            return None;
        }
        let uniform = batch.is_uniform_decode();
        let replayed = match mode {
            CudaGraphMode::None => false,
            CudaGraphMode::FullDecodeOnly => uniform,
            CudaGraphMode::Full => t > 0 && !batch.hidden_states,
        };
        if !replayed || block_size == 0 {
            return None;
        }
        let max_context = batch.context_lens.iter().copied().max().unwrap_or(0) as usize;
        if max_context > MAX_CONTEXT_TO_CAPTURE {
            return None;
        }
        let rows = sizes.padded(t)?;
        // At least one logits row: a step of prompt chunks alone samples
        // nothing, but a graph of no rows would record a product of none.
        let logits_rows = if uniform { rows } else { sizes.padded(batch.logits_indices.len().max(1))? };
        Some(Self {
            rows,
            logits_rows,
            mixed: !uniform,
            context_bucket: context_bucket(max_context),
            groups: batch.kv_groups(),
            block_size,
        })
    }

    /// Entries per block-table row: enough blocks for the bucket's context.
    pub fn table_stride(&self) -> usize {
        self.context_bucket.div_ceil(self.block_size)
    }

    /// Eager runs before the key is recorded.
    pub fn warmup_runs(&self) -> u32 {
        if self.mixed {
            MIXED_WARMUP_RUNS
        } else {
            WARMUP_RUNS
        }
    }
}

/// A step's inputs in the kernels' types, on the host: what a step's device
/// buffers are uploaded from (`CudaOps::prepare_step`), or copied into for
/// a replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostInputs {
    /// Token ids.
    pub ids: Vec<i32>,
    /// Positions.
    pub positions: Vec<i64>,
    /// Per KV-cache group, each token's slot (-1 writes nothing).
    pub slots: Vec<Vec<i64>>,
    /// Per group, `[sequences, stride]` block ids.
    pub block_tables: Vec<Vec<i32>>,
    /// Each token's sequence.
    pub token_seq: Vec<i32>,
    /// First token of each sequence, then the token count.
    pub query_start_loc: Vec<i32>,
    /// Tokens in each sequence's context after the step.
    pub context_lens: Vec<i32>,
    /// The rows whose logits the step returns.
    pub logits: Vec<i32>,
}

/// `x` as a kernel's int32 index.
fn int(x: u32, what: &str) -> Result<i32, String> {
    i32::try_from(x).map_err(|_| format!("{what} {x} does not fit the kernels' int32 indices"))
}

fn ints(xs: &[u32], what: &str) -> Result<Vec<i32>, String> {
    xs.iter().map(|&x| int(x, what)).collect()
}

impl HostInputs {
    /// `batch` as it is, with `bounds` from [`ForwardBatch::step_bounds`]
    /// (which checked its shape).
    pub fn of(batch: &ForwardBatch, bounds: &StepBounds) -> Result<Self, String> {
        let (t, s, stride) = (batch.num_tokens(), batch.num_seqs(), batch.block_table_stride);
        let groups = batch.kv_groups();
        Ok(Self {
            ids: ints(&batch.token_ids, "token id")?,
            positions: batch.positions.iter().map(|&p| i64::from(p)).collect(),
            slots: (0..groups).map(|g| batch.slot_mapping[g * t..(g + 1) * t].iter().map(|&x| i64::from(x)).collect()).collect(),
            block_tables: (0..groups)
                .map(|g| ints(&batch.block_tables[g * s * stride..(g + 1) * s * stride], "block id"))
                .collect::<Result<_, _>>()?,
            token_seq: ints(&bounds.token_seq, "sequence index")?,
            query_start_loc: ints(&batch.query_start_loc, "query offset")?,
            context_lens: ints(&batch.context_lens, "context length")?,
            logits: ints(&batch.logits_indices, "logits row")?,
        })
    }
}

/// A batch's inputs padded to its key's shape: what is copied into the
/// key's persistent buffers before a replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaddedStep {
    /// The batch's own entries first, then the padding: token ids 0,
    /// positions 0, slots -1 (which write nothing), each padding token a
    /// sequence of its own with one query and a context of 1 (the one slot
    /// of block 0 it reads, its table row all block 0); the sequences'
    /// entries past the last one (a mixed step has fewer sequences than
    /// tokens) repeat the end so that the buffers keep one size; the
    /// batch's logits rows, then padding tokens' rows (the last row when
    /// there are none). A uniform decode batch pads to the identity:
    /// token `i` is sequence `i`, logits row `i`.
    pub inputs: HostInputs,
    /// The bounds of the padded step: the batch's own, with the padding's
    /// block 0 and logits rows.
    pub bounds: StepBounds,
}

impl PaddedStep {
    /// Pads `batch` (whose key is `key`, from [`GraphKey::of`]) to
    /// `key.rows` tokens and `key.logits_rows` logits rows; `bounds` are
    /// the batch's own ([`ForwardBatch::step_bounds`], which checked its
    /// shape).
    pub fn new(batch: &ForwardBatch, key: &GraphKey, bounds: &StepBounds) -> Result<Self, String> {
        let (n, s, rows, stride) = (batch.num_tokens(), batch.num_seqs(), key.rows, key.table_stride());
        let logits = batch.logits_indices.len();
        if n > rows || n == 0 || logits > key.logits_rows || key.logits_rows > rows || batch.kv_groups() != key.groups {
            return Err(format!(
                "a batch of {n} tokens, {logits} logits rows in {} groups for a graph of {rows}, {} in {}",
                batch.kv_groups(),
                key.logits_rows,
                key.groups
            ));
        }
        if let Some(&c) = batch.context_lens.iter().find(|&&c| c as usize > key.context_bucket) {
            return Err(format!("a context of {c} for a graph of contexts up to {}", key.context_bucket));
        }
        if s > n {
            return Err(format!("{s} sequences for {n} tokens: a sequence without a new token is not padded"));
        }
        let pad = rows - n;
        // Sequences: the batch's, then one a padding token, then (unused)
        // entries up to `rows` that repeat the end.
        let seqs = s + pad;
        let mut ids = ints(&batch.token_ids, "token id")?;
        ids.resize(rows, 0);
        let mut positions: Vec<i64> = batch.positions.iter().map(|&p| i64::from(p)).collect();
        positions.resize(rows, 0);
        let mut token_seq = ints(&bounds.token_seq, "sequence index")?;
        token_seq.extend((s..seqs).map(|q| q as i32));
        let mut query_start_loc = ints(&batch.query_start_loc, "query offset")?;
        query_start_loc.extend((n + 1..=rows).map(|q| q as i32));
        query_start_loc.resize(rows + 1, rows as i32);
        let mut context_lens = ints(&batch.context_lens, "context length")?;
        context_lens.resize(rows, 1);
        let (mut slots, mut block_tables) = (Vec::with_capacity(key.groups), Vec::with_capacity(key.groups));
        let src_stride = batch.block_table_stride;
        for g in 0..key.groups {
            let mut slot: Vec<i64> = batch.slot_mapping[g * n..(g + 1) * n].iter().map(|&x| i64::from(x)).collect();
            slot.resize(rows, -1);
            slots.push(slot);
            let mut table = vec![0i32; rows * stride];
            for seq in 0..s {
                let from = &batch.block_tables[(g * s + seq) * src_stride..][..src_stride.min(stride)];
                for (dst, &b) in table[seq * stride..].iter_mut().zip(from) {
                    *dst = int(b, "block id")?;
                }
            }
            block_tables.push(table);
        }
        let mut logits_rows = ints(&batch.logits_indices, "logits row")?;
        let padding_rows = (n..rows).map(|r| r as i32).chain(std::iter::repeat(rows as i32 - 1));
        logits_rows.extend(padding_rows.take(key.logits_rows - logits));
        let mut bounds = bounds.clone();
        bounds.token_seq = token_seq.iter().map(|&q| q as u32).collect();
        bounds.max_logits_row = logits_rows.iter().map(|&r| r as u32).max();
        if pad > 0 {
            bounds.max_block = bounds.max_block.max(Some(0));
        }
        let inputs = HostInputs { ids, positions, slots, block_tables, token_seq, query_start_loc, context_lens, logits: logits_rows };
        Ok(Self { inputs, bounds })
    }
}

/// The bounds an op checks a step's indices against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// Token ids against the vocabulary.
    Id,
    /// Positions against the RoPE table.
    Position,
    /// Logits rows against the batch.
    LogitsRow,
    /// KV slots against the pool.
    Slot,
    /// Block ids against the pool.
    Block,
}

/// The smallest limit of each [`Bound`] the ops checked while a step was
/// recorded: a replay is safe for a step within all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits([usize; 5]);

impl Default for Limits {
    /// No limit yet.
    fn default() -> Self {
        Self([usize::MAX; 5])
    }
}

impl Limits {
    /// Notes a check of `bound` against `limit`.
    pub fn note(&mut self, bound: Bound, limit: usize) {
        let l = &mut self.0[bound as usize];
        *l = (*l).min(limit);
    }

    /// `Ok` when each of the step's largest indices is below its limit.
    pub fn admit(&self, b: &StepBounds) -> Result<(), String> {
        let checks = [
            (Bound::Id, b.max_id, "token id"),
            (Bound::Position, b.max_position, "position"),
            (Bound::LogitsRow, b.max_logits_row, "logits row"),
            (Bound::Slot, b.max_slot, "KV slot"),
            (Bound::Block, b.max_block, "block"),
        ];
        for (bound, max, what) in checks {
            let limit = self.0[bound as usize];
            if let Some(m) = max.filter(|&m| m as usize >= limit) {
                return Err(format!("{what} {m} outside the recorded step's limit of {limit}"));
            }
        }
        Ok(())
    }
}

/// What to do with a step of a key.
#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    /// Run the ops (a warm-up, or a key whose recording failed).
    Eager,
    /// Record the step's launches, then replay them.
    Record,
    /// Replay the recorded graph.
    Replay,
}

/// A key's state.
enum Entry<G> {
    /// Seen this many times, not recorded yet.
    Warming(u32),
    /// Recorded.
    Recorded(G),
    /// Its recording failed: eager from now on.
    Eager,
}

/// Each key's graph `G` (the device's recorded graph with its buffers) and
/// what to do with its next step.
pub struct GraphCache<G> {
    entries: HashMap<GraphKey, Entry<G>>,
    /// Mixed keys recorded (at most [`MAX_MIXED_GRAPHS`]).
    mixed: usize,
}

impl<G> Default for GraphCache<G> {
    fn default() -> Self {
        Self { entries: HashMap::new(), mixed: 0 }
    }
}

impl<G> GraphCache<G> {
    /// The action for a step of `key`, counting it. A mixed key due for
    /// recording once [`MAX_MIXED_GRAPHS`] are recorded runs eagerly from
    /// then on.
    pub fn next(&mut self, key: GraphKey) -> Action {
        let action = self.peek(&key);
        let entry = self.entries.entry(key).or_insert(Entry::Warming(0));
        match entry {
            Entry::Warming(n) if *n < key.warmup_runs() => *n += 1,
            // Due, but the mixed keys' room is full.
            Entry::Warming(_) if action == Action::Eager => *entry = Entry::Eager,
            _ => {}
        }
        action
    }

    /// What [`next`](Self::next) would answer for `key`, without counting.
    pub fn peek(&self, key: &GraphKey) -> Action {
        match self.entries.get(key) {
            None => Action::Eager,
            Some(Entry::Warming(n)) if *n < key.warmup_runs() => Action::Eager,
            Some(Entry::Warming(_)) if key.mixed && self.mixed >= MAX_MIXED_GRAPHS => Action::Eager,
            Some(Entry::Warming(_)) => Action::Record,
            Some(Entry::Recorded(_)) => Action::Replay,
            Some(Entry::Eager) => Action::Eager,
        }
    }

    /// Whether `key` runs eagerly for good (its recording failed, or the
    /// mixed keys' room was full when it was due).
    pub fn gave_up(&self, key: &GraphKey) -> bool {
        matches!(self.entries.get(key), Some(Entry::Eager))
    }

    /// Takes back the warm-up [`next`](Self::next) just counted for `key`
    /// (it failed).
    pub fn rewind(&mut self, key: GraphKey) {
        if let Some(Entry::Warming(n)) = self.entries.get_mut(&key) {
            *n = n.saturating_sub(1);
        }
    }

    /// Stores `key`'s recorded graph.
    pub fn recorded(&mut self, key: GraphKey, graph: G) {
        if key.mixed && !matches!(self.entries.get(&key), Some(Entry::Recorded(_))) {
            self.mixed += 1;
        }
        self.entries.insert(key, Entry::Recorded(graph));
    }

    /// Marks `key` as failing to record (or to replay): its steps run
    /// eagerly, and a recorded mixed key's room is free again.
    pub fn failed(&mut self, key: GraphKey) {
        if let Some(Entry::Recorded(_)) = self.entries.insert(key, Entry::Eager) {
            if key.mixed {
                self.mixed -= 1;
            }
        }
    }

    /// `key`'s graph, once recorded.
    pub fn get(&self, key: &GraphKey) -> Option<&G> {
        match self.entries.get(key) {
            Some(Entry::Recorded(g)) => Some(g),
            _ => None,
        }
    }

    /// `key`'s graph, once recorded, to update.
    pub fn get_mut(&mut self, key: &GraphKey) -> Option<&mut G> {
        match self.entries.get_mut(key) {
            Some(Entry::Recorded(g)) => Some(g),
            _ => None,
        }
    }

    /// The recorded graphs.
    pub fn recorded_graphs(&self) -> impl Iterator<Item = (&GraphKey, &G)> {
        self.entries.iter().filter_map(|(k, e)| match e {
            Entry::Recorded(g) => Some((k, g)),
            _ => None,
        })
    }

    /// Forgets every key (the KV cache they address was replaced).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.mixed = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DECODE: CudaGraphMode = CudaGraphMode::FullDecodeOnly;

    /// Three decode sequences (contexts 5, 17, 3; block size 4) in one
    /// KV-cache group, block tables of stride 6.
    fn decode_batch() -> ForwardBatch {
        let stride = 6;
        let mut tables = vec![0u32; 3 * stride];
        tables[..2].copy_from_slice(&[7, 9]);
        tables[stride..stride + 5].copy_from_slice(&[1, 2, 3, 4, 5]);
        tables[2 * stride] = 11;
        ForwardBatch {
            token_ids: vec![10, 20, 30],
            positions: vec![4, 16, 2],
            slot_mapping: vec![9 * 4, 5 * 4, 11 * 4 + 2],
            query_start_loc: vec![0, 1, 2, 3],
            context_lens: vec![5, 17, 3],
            block_tables: tables,
            block_table_stride: stride,
            num_kv_groups: 1,
            logits_indices: vec![0, 1, 2],
            ..ForwardBatch::default()
        }
    }

    #[test]
    fn capture_sizes_pad_to_the_next_size_and_stop_at_the_largest() {
        let sizes = CaptureSizes::up_to(32);
        assert_eq!(sizes.sizes(), &[1, 2, 4, 8, 16, 24, 32]);
        assert_eq!([1, 2, 3, 5, 9, 17, 25, 32].map(|n| sizes.padded(n)), [1, 2, 4, 8, 16, 24, 32, 32].map(Some));
        assert_eq!(sizes.padded(33), None);
        assert_eq!(CaptureSizes::default().sizes().last(), Some(&512));
        assert_eq!(CaptureSizes::new(vec![8, 1, 8, 4]).map(|s| s.0), Some(vec![1, 4, 8]));
        assert_eq!(CaptureSizes::new(vec![0, 4]), None);
    }

    #[test]
    fn context_buckets_are_powers_of_two_from_one_partition() {
        assert_eq!([0, 1, 512, 513, 1024, 3000, 4096].map(context_bucket), [512, 512, 512, 1024, 1024, 4096, 4096]);
    }

    #[test]
    fn only_uniform_decode_batches_have_a_key() {
        let sizes = CaptureSizes::up_to(8);
        let b = decode_batch();
        let key = GraphKey::of(&b, &sizes, 4, DECODE).expect("a decode batch");
        assert_eq!(key, GraphKey { rows: 4, logits_rows: 4, mixed: false, context_bucket: 512, groups: 1, block_size: 4 });
        assert_eq!(key.table_stride(), 128);
        // A prefill chunk (two queries in one sequence).
        let mut prefill = b.clone();
        prefill.token_ids.push(40);
        prefill.positions.push(3);
        prefill.slot_mapping.push(11 * 4 + 3);
        prefill.query_start_loc = vec![0, 1, 2, 4];
        prefill.context_lens[2] = 4;
        prefill.logits_indices = vec![0, 1, 3];
        assert_eq!(GraphKey::of(&prefill, &sizes, 4, DECODE), None);
        // Pooling, fewer logits rows (prompt logprobs aside), too many rows.
        assert_eq!(GraphKey::of(&ForwardBatch { hidden_states: true, ..b.clone() }, &sizes, 4, DECODE), None);
        assert_eq!(GraphKey::of(&ForwardBatch { logits_indices: vec![0, 2], ..b.clone() }, &sizes, 4, DECODE), None);
        assert_eq!(GraphKey::of(&b, &CaptureSizes::up_to(2), 4, DECODE), None);
        assert_eq!(GraphKey::of(&ForwardBatch::default(), &sizes, 4, DECODE), None);
        // A context past what is recorded.
        let mut long = b.clone();
        long.context_lens[1] = MAX_CONTEXT_TO_CAPTURE as u32 + 1;
        assert_eq!(GraphKey::of(&long, &sizes, 4, DECODE), None);
        long.context_lens[1] = MAX_CONTEXT_TO_CAPTURE as u32;
        assert_eq!(GraphKey::of(&long, &sizes, 4, DECODE).map(|k| k.context_bucket), Some(MAX_CONTEXT_TO_CAPTURE));
    }

    #[test]
    fn padding_reads_block_zero_writes_no_slot_and_keeps_every_real_entry() {
        let b = decode_batch();
        let key = GraphKey::of(&b, &CaptureSizes::up_to(8), 4, DECODE).unwrap();
        let bounds = b.step_bounds(4).unwrap();
        let p = PaddedStep::new(&b, &key, &bounds).unwrap();
        assert_eq!(p.inputs.ids, [10, 20, 30, 0]);
        assert_eq!(p.inputs.positions, [4, 16, 2, 0]);
        assert_eq!(p.inputs.slots, [vec![36, 20, 46, -1]]);
        assert_eq!(p.inputs.context_lens, [5, 17, 3, 1]);
        assert_eq!(p.inputs.query_start_loc, [0, 1, 2, 3, 4]);
        assert_eq!(p.inputs.token_seq, [0, 1, 2, 3]);
        assert_eq!(p.inputs.logits, [0, 1, 2, 3]);
        let stride = key.table_stride();
        assert_eq!(p.inputs.block_tables[0].len(), 4 * stride);
        assert_eq!(&p.inputs.block_tables[0][..6], &[7, 9, 0, 0, 0, 0]);
        assert_eq!(&p.inputs.block_tables[0][stride..stride + 6], &[1, 2, 3, 4, 5, 0]);
        assert_eq!(p.inputs.block_tables[0][2 * stride], 11);
        assert!(p.inputs.block_tables[0][3 * stride..].iter().all(|&x| x == 0));
        assert_eq!(p.bounds.max_logits_row, Some(3));
        assert_eq!(p.bounds.max_block, bounds.max_block);
        assert_eq!(p.bounds.max_id, Some(30));
    }

    #[test]
    fn host_inputs_are_the_batch_in_the_kernels_types() {
        let b = decode_batch();
        let h = HostInputs::of(&b, &b.step_bounds(4).unwrap()).unwrap();
        assert_eq!((h.ids, h.positions, h.context_lens), (vec![10, 20, 30], vec![4, 16, 2], vec![5, 17, 3]));
        assert_eq!((h.token_seq, h.query_start_loc, h.logits), (vec![0, 1, 2], vec![0, 1, 2, 3], vec![0, 1, 2]));
        assert_eq!(h.slots, [vec![36, 20, 46]]);
        assert_eq!(h.block_tables, [b.block_tables.iter().map(|&x| x as i32).collect::<Vec<_>>()]);
        let huge = ForwardBatch { token_ids: vec![10, u32::MAX, 30], ..b.clone() };
        assert!(HostInputs::of(&huge, &huge.step_bounds(4).unwrap()).unwrap_err().contains("token id 4294967295"));
    }

    #[test]
    fn padding_two_groups_keeps_each_groups_tables() {
        let mut b = decode_batch();
        b.num_kv_groups = 2;
        b.slot_mapping.extend([1, 2, 3]);
        let second: Vec<u32> = b.block_tables.iter().map(|&x| x + 100).collect();
        b.block_tables.extend(second);
        let key = GraphKey::of(&b, &CaptureSizes::up_to(4), 4, DECODE).unwrap();
        let p = PaddedStep::new(&b, &key, &b.step_bounds(4).unwrap()).unwrap();
        assert_eq!(p.inputs.slots[1], [1, 2, 3, -1]);
        assert_eq!(&p.inputs.block_tables[1][..2], &[107, 109]);
        assert_eq!(p.inputs.block_tables[1][2 * key.table_stride()], 111);
    }

    #[test]
    fn limits_admit_a_step_only_within_every_recorded_bound() {
        let mut limits = Limits::default();
        limits.note(Bound::Id, 100);
        limits.note(Bound::Id, 50);
        limits.note(Bound::Block, 12);
        let b = decode_batch().step_bounds(4).unwrap();
        assert_eq!(limits.admit(&b), Ok(()));
        limits.note(Bound::Id, 30);
        assert_eq!(limits.admit(&b), Err("token id 30 outside the recorded step's limit of 30".to_string()));
        let mut limits = Limits::default();
        limits.note(Bound::Block, 11);
        assert!(limits.admit(&b).unwrap_err().contains("block 11"));
    }

    /// A mixed batch of `seqs` (context after the step, new tokens), in
    /// `groups` groups, blocks of 4, table rows of `stride`; sequence `q`'s
    /// block `i` is `1 + q·stride + i` in group 0 (`+ 1000` per group);
    /// logits for the last token of each sequence whose `sample` is set.
    fn mixed_batch(seqs: &[(u32, u32, bool)], groups: usize, stride: usize) -> ForwardBatch {
        let mut b = ForwardBatch { block_table_stride: stride, num_kv_groups: groups, query_start_loc: vec![0], ..Default::default() };
        let block = |g: usize, q: usize, i: usize| (1000 * g + 1 + q * stride + i) as u32;
        for (q, &(context, new, sample)) in seqs.iter().enumerate() {
            for p in context - new..context {
                b.token_ids.push(7 * p + q as u32);
                b.positions.push(p);
            }
            b.query_start_loc.push(b.token_ids.len() as u32);
            b.context_lens.push(context);
            if sample {
                b.logits_indices.push(b.token_ids.len() as u32 - 1);
            }
        }
        for g in 0..groups {
            for (q, &(context, new, _)) in seqs.iter().enumerate() {
                b.slot_mapping.extend((context - new..context).map(|p| block(g, q, p as usize / 4) * 4 + p % 4));
            }
        }
        for g in 0..groups {
            for q in 0..seqs.len() {
                b.block_tables.extend((0..stride).map(|i| block(g, q, i)));
            }
        }
        b
    }

    /// What the paged-attention kernel makes of token `t` (paged_attention.cu's
    /// `query_of`): its sequence, its context, and the blocks that context
    /// spans in group `g`'s table.
    fn kernel_view(h: &HostInputs, stride: usize, block_size: usize, g: usize, t: usize) -> (i32, i32, Vec<i32>) {
        let seq = h.token_seq[t];
        let q0 = h.query_start_loc[seq as usize];
        let q_len = h.query_start_loc[seq as usize + 1] - q0;
        let n_ctx = h.context_lens[seq as usize] - q_len + (t as i32 - q0) + 1;
        let row = &h.block_tables[g][seq as usize * stride..][..stride];
        (seq, n_ctx, row[..(n_ctx as usize).div_ceil(block_size)].to_vec())
    }

    #[test]
    fn full_mode_keys_mixed_steps_by_tokens_and_logits_rows() {
        let sizes = CaptureSizes::up_to(64);
        // Decodes beside a prompt chunk that samples and one that does not.
        let b = mixed_batch(&[(9, 1, true), (20, 13, true), (30, 6, false), (5, 1, true)], 1, 8);
        assert_eq!(GraphKey::of(&b, &sizes, 4, DECODE), None, "a mixed step is eager by default");
        assert_eq!(GraphKey::of(&b, &sizes, 4, CudaGraphMode::None), None);
        let key = GraphKey::of(&b, &sizes, 4, CudaGraphMode::Full).expect("a mixed key");
        assert_eq!(key, GraphKey { rows: 24, logits_rows: 4, mixed: true, context_bucket: 512, groups: 1, block_size: 4 });
        assert_eq!(key.warmup_runs(), MIXED_WARMUP_RUNS);
        // A decode step keys as it does without FULL (one graph for both modes).
        let d = decode_batch();
        assert_eq!(GraphKey::of(&d, &sizes, 4, CudaGraphMode::Full), GraphKey::of(&d, &sizes, 4, DECODE));
        // Prompt chunks alone (no logits) still take one logits row.
        let quiet = mixed_batch(&[(30, 6, false)], 1, 8);
        assert_eq!(GraphKey::of(&quiet, &sizes, 4, CudaGraphMode::Full).map(|k| (k.rows, k.logits_rows)), Some((8, 1)));
        // Pooling steps, steps past the largest size and empty ones stay eager.
        assert_eq!(GraphKey::of(&ForwardBatch { hidden_states: true, ..b.clone() }, &sizes, 4, CudaGraphMode::Full), None);
        assert_eq!(GraphKey::of(&b, &CaptureSizes::up_to(16), 4, CudaGraphMode::Full), None);
        assert_eq!(GraphKey::of(&ForwardBatch::default(), &sizes, 4, CudaGraphMode::Full), None);
    }

    /// The padding's contract with the kernels, checked the way they read
    /// it, over many mixed batches: every real token keeps its id,
    /// position, slot, sequence context and the blocks it reads; every
    /// padding token reads one slot of block 0 and writes none; the logits
    /// rows the batch asked for come first; every buffer has the key's size.
    #[test]
    fn padding_a_mixed_step_keeps_what_each_real_token_reads_and_writes() {
        let sizes = CaptureSizes::up_to(64);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u32| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % u64::from(n)) as u32
        };
        let mut padded = 0;
        for case in 0..300 {
            let groups = 1 + (case % 2) as usize;
            let stride = 12;
            let seqs: Vec<(u32, u32, bool)> = (0..1 + next(6))
                .map(|_| {
                    let new = if next(2) == 0 { 1 } else { 1 + next(12) };
                    (new + next(30), new, next(4) != 0)
                })
                .collect();
            let b = mixed_batch(&seqs, groups, stride);
            let bounds = b.step_bounds(4).expect("a valid batch");
            let Some(key) = GraphKey::of(&b, &sizes, 4, CudaGraphMode::Full) else {
                continue;
            };
            let real = HostInputs::of(&b, &bounds).expect("host inputs");
            let p = PaddedStep::new(&b, &key, &bounds).expect("pads");
            let (n, rows, ks) = (b.num_tokens(), key.rows, key.table_stride());
            let h = &p.inputs;
            assert_eq!((h.ids.len(), h.positions.len(), h.token_seq.len(), h.context_lens.len()), (rows, rows, rows, rows));
            assert_eq!((h.query_start_loc.len(), h.logits.len()), (rows + 1, key.logits_rows));
            assert!(h.query_start_loc.windows(2).all(|w| w[0] <= w[1]), "case {case}: query starts descend");
            for g in 0..groups {
                assert_eq!((h.slots[g].len(), h.block_tables[g].len()), (rows, rows * ks));
                for t in 0..rows {
                    let (seq, n_ctx, blocks) = kernel_view(h, ks, 4, g, t);
                    if t < n {
                        let want = kernel_view(&real, stride, 4, g, t);
                        assert_eq!((seq, n_ctx, &blocks), (want.0, want.1, &want.2), "case {case}: token {t} of group {g}");
                        assert_eq!((h.ids[t], h.positions[t], h.slots[g][t]), (real.ids[t], real.positions[t], real.slots[g][t]));
                    } else {
                        assert_eq!((n_ctx, blocks, h.slots[g][t]), (1, vec![0], -1), "case {case}: padding token {t}");
                        assert!(seq as usize >= b.num_seqs(), "case {case}: padding token {t} joins sequence {seq}");
                    }
                }
            }
            let asked = b.logits_indices.len();
            assert_eq!(&h.logits[..asked], &real.logits[..], "case {case}");
            assert!(h.logits.iter().all(|&r| (r as usize) < rows), "case {case}: {:?}", h.logits);
            assert!(h.logits[asked..].iter().all(|&r| r as usize >= n || r as usize == rows - 1), "case {case}");
            assert_eq!(p.bounds.max_logits_row, h.logits.iter().map(|&r| r as u32).max());
            if rows > n {
                assert_eq!(p.bounds.max_block, bounds.max_block.max(Some(0)));
                padded += 1;
            }
        }
        assert!(padded > 200, "only {padded} of 300 cases were padded");
    }

    #[test]
    fn a_padded_step_must_fit_its_key() {
        let b = mixed_batch(&[(9, 1, true), (20, 13, true)], 1, 8);
        let bounds = b.step_bounds(4).unwrap();
        let key = GraphKey::of(&b, &CaptureSizes::up_to(64), 4, CudaGraphMode::Full).unwrap();
        for small in [GraphKey { rows: 8, ..key }, GraphKey { logits_rows: 1, ..key }, GraphKey { groups: 2, ..key }] {
            assert!(PaddedStep::new(&b, &small, &bounds).is_err(), "{small:?}");
        }
        let short = GraphKey { context_bucket: 16, ..key };
        assert!(PaddedStep::new(&b, &short, &bounds).unwrap_err().contains("a context of 20"));
    }

    #[test]
    fn a_mixed_key_records_after_its_warmups_while_there_is_room() {
        let key = GraphKey { rows: 24, logits_rows: 4, mixed: true, context_bucket: 512, groups: 1, block_size: 16 };
        let mut cache = GraphCache::<&str>::default();
        for _ in 0..MIXED_WARMUP_RUNS {
            assert_eq!((cache.peek(&key), cache.next(key)), (Action::Eager, Action::Eager));
        }
        assert_eq!((cache.peek(&key), cache.next(key)), (Action::Record, Action::Record));
        // Room for MAX_MIXED_GRAPHS: the next mixed key due gives up; decode keys do not count.
        for rows in 0..MAX_MIXED_GRAPHS {
            cache.recorded(GraphKey { rows: 100 + rows, ..key }, "graph");
        }
        cache.recorded(GraphKey { rows: 100, ..key }, "again");
        let late = GraphKey { rows: 8, ..key };
        for _ in 0..MIXED_WARMUP_RUNS {
            assert_eq!(cache.next(late), Action::Eager);
        }
        assert!(!cache.gave_up(&late));
        assert_eq!((cache.peek(&late), cache.next(late)), (Action::Eager, Action::Eager));
        assert!(cache.gave_up(&late));
        // A recorded mixed key that fails gives its room back.
        cache.failed(GraphKey { rows: 100, ..key });
        let again = GraphKey { rows: 9, ..key };
        for _ in 0..MIXED_WARMUP_RUNS {
            cache.next(again);
        }
        assert_eq!(cache.next(again), Action::Record);
        let decode = GraphKey { mixed: false, logits_rows: 8, ..late };
        assert_eq!((cache.next(decode), cache.next(decode)), (Action::Eager, Action::Record));
        cache.clear();
        assert!(!cache.gave_up(&late));
    }

    #[test]
    fn a_batch_with_a_sequence_without_new_tokens_is_not_padded() {
        // Three tokens in four sequences, the second with no new token.
        let mut b = mixed_batch(&[(9, 1, true), (20, 13, true)], 1, 8);
        b.query_start_loc = vec![0, 1, 1, 7, 14];
        b.context_lens = vec![9, 5, 20, 20];
        b.block_tables.extend(b.block_tables.clone());
        assert_eq!(GraphKey::of(&b, &CaptureSizes::up_to(64), 4, CudaGraphMode::Full).map(|k| k.rows), Some(16));
        b.token_ids.truncate(3);
        b.positions.truncate(3);
        b.slot_mapping.truncate(3);
        b.query_start_loc = vec![0, 1, 1, 2, 3];
        b.logits_indices = vec![0, 2];
        assert_eq!(GraphKey::of(&b, &CaptureSizes::up_to(64), 4, CudaGraphMode::Full), None);
        let key = GraphKey { rows: 4, logits_rows: 2, mixed: true, context_bucket: 512, groups: 1, block_size: 4 };
        assert!(PaddedStep::new(&b, &key, &b.step_bounds(4).unwrap()).unwrap_err().contains("without a new token"));
    }

    #[test]
    fn a_key_warms_up_records_once_and_then_replays() {
        let key = GraphKey { rows: 4, logits_rows: 4, mixed: false, context_bucket: 512, groups: 1, block_size: 16 };
        let mut cache = GraphCache::<&str>::default();
        assert_eq!(cache.next(key), Action::Eager);
        assert_eq!(cache.next(key), Action::Record);
        assert_eq!(cache.next(key), Action::Record, "until a graph is stored");
        cache.recorded(key, "graph");
        assert_eq!(cache.next(key), Action::Replay);
        // A failed warm-up is taken back: the next step warms up again.
        let third = GraphKey { rows: 16, ..key };
        assert_eq!(cache.next(third), Action::Eager);
        cache.rewind(third);
        assert_eq!(cache.next(third), Action::Eager);
        assert_eq!(cache.next(third), Action::Record);
        assert_eq!(cache.get(&key), Some(&"graph"));
        let other = GraphKey { rows: 8, ..key };
        cache.next(other);
        cache.failed(other);
        assert_eq!(cache.next(other), Action::Eager);
        assert_eq!(cache.recorded_graphs().count(), 1);
        cache.clear();
        assert_eq!(cache.next(key), Action::Eager);
    }
}
