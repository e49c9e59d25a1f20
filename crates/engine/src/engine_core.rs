//! The engine core (thesis §4.1): schedule → execute → sample → update.

use crate::sampler::{log_softmax, sample, top_k, Sample, SeededRng};
use std::collections::VecDeque;
use std::time::Instant;
use vellum_core::{
    BlockId, ForwardBatch, IdMap, ModelExecutor, RequestId, SamplingParams, SchedulerConfig, SeqId, TokenId,
};
use vellum_kvcache::KvCacheManager;
use vellum_scheduler::{NewRequest, RequestSamples, Scheduler, SchedulerOutput, StepSamples};

/// Why the engine refused or failed something.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request was refused.
    #[error(transparent)]
    Request(#[from] vellum_scheduler::Error),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] vellum_core::Error),
    /// Loading the model failed.
    #[error(transparent)]
    Model(#[from] vellum_models::Error),
    /// A feature this engine does not run yet.
    #[error("not supported yet: {0}")]
    Unsupported(&'static str),
}

/// What a finished sequence produced.
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceOutput {
    /// Its place among the request's outputs (`0..n`).
    pub index: usize,
    /// Detokenized text, stop string cut (filled by [`crate::Llm`] and the
    /// server; the engine core itself is token-only and leaves it empty).
    pub text: String,
    /// Generated token ids.
    pub token_ids: Vec<TokenId>,
    /// Per generated position, the top (token, logprob) pairs (if asked).
    pub logprobs: Vec<Vec<(TokenId, f32)>>,
    /// Log-probability of each generated token.
    pub token_logprobs: Vec<f32>,
    /// Sum of the chosen tokens' log-probabilities.
    pub cumulative_logprob: f64,
    /// `stop` or `length`.
    pub finish_reason: Option<vellum_scheduler::FinishReason>,
}

/// A finished request.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutput {
    /// The request.
    pub request_id: RequestId,
    /// Prompt token ids.
    pub prompt_token_ids: Vec<TokenId>,
    /// Per prompt position (if asked): the prompt token's own logprob and
    /// the top alternatives; `None` at position 0, which nothing predicts.
    pub prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
    /// One per returned sequence, ordered by `index`.
    pub outputs: Vec<SequenceOutput>,
    /// Seconds from `add_request` to the first step that computed any of
    /// its tokens (vLLM's queue time); `None` if it never ran.
    pub queue_time_s: Option<f64>,
}

/// The log-probability of one prompt token given the tokens before it.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLogprob {
    /// The prompt token.
    pub token_id: TokenId,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens at that position, most likely first.
    pub top: Vec<(TokenId, f32)>,
}

/// Tokens one sequence produced in one step (streaming).
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceDelta {
    /// The request.
    pub request_id: RequestId,
    /// The sequence's `index` among the request's outputs.
    pub index: usize,
    /// New tokens since the last delta.
    pub token_ids: Vec<TokenId>,
    /// Their top logprobs (empty unless asked).
    pub logprobs: Vec<Vec<(TokenId, f32)>>,
    /// Log-probabilities of the new tokens themselves.
    pub token_logprobs: Vec<f32>,
}

/// What one step produced: new tokens of live sequences, and the requests
/// that finished.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutputs {
    /// New tokens of sequences still running, or finished in this step.
    /// Beam-search requests emit none (their candidates change until the end).
    pub deltas: Vec<SequenceDelta>,
    /// Requests that finished.
    pub finished: Vec<RequestOutput>,
}

/// Running totals of what the engine did (for metrics and benchmarks).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineCounters {
    /// Steps run.
    pub num_steps: u64,
    /// Prompt tokens computed (prefix-cache hits excluded).
    pub prompt_tokens: u64,
    /// Tokens sampled.
    pub generation_tokens: u64,
    /// Seconds spent in `schedule()` and building the batch.
    pub schedule_s: f64,
    /// Seconds spent in the executor.
    pub execute_s: f64,
    /// Seconds spent sampling and applying samples.
    pub sample_s: f64,
}

/// Engine-side state of one sequence.
#[derive(Clone, Default)]
struct SeqRecord {
    /// Place among the request's outputs (draw order for parallel samples).
    index: usize,
    /// Output tokens already reported in deltas.
    reported: usize,
    logprobs: Vec<Vec<(TokenId, f32)>>,
    token_logprobs: Vec<f32>,
    cumulative: f64,
}

impl SeqRecord {
    fn push(&mut self, logprob: f32, top: Option<Vec<(TokenId, f32)>>) {
        self.cumulative += logprob as f64;
        self.token_logprobs.push(logprob);
        self.logprobs.extend(top);
    }
}

struct ReqRecord {
    rng: SeededRng,
    params: SamplingParams,
    /// Per prompt position; filled as prompt chunks are computed.
    prompt_logprobs: Option<Vec<Option<PromptLogprob>>>,
    arrival: Instant,
    first_scheduled: Option<Instant>,
}

/// Records of sequences the scheduler is about to fork (or a beam search to
/// reshape), assigned once `update_from_output` made them: `parents` keep
/// their ids, `children` become the request's last sequences, in order.
#[derive(Default)]
struct PendingRecords {
    parents: Vec<(SeqId, SeqRecord)>,
    children: Vec<SeqRecord>,
}

/// What a row of the executor's logits is for.
#[derive(Clone, Copy)]
enum Row {
    /// Sample the sequence's next token.
    Sample(RequestId, SeqId),
    /// The logprob of prompt token `pos` (the row is position `pos - 1`).
    PromptLogprob(RequestId, usize),
}

/// Scheduler + KV-cache manager + executor + sampler, stepping in lockstep.
pub struct EngineCore<E: ModelExecutor> {
    scheduler: Scheduler<KvCacheManager>,
    executor: E,
    block_size: usize,
    /// The executor-side copy of every block table, kept by incremental updates.
    block_tables: IdMap<SeqId, Vec<BlockId>>,
    seq_records: IdMap<SeqId, SeqRecord>,
    /// Records of sequences about to be forked or reshaped (parallel
    /// samples' first draws, beam candidates).
    pending: IdMap<RequestId, PendingRecords>,
    req_records: IdMap<RequestId, ReqRecord>,
    finished: VecDeque<RequestOutput>,
    next_request_id: u64,
    eos_token_ids: Vec<TokenId>,
    counters: EngineCounters,
    /// Unreported tails of sequences that finished (streaming).
    final_deltas: Vec<SequenceDelta>,
}

impl<E: ModelExecutor> EngineCore<E> {
    /// An engine over `executor` with `num_blocks` KV blocks of `block_size`
    /// (and `num_host_blocks` of swap space), prefix caching on.
    pub fn new(
        executor: E,
        scheduler_config: SchedulerConfig,
        num_blocks: usize,
        num_host_blocks: usize,
        block_size: usize,
        eos_token_ids: Vec<TokenId>,
    ) -> Result<Self, Error> {
        Self::with_prefix_caching(executor, scheduler_config, num_blocks, num_host_blocks, block_size, eos_token_ids, true)
    }

    /// As [`EngineCore::new`], with automatic prefix caching on or off.
    pub fn with_prefix_caching(
        mut executor: E,
        scheduler_config: SchedulerConfig,
        num_blocks: usize,
        num_host_blocks: usize,
        block_size: usize,
        eos_token_ids: Vec<TokenId>,
        enable_prefix_caching: bool,
    ) -> Result<Self, Error> {
        executor.initialize_kv_cache(num_blocks, num_host_blocks, block_size)?;
        let kv = KvCacheManager::new(vellum_kvcache::KvCacheManagerConfig {
            num_blocks,
            num_host_blocks,
            block_size,
            enable_prefix_caching,
        });
        Ok(Self {
            scheduler: Scheduler::new(scheduler_config, kv)?,
            executor,
            block_size,
            block_tables: IdMap::default(),
            seq_records: IdMap::default(),
            pending: IdMap::default(),
            req_records: IdMap::default(),
            finished: VecDeque::new(),
            next_request_id: 0,
            eos_token_ids,
            counters: EngineCounters::default(),
            final_deltas: Vec::new(),
        })
    }

    /// Running totals (steps, tokens, time per phase).
    pub fn counters(&self) -> EngineCounters {
        self.counters
    }

    /// The scheduler (read-only: queues, KV accounting).
    pub fn scheduler(&self) -> &Scheduler<KvCacheManager> {
        &self.scheduler
    }

    /// Queues a request; returns its id.
    pub fn add_request(&mut self, prompt_token_ids: Vec<TokenId>, params: SamplingParams) -> Result<RequestId, Error> {
        self.add_request_with_priority(prompt_token_ids, params, 0)
    }

    /// Queues a request with a priority (lower runs first under the
    /// priority policy); returns its id.
    pub fn add_request_with_priority(
        &mut self,
        prompt_token_ids: Vec<TokenId>,
        params: SamplingParams,
        priority: i64,
    ) -> Result<RequestId, Error> {
        let id = RequestId(self.next_request_id);
        self.next_request_id += 1;
        let seed = params.seed.unwrap_or(id.0.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let num_prompt = prompt_token_ids.len();
        self.scheduler.add_request(NewRequest {
            eos_token_ids: self.eos_token_ids.clone(),
            priority,
            ..NewRequest::new(id, prompt_token_ids, params.clone())
        })?;
        let prompt_logprobs = params.prompt_logprobs.map(|_| vec![None; num_prompt]);
        self.req_records.insert(id, ReqRecord { rng: SeededRng::new(seed), params, prompt_logprobs, arrival: Instant::now(), first_scheduled: None });
        Ok(id)
    }

    /// Whether any request is unfinished.
    pub fn has_unfinished_requests(&self) -> bool {
        self.scheduler.has_unfinished_requests()
    }

    /// Runs one step; returns requests that finished in it.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>, Error> {
        Ok(self.step_streaming()?.finished)
    }

    /// Runs one step; returns the new tokens of every sampled sequence and
    /// the requests that finished.
    pub fn step_streaming(&mut self) -> Result<StepOutputs, Error> {
        let t0 = Instant::now();
        let out = self.scheduler.schedule();
        for (id, _) in &out.finished_requests {
            self.req_records.remove(id);
        }
        if out.is_empty() {
            self.scheduler.update_from_output(&StepSamples::default());
            return Ok(StepOutputs { deltas: Vec::new(), finished: self.collect_finished() });
        }
        let (batch, rows) = self.build_batch(&out);
        let t1 = Instant::now();
        let result = self.executor.execute(&batch)?;
        let t2 = Instant::now();
        let samples = self.sample(&result.logits, result.vocab_size, &rows);
        self.scheduler.update_from_output(&samples);
        // Forks and beam candidates now exist: give them their records.
        let pending: Vec<(RequestId, PendingRecords)> = self.pending.drain().collect();
        for (rid, recs) in pending {
            match self.scheduler.request(rid) {
                Some(req) => assign_records(&mut self.seq_records, &req.seqs, recs),
                None => {
                    self.pending.insert(rid, recs); // finished in this step
                }
            }
        }
        let mut deltas = Vec::new();
        for rs in &samples.requests {
            if let Some(req) = self.scheduler.request(rs.request_id) {
                if req.params.beam_search.is_none() {
                    for seq in &req.seqs {
                        if let Some(d) = delta(&mut self.seq_records, rs.request_id, seq.seq_id, seq.state.output_token_ids()) {
                            deltas.push(d);
                        }
                    }
                }
            }
        }
        let finished = self.collect_finished();
        deltas.append(&mut self.final_deltas);
        let t3 = Instant::now();
        let c = &mut self.counters;
        c.num_steps += 1;
        c.schedule_s += (t1 - t0).as_secs_f64();
        c.execute_s += (t2 - t1).as_secs_f64();
        c.sample_s += (t3 - t2).as_secs_f64();
        Ok(StepOutputs { deltas, finished })
    }

    /// Ends a request from outside (a stop string matched, a client went
    /// away): its blocks are freed now and its output is returned by the
    /// next `step()`.
    pub fn finish_request(&mut self, id: RequestId, reason: vellum_scheduler::FinishReason) -> bool {
        self.scheduler.finish_request(id, reason)
    }

    /// Ends one output sequence (`index`) of a request, e.g. when a stop
    /// string matched in one of several parallel samples; the request ends
    /// with its last sequence.
    pub fn finish_sequence(&mut self, id: RequestId, index: usize, reason: vellum_scheduler::FinishReason) -> bool {
        let Some(req) = self.scheduler.request(id) else { return false };
        let sid = req.seqs.iter().map(|s| s.seq_id).find(|sid| self.seq_records.get(sid).map_or(index == 0, |r| r.index == index));
        sid.is_some_and(|sid| self.scheduler.finish_sequence(id, sid, reason))
    }

    /// Outputs of requests that finished outside a step (see
    /// [`EngineCore::finish_request`]) and have not been returned yet.
    pub fn take_finished(&mut self) -> Vec<RequestOutput> {
        self.final_deltas.clear();
        self.collect_finished()
    }

    /// Generated tokens of a live request's first sequence.
    pub fn output_token_ids(&self, id: RequestId) -> Option<&[TokenId]> {
        self.scheduler.request(id).map(|r| r.seqs[0].state.output_token_ids())
    }

    /// Runs until every queued request finished; outputs in request order.
    pub fn run_to_completion(&mut self) -> Result<Vec<RequestOutput>, Error> {
        let mut done = Vec::new();
        while self.has_unfinished_requests() {
            done.extend(self.step()?);
        }
        done.extend(self.take_finished());
        done.sort_by_key(|r| r.request_id);
        Ok(done)
    }

    /// Builds the backend's input from the scheduling decision; also returns
    /// what each logits row is for.
    fn build_batch(&mut self, out: &SchedulerOutput) -> (ForwardBatch, Vec<Row>) {
        for u in &out.block_table_updates {
            let t = self.block_tables.entry(u.seq_id).or_default();
            t.truncate(u.start);
            t.extend_from_slice(&u.block_ids);
        }
        let bs = self.block_size;
        let stride = out.scheduled.iter().map(|s| self.block_tables.get(&s.seq_id).map_or(0, Vec::len)).max().unwrap_or(0);
        let mut b = ForwardBatch { block_table_stride: stride, block_ops: out.block_ops.clone(), ..ForwardBatch::default() };
        b.query_start_loc.push(0);
        let mut rows = Vec::new();
        let now = Instant::now();
        for s in &out.scheduled {
            if let Some(rec) = self.req_records.get_mut(&s.request_id) {
                rec.first_scheduled.get_or_insert(now);
            }
            let req = self.scheduler.request(s.request_id).expect("scheduled request is live");
            let seq = req.seqs.iter().find(|q| q.seq_id == s.seq_id).expect("scheduled sequence exists");
            let table = &self.block_tables[&s.seq_id];
            let (start, end) = (s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens);
            let first_row = b.token_ids.len();
            b.token_ids.extend_from_slice(&seq.state.token_ids()[start..end]);
            for p in start..end {
                b.positions.push(p as u32);
                b.slot_mapping.push(table[p / bs].0 * bs as u32 + (p % bs) as u32);
            }
            let num_prompt = seq.state.num_prompt_tokens();
            if req.params.prompt_logprobs.is_some() && start + 1 < num_prompt {
                // Position p predicts prompt token p + 1.
                for p in start..end.min(num_prompt - 1) {
                    b.logits_indices.push((first_row + p - start) as u32);
                    rows.push(Row::PromptLogprob(s.request_id, p + 1));
                }
            }
            self.counters.prompt_tokens += end.min(num_prompt).saturating_sub(start) as u64;
            b.query_start_loc.push(b.token_ids.len() as u32);
            b.context_lens.push(end as u32);
            b.block_tables.extend(table.iter().map(|x| x.0));
            b.block_tables.extend(std::iter::repeat_n(0, stride - table.len()));
            if s.samples {
                b.logits_indices.push(b.token_ids.len() as u32 - 1);
                rows.push(Row::Sample(s.request_id, s.seq_id));
            }
        }
        (b, rows)
    }

    fn sample(&mut self, logits: &[f32], vocab: usize, rows: &[Row]) -> StepSamples {
        let mut per_req: Vec<RequestSamples> = Vec::new();
        let mut beam_rows: Vec<(RequestId, SeqId, usize)> = Vec::new();
        for (row, &use_) in rows.iter().enumerate() {
            let row_logits = &logits[row * vocab..(row + 1) * vocab];
            let (rid, sid) = match use_ {
                Row::PromptLogprob(rid, pos) => {
                    self.record_prompt_logprob(rid, pos, row_logits);
                    continue;
                }
                Row::Sample(rid, sid) => (rid, sid),
            };
            let req = self.scheduler.request(rid).expect("live");
            if req.params.beam_search.is_some() {
                beam_rows.push((rid, sid, row));
                continue;
            }
            let rec = self.req_records.get_mut(&rid).expect("live request has a record");
            let seq = req.seqs.iter().find(|q| q.seq_id == sid).expect("sampling sequence exists");
            let history = (seq.state.prompt_token_ids(), seq.state.output_token_ids());
            // The first sample of a parallel-sampling request draws n tokens.
            let draws = if req.seqs.len() == 1 && rec.params.num_sequences() > 1 { rec.params.num_sequences() } else { 1 };
            let k = rec.params.logprobs.unwrap_or(0);
            let mut next = Vec::with_capacity(draws);
            let mut pending = PendingRecords::default();
            for i in 0..draws {
                let Sample { token, logprob, top_logprobs } = sample(row_logits, &rec.params, &mut rec.rng, k, history);
                next.push((sid, token));
                let top = rec.params.logprobs.is_some().then_some(top_logprobs);
                if draws == 1 {
                    self.seq_records.entry(sid).or_default().push(logprob, top);
                } else {
                    let mut r = SeqRecord { index: i, ..SeqRecord::default() };
                    r.push(logprob, top);
                    if i == 0 {
                        pending.parents.push((sid, r));
                    } else {
                        pending.children.push(r);
                    }
                }
            }
            if draws > 1 {
                self.pending.insert(rid, pending);
            }
            self.counters.generation_tokens += draws as u64;
            push_samples(&mut per_req, rid, next);
        }
        // Beam search: every running candidate of a request was scheduled
        // together; choose the next candidates over all of them.
        let mut i = 0;
        while i < beam_rows.len() {
            let rid = beam_rows[i].0;
            let j = i + beam_rows[i..].iter().take_while(|r| r.0 == rid).count();
            let next = self.beam_step(rid, &beam_rows[i..j], logits, vocab);
            self.counters.generation_tokens += next.len() as u64;
            per_req.push(RequestSamples::tokens(rid, next));
            i = j;
        }
        StepSamples { requests: per_req }
    }

    fn record_prompt_logprob(&mut self, rid: RequestId, pos: usize, row_logits: &[f32]) {
        let Some(req) = self.scheduler.request(rid) else { return };
        let token_id = req.seqs[0].state.prompt_token_ids()[pos];
        let Some(rec) = self.req_records.get_mut(&rid) else { return };
        let k = rec.params.prompt_logprobs.unwrap_or(0);
        let Some(slots) = rec.prompt_logprobs.as_mut() else { return };
        if slots[pos].is_some() {
            return; // recomputed after a preemption
        }
        let lp = log_softmax(row_logits);
        slots[pos] = Some(PromptLogprob { token_id, logprob: lp[token_id as usize], top: top_k(&lp, k) });
    }

    /// One beam-search step (paper §4.4): each of the `rows` candidates
    /// proposes its `2W` best continuations; the best `W` that do not end
    /// the sequence go on, those that end it (EOS) and rank within the first
    /// `W` become finished hypotheses. When `W` hypotheses are finished and
    /// none of the running ones scores better (length-normalised), the
    /// search ends: an empty sample list tells the scheduler so.
    fn beam_step(&mut self, rid: RequestId, rows: &[(RequestId, SeqId, usize)], logits: &[f32], vocab: usize) -> Vec<(SeqId, TokenId)> {
        let req = self.scheduler.request(rid).expect("live");
        let rec = &self.req_records[&rid];
        let beam = rec.params.beam_search.clone().expect("beam request");
        let w = beam.beam_width;
        let k = rec.params.logprobs.unwrap_or(0);
        let min_tokens = rec.params.min_tokens;
        let stops: Vec<TokenId> = if rec.params.ignore_eos { Vec::new() } else { req.eos_token_ids.clone() }
            .into_iter()
            .chain(rec.params.stop_token_ids.iter().copied())
            .collect();
        // (score, parent, token, logprob, row)
        let mut cands: Vec<(f64, SeqId, TokenId, f32, usize)> = Vec::with_capacity(rows.len() * 2 * w);
        let mut tops: IdMap<SeqId, Vec<(TokenId, f32)>> = IdMap::default();
        let mut out_len = 0;
        for &(_, sid, row) in rows {
            let lp = log_softmax(&logits[row * vocab..(row + 1) * vocab]);
            let base = self.seq_records.get(&sid).map_or(0.0, |r| r.cumulative);
            let seq = req.seqs.iter().find(|q| q.seq_id == sid).expect("beam exists");
            out_len = seq.state.output_token_ids().len();
            let may_stop = out_len >= min_tokens;
            for (tok, l) in top_k(&lp, 2 * w + stops.len()) {
                if !may_stop && stops.contains(&tok) {
                    continue;
                }
                cands.push((base + l as f64, sid, tok, l, row));
            }
            if k > 0 {
                tops.insert(sid, top_k(&lp, k));
            }
        }
        cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.2.cmp(&b.2)));
        let new_len = out_len + 1;
        let score = |cum: f64, len: usize| cum / (len.max(1) as f64).powf(beam.length_penalty as f64);
        let mut finished_scores: Vec<f64> = req
            .seqs
            .iter()
            .filter(|s| !s.is_running())
            .map(|s| score(self.seq_records.get(&s.seq_id).map_or(0.0, |r| r.cumulative), s.state.output_token_ids().len()))
            .collect();
        let mut next = Vec::new();
        let mut chosen: Vec<(SeqId, SeqRecord)> = Vec::new();
        let mut num_running = 0;
        for (rank, &(cum, parent, tok, l, _)) in cands.iter().enumerate() {
            let ends = stops.contains(&tok);
            if ends && rank >= w {
                continue;
            }
            if !ends && num_running == w {
                continue;
            }
            let mut r = self.seq_records.get(&parent).cloned().unwrap_or_default();
            r.push(l, (k > 0).then(|| tops.get(&parent).cloned().unwrap_or_default()));
            debug_assert!((r.cumulative - cum).abs() < 1e-9);
            if ends {
                finished_scores.push(score(cum, new_len));
            } else {
                num_running += 1;
            }
            next.push((parent, tok));
            chosen.push((parent, r));
            if num_running == w {
                break;
            }
        }
        // Stop early once no running candidate can beat the W best finished.
        finished_scores.sort_by(|a, b| b.total_cmp(a));
        let best_running = chosen
            .iter()
            .zip(&next)
            .filter(|(_, (_, t))| !stops.contains(t))
            .map(|((_, r), _)| score(r.cumulative, new_len))
            .fold(f64::NEG_INFINITY, f64::max);
        let done = finished_scores.len() >= w && finished_scores[w - 1] >= best_running;
        if done {
            // Only this step's finished hypotheses go on (to be ranked); the
            // running candidates are dropped.
            let keep: Vec<bool> = next.iter().map(|(_, t)| stops.contains(t)).collect();
            let mut it = keep.iter();
            next.retain(|_| *it.next().expect("same length"));
            let mut it = keep.iter();
            chosen.retain(|_| *it.next().expect("same length"));
        }
        // Parents not extended are dropped by the scheduler: forget them.
        for &(_, sid, _) in rows {
            if !next.iter().any(|n| n.0 == sid) {
                self.seq_records.remove(&sid);
            }
        }
        let mut pending = PendingRecords::default();
        let mut seen: Vec<SeqId> = Vec::new();
        for (parent, r) in chosen {
            if seen.contains(&parent) {
                pending.children.push(r);
            } else {
                seen.push(parent);
                pending.parents.push((parent, r));
            }
        }
        self.pending.insert(rid, pending);
        next
    }

    fn collect_finished(&mut self) -> Vec<RequestOutput> {
        for req in self.scheduler.take_finished_requests() {
            let rec = self.req_records.remove(&req.request_id);
            if let Some(recs) = self.pending.remove(&req.request_id) {
                assign_records(&mut self.seq_records, &req.seqs, recs);
            }
            let prompt = req.seqs[0].state.prompt_token_ids().to_vec();
            let mut outputs: Vec<(f64, SequenceOutput, usize)> = req
                .seqs
                .iter()
                .map(|s| {
                    self.block_tables.remove(&s.seq_id);
                    let rec = self.seq_records.remove(&s.seq_id).unwrap_or_default();
                    let out = SequenceOutput {
                        index: rec.index,
                        text: String::new(),
                        token_ids: s.state.output_token_ids().to_vec(),
                        logprobs: rec.logprobs,
                        token_logprobs: rec.token_logprobs,
                        cumulative_logprob: rec.cumulative,
                        finish_reason: s.finish_reason,
                    };
                    (rec.cumulative, out, rec.reported)
                })
                .collect();
            let n = req.params.n;
            if let Some(beam) = &req.params.beam_search {
                // Best `n` hypotheses by length-normalised score.
                let lp = beam.length_penalty as f64;
                for o in &mut outputs {
                    o.0 = o.1.cumulative_logprob / (o.1.token_ids.len().max(1) as f64).powf(lp);
                }
                outputs.sort_by(|a, b| b.0.total_cmp(&a.0));
                outputs.truncate(n);
                for (i, o) in outputs.iter_mut().enumerate() {
                    o.1.index = i;
                }
            } else if req.params.num_sequences() > n {
                // best_of: the `n` with the highest cumulative logprob.
                outputs.sort_by(|a, b| b.0.total_cmp(&a.0));
                outputs.truncate(n);
                for (i, o) in outputs.iter_mut().enumerate() {
                    o.1.index = i;
                }
            } else {
                outputs.sort_by_key(|o| o.1.index);
                for (_, o, reported) in &outputs {
                    if *reported < o.token_ids.len() {
                        let d = tail(req.request_id, o.index, *reported, &o.token_ids, &o.logprobs, &o.token_logprobs);
                        self.final_deltas.push(d);
                    }
                }
            }
            let queue_time_s = rec.as_ref().and_then(|r| r.first_scheduled.map(|t| (t - r.arrival).as_secs_f64()));
            self.finished.push_back(RequestOutput {
                request_id: req.request_id,
                prompt_token_ids: prompt,
                queue_time_s,
                prompt_logprobs: rec.and_then(|r| r.prompt_logprobs),
                outputs: outputs.into_iter().map(|o| o.1).collect(),
            });
        }
        self.finished.drain(..).collect()
    }
}

fn push_samples(per_req: &mut Vec<RequestSamples>, rid: RequestId, next: Vec<(SeqId, TokenId)>) {
    match per_req.last_mut() {
        Some(last) if last.request_id == rid => last.next.extend(next),
        _ => per_req.push(RequestSamples::tokens(rid, next)),
    }
}

/// Gives forked or reshaped sequences their records (see [`PendingRecords`]).
fn assign_records(records: &mut IdMap<SeqId, SeqRecord>, seqs: &[vellum_scheduler::Sequence], recs: PendingRecords) {
    for (sid, rec) in recs.parents {
        if seqs.iter().any(|s| s.seq_id == sid) {
            records.insert(sid, rec);
        }
    }
    let first_child = seqs.len().saturating_sub(recs.children.len());
    for (seq, rec) in seqs[first_child..].iter().zip(recs.children) {
        records.insert(seq.seq_id, rec);
    }
}

/// New output tokens of a sequence since its last delta.
fn delta(records: &mut IdMap<SeqId, SeqRecord>, rid: RequestId, sid: SeqId, output: &[TokenId]) -> Option<SequenceDelta> {
    let rec = records.get_mut(&sid)?;
    if rec.reported >= output.len() {
        return None;
    }
    let from = rec.reported;
    rec.reported = output.len();
    Some(tail(rid, rec.index, from, output, &rec.logprobs, &rec.token_logprobs))
}

/// A sequence's tokens (and their logprobs) from position `from` on.
fn tail(
    rid: RequestId,
    index: usize,
    from: usize,
    tokens: &[TokenId],
    logprobs: &[Vec<(TokenId, f32)>],
    token_logprobs: &[f32],
) -> SequenceDelta {
    SequenceDelta {
        request_id: rid,
        index,
        token_ids: tokens[from..].to_vec(),
        logprobs: logprobs.get(from..).map(<[_]>::to_vec).unwrap_or_default(),
        token_logprobs: token_logprobs.get(from..).map(<[_]>::to_vec).unwrap_or_default(),
    }
}
