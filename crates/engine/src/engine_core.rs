//! The engine core (thesis §4.1): schedule → execute → sample → update.

use crate::sampler::{sample, Sample, SeededRng};
use std::collections::VecDeque;
use vellum_core::{
    BlockId, BlockOps, ForwardBatch, IdMap, ModelExecutor, RequestId, SamplingParams, SchedulerConfig, SeqId, TokenId,
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
    /// Generated token ids.
    pub token_ids: Vec<TokenId>,
    /// Per generated position, the top (token, logprob) pairs (if asked).
    pub logprobs: Vec<Vec<(TokenId, f32)>>,
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
    /// One per returned sequence.
    pub outputs: Vec<SequenceOutput>,
}

#[derive(Default)]
struct SeqRecord {
    logprobs: Vec<Vec<(TokenId, f32)>>,
    cumulative: f64,
}

struct ReqRecord {
    rng: SeededRng,
    params: SamplingParams,
}

/// Scheduler + KV-cache manager + executor + sampler, stepping in lockstep.
pub struct EngineCore<E: ModelExecutor> {
    scheduler: Scheduler<KvCacheManager>,
    executor: E,
    block_size: usize,
    /// The executor-side copy of every block table, kept by incremental updates.
    block_tables: IdMap<SeqId, Vec<BlockId>>,
    seq_records: IdMap<SeqId, SeqRecord>,
    /// Records of a parallel-sampling request's first draws, one per
    /// sequence-to-be, assigned once the scheduler has forked them.
    fork_records: IdMap<RequestId, Vec<SeqRecord>>,
    req_records: IdMap<RequestId, ReqRecord>,
    finished: VecDeque<RequestOutput>,
    next_request_id: u64,
    eos_token_ids: Vec<TokenId>,
}

impl<E: ModelExecutor> EngineCore<E> {
    /// An engine over `executor` with `num_blocks` KV blocks of `block_size`.
    pub fn new(
        mut executor: E,
        scheduler_config: SchedulerConfig,
        num_blocks: usize,
        num_host_blocks: usize,
        block_size: usize,
        eos_token_ids: Vec<TokenId>,
    ) -> Result<Self, Error> {
        executor.initialize_kv_cache(num_blocks, num_host_blocks, block_size)?;
        let kv = KvCacheManager::new(vellum_kvcache::KvCacheManagerConfig {
            num_blocks,
            num_host_blocks,
            block_size,
            enable_prefix_caching: true,
        });
        Ok(Self {
            scheduler: Scheduler::new(scheduler_config, kv)?,
            executor,
            block_size,
            block_tables: IdMap::default(),
            seq_records: IdMap::default(),
            fork_records: IdMap::default(),
            req_records: IdMap::default(),
            finished: VecDeque::new(),
            next_request_id: 0,
            eos_token_ids,
        })
    }

    /// The scheduler (read-only: queues, KV accounting).
    pub fn scheduler(&self) -> &Scheduler<KvCacheManager> {
        &self.scheduler
    }

    /// Queues a request; returns its id.
    pub fn add_request(&mut self, prompt_token_ids: Vec<TokenId>, params: SamplingParams) -> Result<RequestId, Error> {
        if params.beam_search.is_some() {
            return Err(Error::Unsupported("beam search in the engine"));
        }
        let id = RequestId(self.next_request_id);
        self.next_request_id += 1;
        let seed = params.seed.unwrap_or(id.0.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        self.scheduler.add_request(NewRequest {
            eos_token_ids: self.eos_token_ids.clone(),
            ..NewRequest::new(id, prompt_token_ids, params.clone())
        })?;
        self.req_records.insert(id, ReqRecord { rng: SeededRng::new(seed), params });
        Ok(id)
    }

    /// Whether any request is unfinished.
    pub fn has_unfinished_requests(&self) -> bool {
        self.scheduler.has_unfinished_requests()
    }

    /// Runs one step; returns requests that finished in it.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>, Error> {
        let out = self.scheduler.schedule();
        for (id, _) in &out.finished_requests {
            self.req_records.remove(id);
        }
        if out.is_empty() {
            self.scheduler.update_from_output(&StepSamples::default());
            return Ok(self.collect_finished());
        }
        let (batch, sampling) = self.build_batch(&out);
        let result = self.executor.execute(&batch)?;
        let samples = self.sample(&result.logits, result.vocab_size, &sampling);
        self.scheduler.update_from_output(&samples);
        // The scheduler forked parallel samples in draw order: parent first.
        let forks: Vec<(RequestId, Vec<SeqRecord>)> = self.fork_records.drain().collect();
        for (rid, recs) in forks {
            match self.scheduler.request(rid) {
                Some(req) => {
                    for (seq, rec) in req.seqs.iter().zip(recs) {
                        self.seq_records.insert(seq.seq_id, rec);
                    }
                }
                None => {
                    self.fork_records.insert(rid, recs); // finished in this step
                }
            }
        }
        Ok(self.collect_finished())
    }

    /// Ends a request from outside (a stop string matched, a client went
    /// away): its blocks are freed now and its output is returned by the
    /// next `step()`.
    pub fn finish_request(&mut self, id: RequestId, reason: vellum_scheduler::FinishReason) -> bool {
        self.scheduler.finish_request(id, reason)
    }

    /// Outputs of requests that finished outside a step (see
    /// [`EngineCore::finish_request`]) and have not been returned yet.
    pub fn take_finished(&mut self) -> Vec<RequestOutput> {
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
        done.extend(self.collect_finished());
        done.sort_by_key(|r| r.request_id);
        Ok(done)
    }

    /// Builds the backend's input from the scheduling decision; also returns,
    /// per logits row, which (request, sequence) it samples for.
    fn build_batch(&mut self, out: &SchedulerOutput) -> (ForwardBatch, Vec<(RequestId, SeqId)>) {
        for u in &out.block_table_updates {
            let t = self.block_tables.entry(u.seq_id).or_default();
            t.truncate(u.start);
            t.extend_from_slice(&u.block_ids);
        }
        let bs = self.block_size;
        let stride = out.scheduled.iter().map(|s| self.block_tables.get(&s.seq_id).map_or(0, Vec::len)).max().unwrap_or(0);
        let mut b = ForwardBatch { block_table_stride: stride, block_ops: BlockOps::default(), ..ForwardBatch::default() };
        b.block_ops = out.block_ops.clone();
        b.query_start_loc.push(0);
        let mut sampling = Vec::new();
        for s in &out.scheduled {
            let req = self.scheduler.request(s.request_id).expect("scheduled request is live");
            let seq = req.seqs.iter().find(|q| q.seq_id == s.seq_id).expect("scheduled sequence exists");
            let table = &self.block_tables[&s.seq_id];
            let (start, end) = (s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens);
            b.token_ids.extend_from_slice(&seq.state.token_ids()[start..end]);
            for p in start..end {
                b.positions.push(p as u32);
                b.slot_mapping.push(table[p / bs].0 * bs as u32 + (p % bs) as u32);
            }
            b.query_start_loc.push(b.token_ids.len() as u32);
            b.context_lens.push(end as u32);
            b.block_tables.extend(table.iter().map(|x| x.0));
            b.block_tables.extend(std::iter::repeat_n(0, stride - table.len()));
            if s.samples {
                b.logits_indices.push(b.token_ids.len() as u32 - 1);
                sampling.push((s.request_id, s.seq_id));
            }
        }
        (b, sampling)
    }

    fn sample(&mut self, logits: &[f32], vocab: usize, sampling: &[(RequestId, SeqId)]) -> StepSamples {
        let mut per_req: Vec<RequestSamples> = Vec::new();
        for (row, &(rid, sid)) in sampling.iter().enumerate() {
            let rec = self.req_records.get_mut(&rid).expect("live request has a record");
            let row_logits = &logits[row * vocab..(row + 1) * vocab];
            let req = self.scheduler.request(rid).expect("live");
            let seq = req.seqs.iter().find(|q| q.seq_id == sid).expect("sampling sequence exists");
            let history = (seq.state.prompt_token_ids(), seq.state.output_token_ids());
            // The first sample of a parallel-sampling request draws n tokens.
            let draws = if req.seqs.len() == 1 && rec.params.n > 1 { rec.params.n } else { 1 };
            let k = rec.params.logprobs.unwrap_or(0);
            let mut next = Vec::with_capacity(draws);
            let mut first_draws = Vec::new();
            for _ in 0..draws {
                let Sample { token, logprob, top_logprobs } = sample(row_logits, &rec.params, &mut rec.rng, k, history);
                next.push((sid, token));
                let logprobs = if rec.params.logprobs.is_some() { vec![top_logprobs] } else { Vec::new() };
                if draws == 1 {
                    let r = self.seq_records.entry(sid).or_default();
                    r.cumulative += logprob as f64;
                    r.logprobs.extend(logprobs);
                } else {
                    first_draws.push(SeqRecord { logprobs, cumulative: logprob as f64 });
                }
            }
            if !first_draws.is_empty() {
                self.fork_records.insert(rid, first_draws);
            }
            match per_req.last_mut() {
                Some(last) if last.request_id == rid => last.next.extend(next),
                _ => per_req.push(RequestSamples::tokens(rid, next)),
            }
        }
        StepSamples { requests: per_req }
    }

    fn collect_finished(&mut self) -> Vec<RequestOutput> {
        for req in self.scheduler.take_finished_requests() {
            self.req_records.remove(&req.request_id);
            if let Some(recs) = self.fork_records.remove(&req.request_id) {
                for (seq, rec) in req.seqs.iter().zip(recs) {
                    self.seq_records.insert(seq.seq_id, rec);
                }
            }
            let prompt = req.seqs[0].state.prompt_token_ids().to_vec();
            let outputs = req
                .seqs
                .iter()
                .map(|s| {
                    self.block_tables.remove(&s.seq_id);
                    let rec = self.seq_records.remove(&s.seq_id).unwrap_or_default();
                    SequenceOutput {
                        token_ids: s.state.output_token_ids().to_vec(),
                        logprobs: rec.logprobs,
                        cumulative_logprob: rec.cumulative,
                        finish_reason: s.finish_reason,
                    }
                })
                .collect();
            self.finished.push_back(RequestOutput { request_id: req.request_id, prompt_token_ids: prompt, outputs });
        }
        self.finished.drain(..).collect()
    }
}
