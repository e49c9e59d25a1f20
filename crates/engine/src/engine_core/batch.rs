//! Building the backend's [`ForwardBatch`] from a scheduling decision and
//! the engine's own view of the scheduled sequences: token ids, positions,
//! slot mapping (`slot = block · block_size + position % block_size`),
//! block tables kept by incremental updates, query offsets, context
//! lengths, and the rows whose logits come back.

use super::EngineCore;
use crate::sampler::row_sampling;
use std::time::Instant;
use vellum_base::{BlockAllocator, ForwardBatch, IdMap, ModelExecutor, RequestId, RowSampling, SeededRng, SeqId};
use vellum_scheduler::SchedulerOutput;

/// Entries of a batch's `token_ids` scheduled before their token was
/// sampled (asynchronous scheduling): (index, sequence, position).
pub(super) type Placeholders = Vec<(usize, SeqId, usize)>;

/// Most top logprobs a row may ask for and still be sampled on the device
/// (the OpenAI API's limit).
pub(super) const MAX_DEVICE_TOP_LOGPROBS: usize = 20;

/// What a row of the executor's logits is for.
#[derive(Clone, Copy)]
pub(super) enum Row {
    /// Sample the sequence's next token (after every draft the step verifies).
    Sample(RequestId, SeqId),
    /// Speculative decoding: sample the token at draft `i`'s position, which
    /// accepts or rejects that draft.
    Verify(RequestId, SeqId, usize),
    /// The logprob of prompt token `pos` (the row is position `pos - 1`).
    PromptLogprob(RequestId, usize),
    /// A pooling request's hidden state at prompt position `pos`; `None`:
    /// a row computed only so that the step has one, and dropped.
    Pool(RequestId, Option<usize>),
}

impl<E: ModelExecutor> EngineCore<E> {
    /// Builds the backend's input from the scheduling decision; also returns
    /// what each logits row is for.
    /// Under asynchronous scheduling a decode may be scheduled before its
    /// token was sampled: its entry of `token_ids` is left 0 and listed
    /// (index, sequence, position) for `finalize` to fill in.
    pub(super) fn build_batch(&mut self, out: &SchedulerOutput) -> (ForwardBatch, Vec<Row>, Placeholders) {
        for u in &out.block_table_updates {
            let t = self.block_tables.entry(u.seq_id).or_default();
            t.truncate(u.start);
            t.extend_from_slice(&u.block_ids);
        }
        let bs = self.block_size;
        // The manager's tables interleave the KV-cache groups (entry i·G + g
        // is logical block i of group g); the batch lays them out group
        // after group, each group's rows as a one-group model's.
        let groups = self.scheduler.allocator().num_kv_groups();
        let stride = out.scheduled.iter().map(|s| self.block_tables.get(&s.seq_id).map_or(0, Vec::len)).max().unwrap_or(0) / groups;
        let num_tokens: usize = out.scheduled.iter().map(|s| s.num_scheduled_tokens).sum();
        let num_seqs = out.scheduled.len();
        let mut b = ForwardBatch {
            block_table_stride: stride,
            num_kv_groups: groups,
            block_ops: out.block_ops.clone(),
            slot_mapping: vec![0; groups * num_tokens],
            block_tables: vec![0; groups * num_seqs * stride],
            ..ForwardBatch::default()
        };
        b.query_start_loc.push(0);
        // Cleared by the first row that needs more than its argmax.
        b.argmax_only = true;
        let mut rows = Vec::new();
        let mut placeholders = Vec::new();
        let now = Instant::now();
        for (row, s) in out.scheduled.iter().enumerate() {
            let (Some(req), Some(seq)) = (self.views.reqs.get_mut(&s.request_id), self.views.seqs.get_mut(&s.seq_id)) else {
                debug_assert!(false, "a scheduled sequence has a view");
                continue;
            };
            req.first_scheduled.get_or_insert(now);
            // Drafts the scheduler withdrew (or dropped on a preemption).
            if s.num_draft_tokens == 0 {
                seq.drafts.clear();
            }
            let table = self.block_tables.get(&s.seq_id).map_or(&[][..], Vec::as_slice);
            let (start, end) = (s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens);
            let first_row = b.token_ids.len();
            let known = end.min(seq.tokens.len());
            b.token_ids.extend_from_slice(&seq.tokens[start.min(known)..known]);
            let drafted = (end - known).min(seq.drafts.len());
            b.token_ids.extend_from_slice(&seq.drafts[..drafted]);
            for p in known + drafted..end {
                placeholders.push((b.token_ids.len(), s.seq_id, p));
                b.token_ids.push(0);
            }
            for p in start..end {
                b.positions.push(p as u32);
                for g in 0..groups {
                    let block = table[p / bs * groups + g];
                    // Written positions never lie before the window (the
                    // manager releases only blocks no query sees again).
                    debug_assert!(!block.is_null(), "position {p} of {} lies in a released block of group {g}", s.seq_id);
                    b.slot_mapping[g * num_tokens + first_row + p - start] = block.0 * bs as u32 + (p % bs) as u32;
                }
            }
            let num_prompt = seq.num_prompt;
            if req.params.prompt_logprobs.is_some() && start + 1 < num_prompt {
                // Position p predicts prompt token p + 1.
                for p in start..end.min(num_prompt - 1) {
                    b.logits_indices.push((first_row + p - start) as u32);
                    rows.push(Row::PromptLogprob(s.request_id, p + 1));
                    b.argmax_only = false;
                }
            }
            self.counters.prompt_tokens += end.min(num_prompt).saturating_sub(start) as u64;
            b.query_start_loc.push(b.token_ids.len() as u32);
            b.context_lens.push(end as u32);
            // Entries that slid out of the window are never read: block 0.
            for (j, x) in table.iter().enumerate().filter(|(_, x)| !x.is_null()) {
                b.block_tables[((j % groups) * num_seqs + row) * stride + j / groups] = x.0;
            }
            if let Some(pooling) = req.params.pooling {
                // A pooling request reads hidden states and samples nothing.
                let before = rows.len();
                for p in start..end.min(num_prompt) {
                    if vellum_base::Pooler::wants(pooling.pooling_type, p, num_prompt) {
                        b.logits_indices.push((first_row + p - start) as u32);
                        rows.push(Row::Pool(s.request_id, Some(p)));
                    }
                }
                if rows.len() == before {
                    // A chunk that reads nothing (CLS past position 0)
                    // still returns a row, so that every pooling step has one.
                    b.logits_indices.push(b.token_ids.len() as u32 - 1);
                    rows.push(Row::Pool(s.request_id, None));
                }
                b.hidden_states = true;
            } else if s.samples {
                // Under speculation the positions before each draft are sampled too.
                let last = b.token_ids.len() as u32 - 1;
                for i in 0..s.num_draft_tokens {
                    b.logits_indices.push(last - (s.num_draft_tokens - i) as u32);
                    rows.push(Row::Verify(s.request_id, s.seq_id, i));
                }
                b.logits_indices.push(last);
                rows.push(Row::Sample(s.request_id, s.seq_id));
                b.argmax_only &= req.params.argmax_suffices() && seq.constraint.is_none();
            }
        }
        b.argmax_only &= !rows.is_empty() && !b.hidden_states;
        (b, rows, placeholders)
    }

    /// Fills `b.sampling` when every row can be drawn on the device: a
    /// plain sampling row (no beam search, structured output, drafts to
    /// verify, or first draw of a parallel-sampling request, which draws n
    /// tokens from one row), with at most
    /// [`MAX_DEVICE_TOP_LOGPROBS`] top logprobs and penalties one entry per
    /// token can express. Each row's uniform number is the one the host
    /// sampler would draw next from its request's generator (rows of one
    /// request in order); the generators advance once the tokens are back
    /// ([`EngineCore::sample_on_device`]), so nothing is drawn twice if the
    /// executor returns logits after all.
    pub(super) fn device_sampling_rows(&self, b: &mut ForwardBatch, rows: &[Row]) {
        let mut generators: IdMap<RequestId, SeededRng> = IdMap::default();
        let mut own_generators: IdMap<SeqId, SeededRng> = IdMap::default();
        let (mut sampling, mut penalties) = (Vec::with_capacity(rows.len()), Vec::new());
        for row in rows {
            let Row::Sample(rid, sid) = *row else { return };
            let (Some(req), Some(seq)) = (self.views.reqs.get(&rid), self.views.seqs.get(&sid).filter(|v| v.finish_reason.is_none()))
            else {
                // Ended after the step was scheduled (asynchronous
                // scheduling): a greedy row that draws nothing, dropped.
                sampling.push(RowSampling { top_p: 1.0, ..RowSampling::default() });
                continue;
            };
            let p = &req.params;
            let k = p.logprobs.unwrap_or(0);
            let first_of_many = !req.forked && p.num_sequences() > 1;
            // Parameters the request validation would refuse (the library
            // API does not validate): the host sampler takes them as they are.
            let in_domain = p.temperature >= 0.0 && p.top_p > 0.0 && p.top_p <= 1.0 && (0.0..=1.0).contains(&p.min_p);
            if p.beam_search.is_some()
                || seq.constraint.is_some()
                || !seq.drafts.is_empty()
                || first_of_many
                || k > MAX_DEVICE_TOP_LOGPROBS
                || !in_domain
            {
                return;
            }
            // A request with penalties keeps their history (`SeqView::penalties`).
            let entries = match seq.penalties.as_ref().map(|history| history.entries(p, usize::MAX)) {
                None => Vec::new(),
                Some(Some(e)) => e,
                Some(None) => return, // a bias given twice
            };
            // A forked parallel sequence's own generator, else its request's.
            let uniform = match (&seq.rng, p.temperature > 0.0) {
                (_, false) => 0.0,
                (Some(own), true) => own_generators.entry(sid).or_insert_with(|| own.clone()).uniform(),
                (None, true) => generators.entry(rid).or_insert_with(|| req.rng.clone()).uniform(),
            };
            let start = penalties.len() as u32;
            penalties.extend(entries);
            sampling.push(row_sampling(p, uniform, (start, penalties.len() as u32)));
        }
        b.sampling = sampling;
        b.penalties = penalties;
    }
}
