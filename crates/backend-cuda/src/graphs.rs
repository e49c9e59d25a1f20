//! CUDA graphs for decode steps (thesis §4.6.3; vLLM's full graphs for
//! uniform decode batches): the host-side bookkeeping, with no device in it.
//!
//! A decode step of a small model is hundreds of launches whose cost on the
//! host (~3 µs each) exceeds the kernels' own time. A CUDA graph records a
//! step's launches once and replays them with one call. A replay repeats
//! the recorded launches exactly (grids, shared memory, buffer addresses),
//! so what a step's launches depend on must be the same at every replay:
//! - **the batch's rows**: a decode batch of `n` sequences is padded to the
//!   smallest capture size `≥ n` ([`CaptureSizes`]); a padded row reads
//!   block 0, writes no KV slot, and its logits are dropped;
//! - **the longest context**, which picks the attention kernel and its
//!   partitions: rounded up to a power of two ([`context_bucket`]); the
//!   kernels read each sequence's own length from the device, so a larger
//!   bound only adds partitions that return at once;
//! - **the inputs' addresses**: each [`GraphKey`] owns persistent input
//!   buffers that a step's padded inputs ([`PaddedDecode`]) are copied into
//!   before the replay.
//!
//! A key runs eagerly the first time it is seen (compiling its kernels),
//! is recorded the second time, and replayed from then on
//! ([`GraphCache`]). The bounds the ops check while a step is recorded
//! (the vocabulary, the RoPE table, the KV pool) are kept as [`Limits`],
//! and every replayed step is checked against them first, so that a replay
//! indexes no more freely than the eager ops would. Prefill and mixed
//! batches, pooling steps and tensor-parallel ranks run eagerly.

use std::collections::HashMap;
use vellum_base::{ForwardBatch, StepBounds};

/// The smallest context bound a recorded step is keyed by (one partition
/// of paged attention v2).
pub const MIN_CONTEXT_BUCKET: usize = 512;

/// The longest context a decode step is recorded for (vLLM's
/// `max_seq_len_to_capture`); a batch with a longer one runs eagerly. It
/// bounds the persistent inputs every shape keeps (block tables of
/// `rows × 8192 / block_size` entries at most).
pub const MAX_CONTEXT_TO_CAPTURE: usize = 8192;

/// Eager runs of a key before it is recorded: the first compiles its
/// kernels and warms cuBLAS outside the capture.
pub const WARMUP_RUNS: u32 = 1;

/// The batch sizes decode steps are padded to and recorded at (vLLM's
/// `cudagraph_capture_sizes`), ascending.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureSizes(Vec<usize>);

impl CaptureSizes {
    /// vLLM's default list: 1, 2, 4, then every multiple of 8 up to `max`.
    pub fn up_to(max: usize) -> Self {
        let mut sizes: Vec<usize> = [1, 2, 4].into_iter().filter(|&s| s <= max).collect();
        sizes.extend((8..=max).step_by(8));
        Self(sizes)
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
        Self::up_to(512)
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
    /// Rows (sequences, one token each) after padding.
    pub rows: usize,
    /// [`context_bucket`] of the batch's longest context.
    pub context_bucket: usize,
    /// KV-cache groups (block tables per sequence).
    pub groups: usize,
    /// Tokens per KV block.
    pub block_size: usize,
}

impl GraphKey {
    /// The key of `batch` when it can be replayed: a decode batch (one new
    /// token per sequence, every row's logits, in order; not a pooling
    /// step) of no more rows than the largest capture size and no context
    /// past [`MAX_CONTEXT_TO_CAPTURE`]. `None`: it runs eagerly.
    pub fn of(batch: &ForwardBatch, sizes: &CaptureSizes, block_size: usize) -> Option<Self> {
        let t = batch.num_tokens();
        if !batch.is_uniform_decode() || block_size == 0 {
            return None;
        }
        let max_context = batch.context_lens.iter().copied().max().unwrap_or(0) as usize;
        if max_context > MAX_CONTEXT_TO_CAPTURE {
            return None;
        }
        Some(Self { rows: sizes.padded(t)?, context_bucket: context_bucket(max_context), groups: batch.kv_groups(), block_size })
    }

    /// Entries per block-table row: enough blocks for the bucket's context.
    pub fn table_stride(&self) -> usize {
        self.context_bucket.div_ceil(self.block_size)
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

/// A decode batch's inputs padded to its key's rows: what is copied into the
/// key's persistent buffers before a replay.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaddedDecode {
    /// Token ids (padding: 0), positions (0), per group each row's slot
    /// (-1, which writes nothing) and `[rows, stride]` block ids (padding
    /// and unused entries: 0), row i as sequence i with one query, context
    /// lengths (padding: 1, the one slot of block 0 it reads), logits rows
    /// `0..rows`.
    pub inputs: HostInputs,
    /// The bounds of the padded step: the batch's own, with the padding's
    /// block 0 and logits rows.
    pub bounds: StepBounds,
}

impl PaddedDecode {
    /// Pads `batch` (whose key is `key`, from [`GraphKey::of`]) to
    /// `key.rows`; `bounds` are the batch's own
    /// ([`ForwardBatch::step_bounds`], which checked its shape).
    pub fn new(batch: &ForwardBatch, key: &GraphKey, bounds: &StepBounds) -> Result<Self, String> {
        let (n, rows, stride) = (batch.num_tokens(), key.rows, key.table_stride());
        if n > rows || batch.kv_groups() != key.groups {
            return Err(format!("a batch of {n} rows in {} groups for a graph of {rows} in {}", batch.kv_groups(), key.groups));
        }
        let mut ids = ints(&batch.token_ids, "token id")?;
        ids.resize(rows, 0);
        let mut positions: Vec<i64> = batch.positions.iter().map(|&p| i64::from(p)).collect();
        positions.resize(rows, 0);
        if let Some(&c) = batch.context_lens.iter().find(|&&c| c as usize > key.context_bucket) {
            return Err(format!("a context of {c} for a graph of contexts up to {}", key.context_bucket));
        }
        let mut context_lens = ints(&batch.context_lens, "context length")?;
        context_lens.resize(rows, 1);
        let (mut slots, mut block_tables) = (Vec::with_capacity(key.groups), Vec::with_capacity(key.groups));
        let src_stride = batch.block_table_stride;
        for g in 0..key.groups {
            let mut s: Vec<i64> = batch.slot_mapping[g * n..(g + 1) * n].iter().map(|&x| i64::from(x)).collect();
            s.resize(rows, -1);
            slots.push(s);
            let mut table = vec![0i32; rows * stride];
            for seq in 0..n {
                let from = &batch.block_tables[(g * n + seq) * src_stride..][..src_stride.min(stride)];
                for (dst, &b) in table[seq * stride..].iter_mut().zip(from) {
                    *dst = int(b, "block id")?;
                }
            }
            block_tables.push(table);
        }
        let mut bounds = bounds.clone();
        bounds.token_seq = (0..rows as u32).collect();
        bounds.max_logits_row = rows.checked_sub(1).map(|r| r as u32);
        if rows > n {
            bounds.max_block = bounds.max_block.max(Some(0));
        }
        let inputs = HostInputs {
            ids,
            positions,
            slots,
            block_tables,
            token_seq: (0..rows as i32).collect(),
            query_start_loc: (0..=rows as i32).collect(),
            context_lens,
            logits: (0..rows as i32).collect(),
        };
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
}

impl<G> Default for GraphCache<G> {
    fn default() -> Self {
        Self { entries: HashMap::new() }
    }
}

impl<G> GraphCache<G> {
    /// The action for a step of `key`, counting it.
    pub fn next(&mut self, key: GraphKey) -> Action {
        let entry = self.entries.entry(key).or_insert(Entry::Warming(0));
        match entry {
            Entry::Warming(n) if *n < WARMUP_RUNS => {
                *n += 1;
                Action::Eager
            }
            Entry::Warming(_) => Action::Record,
            Entry::Recorded(_) => Action::Replay,
            Entry::Eager => Action::Eager,
        }
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
        self.entries.insert(key, Entry::Recorded(graph));
    }

    /// Marks `key` as failing to record: its steps run eagerly.
    pub fn failed(&mut self, key: GraphKey) {
        self.entries.insert(key, Entry::Eager);
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let key = GraphKey::of(&b, &sizes, 4).expect("a decode batch");
        assert_eq!(key, GraphKey { rows: 4, context_bucket: 512, groups: 1, block_size: 4 });
        assert_eq!(key.table_stride(), 128);
        // A prefill chunk (two queries in one sequence).
        let mut prefill = b.clone();
        prefill.token_ids.push(40);
        prefill.positions.push(3);
        prefill.slot_mapping.push(11 * 4 + 3);
        prefill.query_start_loc = vec![0, 1, 2, 4];
        prefill.context_lens[2] = 4;
        prefill.logits_indices = vec![0, 1, 3];
        assert_eq!(GraphKey::of(&prefill, &sizes, 4), None);
        // Pooling, fewer logits rows (prompt logprobs aside), too many rows.
        assert_eq!(GraphKey::of(&ForwardBatch { hidden_states: true, ..b.clone() }, &sizes, 4), None);
        assert_eq!(GraphKey::of(&ForwardBatch { logits_indices: vec![0, 2], ..b.clone() }, &sizes, 4), None);
        assert_eq!(GraphKey::of(&b, &CaptureSizes::up_to(2), 4), None);
        assert_eq!(GraphKey::of(&ForwardBatch::default(), &sizes, 4), None);
        // A context past what is recorded.
        let mut long = b.clone();
        long.context_lens[1] = MAX_CONTEXT_TO_CAPTURE as u32 + 1;
        assert_eq!(GraphKey::of(&long, &sizes, 4), None);
        long.context_lens[1] = MAX_CONTEXT_TO_CAPTURE as u32;
        assert_eq!(GraphKey::of(&long, &sizes, 4).map(|k| k.context_bucket), Some(MAX_CONTEXT_TO_CAPTURE));
    }

    #[test]
    fn padding_reads_block_zero_writes_no_slot_and_keeps_every_real_entry() {
        let b = decode_batch();
        let key = GraphKey::of(&b, &CaptureSizes::up_to(8), 4).unwrap();
        let bounds = b.step_bounds(4).unwrap();
        let p = PaddedDecode::new(&b, &key, &bounds).unwrap();
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
        let key = GraphKey::of(&b, &CaptureSizes::up_to(4), 4).unwrap();
        let p = PaddedDecode::new(&b, &key, &b.step_bounds(4).unwrap()).unwrap();
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

    #[test]
    fn a_key_warms_up_records_once_and_then_replays() {
        let key = GraphKey { rows: 4, context_bucket: 512, groups: 1, block_size: 16 };
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
