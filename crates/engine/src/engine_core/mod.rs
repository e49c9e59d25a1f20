//! The engine core (thesis §4.1): schedule → execute → sample → update.
//!
//! One [`EngineCore::step_streaming`]: `scheduler.schedule()` → the
//! [`vellum_base::ForwardBatch`] built from the engine's own view of the scheduled
//! sequences (`batch.rs`) → `executor.execute` → a token per sampling
//! row (`sampling.rs`; beam search in [`crate::beam`]) → `update_from_output`,
//! whose [`vellum_scheduler::StepUpdate`] the view applies
//! ([`crate::sequences`]) → the new tokens of every sequence and the
//! finished requests ([`crate::outputs`]).
//!
//! Under asynchronous scheduling ([`EngineCore::set_async_scheduling`]) a
//! helper thread schedules and builds the next step (`Prepared`) while this
//! one runs the current step's forward pass; the next call completes it
//! (`finalize`: the tokens sampled meanwhile) and runs it.

mod batch;
mod sampling;

use batch::Row;

use crate::error::Error;
use crate::outputs::{RequestOutput, SequenceDelta, StepOutputs};
use crate::sequences::Sequences;
use crate::speculative::{DraftRequest, Proposer, SpecDecodeCounters, Speculator};
use crate::structured::StructuredOutputs;
use std::sync::Arc;
use std::time::Instant;
use vellum_base::{
    BlockAllocator, BlockId, IdMap, KvCacheStats, ModelExecutor, RequestId, SamplingParams, SchedulerConfig, SeqId, TokenId,
};
use vellum_kvcache::KvCacheManager;
use vellum_scheduler::{FinishReason, NewRequest, Scheduler, StepSamples};

/// Requests per queue, and preemptions so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Requests running (holding KV blocks).
    pub num_running: usize,
    /// Requests waiting (new, or preempted by recompute).
    pub num_waiting: usize,
    /// Requests swapped out to host memory.
    pub num_swapped: usize,
    /// Preemptions so far.
    pub num_preemptions: u64,
}

/// `f()` and the seconds it took.
fn timed<R>(f: impl FnOnce() -> R) -> (R, f64) {
    let started = Instant::now();
    let r = f();
    (r, started.elapsed().as_secs_f64())
}

/// Upper bounds (seconds) of [`StepTimes`]' buckets.
pub const STEP_SECONDS_BUCKETS: [f64; 14] = [0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0];

/// The executor's own seconds of steps (the forward pass alone, not the
/// work beside it), bucketed: how long the slowest steps took, which the
/// means of [`EngineCounters`] do not say (a tail of inter-token gaps is a
/// tail of steps, or of what comes after them).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTimes {
    /// Steps of at most each bound of [`STEP_SECONDS_BUCKETS`] and above
    /// the one before (the last entry: above every bound).
    pub counts: [u64; STEP_SECONDS_BUCKETS.len() + 1],
    /// Their seconds together.
    pub sum_s: f64,
}

impl StepTimes {
    /// Counts a step of `seconds`.
    pub fn observe(&mut self, seconds: f64) {
        let at = STEP_SECONDS_BUCKETS.iter().position(|&b| seconds <= b).unwrap_or(STEP_SECONDS_BUCKETS.len());
        self.counts[at] += 1;
        self.sum_s += seconds;
    }

    /// Steps counted.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
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
    /// Of `sample_s`, seconds spent computing structured-output masks.
    pub structured_mask_s: f64,
    /// Of `schedule_s`, seconds spent scheduling and building a step while
    /// the previous one ran (asynchronous scheduling).
    pub schedule_overlapped_s: f64,
    /// Of `num_steps`, the uniform decode steps
    /// ([`vellum_base::ForwardBatch::is_uniform_decode`]: one token and one
    /// logits row a sequence, the steps a GPU backend can replay as CUDA
    /// graphs); the others carry more than one token for some sequence
    /// (prompt chunks, speculative verifications) or pool.
    pub decode_steps: u64,
    /// Of `execute_s`, the seconds of those uniform decode steps.
    pub decode_execute_s: f64,
    /// The executor's seconds of each uniform decode step, bucketed.
    pub decode_step_times: StepTimes,
    /// The executor's seconds of each other step, bucketed.
    pub other_step_times: StepTimes,
}

/// Scheduler + KV-cache manager + executor + sampler, stepping in lockstep.
///
/// The engine keeps its own view of every request and sequence
/// (`sequences.rs`): what it added, what it sampled, and the diffs
/// `update_from_output` returns; it never reads the scheduler's request
/// objects.
pub struct EngineCore<E: ModelExecutor> {
    scheduler: Scheduler<KvCacheManager>,
    /// `None` only inside an asynchronous step, while it runs a forward pass.
    executor: Option<E>,
    block_size: usize,
    /// The executor-side copy of every block table, kept by incremental updates.
    block_tables: IdMap<SeqId, Vec<BlockId>>,
    views: Sequences,
    /// Requests that ended and whose output is not returned yet.
    finished: Vec<RequestId>,
    next_request_id: u64,
    eos_token_ids: Vec<TokenId>,
    counters: EngineCounters,
    /// Compiles structured-output constraints (from the tokenizer; `None`
    /// when built without one: such requests are refused).
    structured: Option<Arc<StructuredOutputs>>,
    /// Whether structured-output masks are computed beside the forward
    /// pass (the default; `VELLUM_OVERLAP_MASKS=0` turns it off, to measure).
    overlap_masks: bool,
    /// A test hook: the next forward pass fails as a backend fault would
    /// ([`EngineCore::fail_next_forward_pass`]).
    fail_next_forward: bool,
    /// Speculative decoding, when configured ([`EngineCore::set_proposer`]).
    speculator: Option<Speculator>,
    /// Serves pooling (embedding) requests instead of generation
    /// ([`EngineCore::set_pooling`]).
    pooling: bool,
    /// Whether steps ask the executor to sample on its device
    /// ([`EngineCore::set_device_sampling`]).
    device_sampling: bool,
    /// The step function under asynchronous scheduling
    /// ([`EngineCore::set_async_scheduling`]), monomorphized where the
    /// executor may run on another thread.
    async_step: Option<StepFn<E>>,
    /// Under asynchronous scheduling: the next step, scheduled and built
    /// while the last one ran, launched by the next call.
    pending: Option<Prepared>,
}

/// One engine step, as a function of the engine.
type StepFn<E> = fn(&mut EngineCore<E>) -> Result<StepOutputs, Error>;

/// A scheduled step with its batch, not run yet.
struct Prepared {
    out: vellum_scheduler::SchedulerOutput,
    batch: vellum_base::ForwardBatch,
    rows: Vec<Row>,
    /// Filled in by `finalize`.
    placeholders: batch::Placeholders,
    /// Seconds its scheduling and batch took.
    schedule_s: f64,
}

/// The executor is only out of its place inside an asynchronous step.
fn executor_held() -> Error {
    Error::Backend(vellum_base::Error::Backend("the executor is running another step".into()))
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
            group_windows: executor.kv_group_windows(),
        });
        let mut scheduler = Scheduler::new(scheduler_config, kv)?;
        // Outputs come from the engine's own view, not finished requests.
        scheduler.keep_finished_requests(false);
        Ok(Self {
            scheduler,
            block_size,
            block_tables: IdMap::default(),
            views: Sequences::default(),
            finished: Vec::new(),
            next_request_id: 0,
            eos_token_ids,
            counters: EngineCounters::default(),
            structured: None,
            overlap_masks: std::env::var("VELLUM_OVERLAP_MASKS").as_deref() != Ok("0"),
            fail_next_forward: false,
            speculator: None,
            pooling: false,
            device_sampling: executor.samples_on_device() && std::env::var("VELLUM_DEVICE_SAMPLING").as_deref() != Ok("0"),
            async_step: None,
            pending: None,
            executor: Some(executor),
        })
    }

    /// Makes this engine serve pooling (embedding) requests, and only them
    /// (vLLM's `--task embed`): a step then returns hidden states, not
    /// logits, so a batch cannot mix the two kinds.
    pub fn set_pooling(&mut self, pooling: bool) {
        self.pooling = pooling;
    }

    /// Whether this engine serves pooling requests ([`EngineCore::set_pooling`]).
    pub fn is_pooling(&self) -> bool {
        self.pooling
    }

    /// Computes structured-output masks beside the forward pass (`true`, the
    /// default) or after it (`false`). Either way the masks, and so the
    /// outputs, are the same.
    pub fn set_overlap_masks(&mut self, overlap: bool) {
        self.overlap_masks = overlap;
    }

    /// Samples on the executor's device where it can (`true`, the default
    /// where [`ModelExecutor::samples_on_device`]; `VELLUM_DEVICE_SAMPLING=0`
    /// turns it off, to measure) or always on the host (`false`). A row is
    /// drawn from the same uniform number either way, so the tokens are the
    /// same.
    pub fn set_device_sampling(&mut self, on: bool) {
        self.device_sampling = on && self.executor.as_ref().is_some_and(|e| e.samples_on_device());
    }

    /// Lets requests carry a structured-output constraint, compiled by
    /// `structured` (built from the model's tokenizer).
    pub fn set_structured_outputs(&mut self, structured: Arc<StructuredOutputs>) {
        self.structured = Some(structured);
    }

    /// The structured-output compiler, if set.
    pub fn structured_outputs(&self) -> Option<&Arc<StructuredOutputs>> {
        self.structured.as_ref()
    }

    /// Running totals (steps, tokens, time per phase).
    pub fn counters(&self) -> EngineCounters {
        self.counters
    }

    /// Turns speculative decoding on: before each step `proposer` drafts up
    /// to `num_speculative_tokens` tokens for every request that can take
    /// them (one sequence, no beam search, no structured output), and the
    /// step verifies them ([`crate::speculative`]).
    pub fn set_proposer(&mut self, proposer: Box<dyn Proposer>, num_speculative_tokens: usize) {
        let spec = Speculator::new(proposer, num_speculative_tokens);
        tracing::info!(method = %spec.describe(), "speculative decoding");
        self.speculator = Some(spec);
    }

    /// vLLM's speculative-decoding counters (all zero without a proposer).
    pub fn spec_decode_counters(&self) -> SpecDecodeCounters {
        self.speculator.as_ref().map(|s| s.counters).unwrap_or_default()
    }

    /// Drafts for every request that can take them now (see
    /// [`EngineCore::set_proposer`]).
    fn propose_drafts(&mut self) -> Result<(), Error> {
        let Some(spec) = self.speculator.as_mut() else { return Ok(()) };
        let mut wanted: Vec<(RequestId, SeqId, usize)> = Vec::new();
        for (&rid, req) in self.views.reqs.iter() {
            let [sid] = req.seqs[..] else { continue };
            let eligible = req.finished.is_none()
                && req.params.beam_search.is_none()
                && req.params.num_sequences() == 1
                && self.views.seqs.get(&sid).is_some_and(|v| v.constraint.is_none());
            let room = if eligible { self.scheduler.max_draft_tokens(rid) } else { 0 };
            // `draft_len` counts a backoff step: asked only of a request that could draft.
            let most = if room > 0 { room.min(spec.draft_len(rid)) } else { 0 };
            if most > 0 {
                wanted.push((rid, sid, most));
            }
        }
        if wanted.is_empty() {
            return Ok(());
        }
        wanted.sort_unstable_by_key(|w| w.0);
        let requests: Vec<DraftRequest<'_>> = wanted
            .iter()
            .filter_map(|&(request_id, sid, max_drafts)| {
                Some(DraftRequest { request_id, tokens: &self.views.seqs.get(&sid)?.tokens, max_drafts })
            })
            .collect();
        let mut drafts = vec![Vec::new(); requests.len()];
        // A proposer that fails (a draft model's backend fault) costs this
        // step its drafts, never the target's requests.
        if let Err(e) = spec.propose(&requests, &mut drafts) {
            tracing::warn!(error = %e, "the speculative proposer failed; this step decodes without drafts");
            return Ok(());
        }
        for (&(rid, sid, most), mut d) in wanted.iter().zip(drafts) {
            d.truncate(most);
            if d.is_empty() || self.scheduler.add_draft_tokens(rid, &d).is_err() {
                continue;
            }
            if let Some(v) = self.views.seqs.get_mut(&sid) {
                v.drafts = d;
            }
        }
        Ok(())
    }

    /// Records the executor's replayed decode steps (CUDA graphs) for
    /// batches up to the scheduler's `max_num_seqs`, before any request
    /// holds a block ([`ModelExecutor::capture_graphs`]).
    pub fn capture_graphs(&mut self) -> Result<Option<vellum_base::GraphCapture>, Error> {
        let max_num_seqs = self.scheduler.config().max_num_seqs;
        Ok(self.executor.as_mut().ok_or_else(executor_held)?.capture_graphs(max_num_seqs)?)
    }

    /// The scheduler (read-only; for tests and invariant checks — callers
    /// use [`EngineCore::kv_stats`] and [`EngineCore::queue_stats`]).
    pub fn scheduler(&self) -> &Scheduler<KvCacheManager> {
        &self.scheduler
    }

    /// KV-cache accounting now.
    pub fn kv_stats(&self) -> KvCacheStats {
        self.scheduler.allocator().stats()
    }

    /// Queue lengths and preemptions so far.
    pub fn queue_stats(&self) -> QueueStats {
        let s = &self.scheduler;
        QueueStats {
            num_running: s.num_running(),
            num_waiting: s.num_waiting(),
            num_swapped: s.num_swapped(),
            num_preemptions: s.num_preemptions(),
        }
    }

    /// The longest prompt + output the engine accepts.
    pub fn max_model_len(&self) -> usize {
        self.scheduler.config().max_model_len
    }

    /// The tokens that end a sequence unless `ignore_eos`.
    pub fn eos_token_ids(&self) -> &[TokenId] {
        &self.eos_token_ids
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
        match (params.pooling.is_some(), self.pooling) {
            (true, false) => return Err(Error::Task("this engine generates text; start it for embeddings (--task embed) to pool".into())),
            (false, true) => return Err(Error::Task("this engine serves embeddings (--task embed); it does not generate text".into())),
            _ => {}
        }
        let constraint = match &params.structured_output {
            None => None,
            Some(spec) => {
                if params.beam_search.is_some() {
                    return Err(Error::StructuredOutput { field: spec.field(), message: "not supported together with beam search".into() });
                }
                let compiler = self.structured.as_ref().ok_or(Error::StructuredOutput {
                    field: spec.field(),
                    message: "this engine was built without a tokenizer, so it cannot constrain its output".into(),
                })?;
                Some(compiler.compile(spec)?)
            }
        };
        let id = RequestId(self.next_request_id);
        self.next_request_id += 1;
        let seed = params.seed.unwrap_or(id.0.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let seq = self.scheduler.add_request(NewRequest {
            eos_token_ids: self.eos_token_ids.clone(),
            priority,
            ..NewRequest::new(id, prompt_token_ids.clone(), params.clone())
        })?;
        self.views.add(id, seq, prompt_token_ids, params, seed, &self.eos_token_ids, constraint);
        Ok(id)
    }

    /// Whether any request is unfinished.
    pub fn has_unfinished_requests(&self) -> bool {
        self.scheduler.has_unfinished_requests() || self.pending.is_some()
    }

    /// Runs one step; returns requests that finished in it.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>, Error> {
        Ok(self.step_streaming()?.finished)
    }

    /// Runs one step; returns the new tokens of every sampled sequence and
    /// the requests that finished.
    pub fn step_streaming(&mut self) -> Result<StepOutputs, Error> {
        if let (Some(step), None) = (self.async_step, &self.speculator) {
            return step(self);
        }
        let t0 = Instant::now();
        // A step an asynchronous step left prepared (the mode was turned
        // off since) runs first.
        // (Its scheduling was counted when it was done.)
        let mut step = match self.pending.take() {
            Some(p) => p,
            None => match self.prepare()? {
                Some(p) => p,
                None => return Ok(self.empty_step()),
            },
        };
        self.finalize(&mut step);
        let t1 = Instant::now();
        self.counters.schedule_s += (t1 - t0).as_secs_f64();
        let Some(executor) = self.executor.as_mut() else { return Err(executor_held()) };
        // The structured-output masks depend on the rows, not the logits:
        // they are computed on another thread while the forward pass runs.
        // A device backend leaves the host's cores to them; on the CPU
        // backend it still paid (+15% single-stream decode, even at 64
        // sequences: docs/benchmarks.md).
        let (result, masks) = if self.overlap_masks && sampling::has_constrained_rows(&self.views.seqs, &step.rows) {
            let (seqs, rows, batch) = (&mut self.views.seqs, &step.rows, &step.batch);
            let (result, (masks, mask_s)) = std::thread::scope(|scope| {
                let masks = scope.spawn(move || {
                    let started = Instant::now();
                    (sampling::structured_masks(seqs, rows), started.elapsed().as_secs_f64())
                });
                let result = timed(|| executor.execute(batch));
                (result, masks.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            });
            self.counters.structured_mask_s += mask_s;
            (result, Some(masks))
        } else {
            (timed(|| executor.execute(&step.batch)), None)
        };
        let t2 = Instant::now();
        let (result, exec_s) = result;
        self.finish_step(step, result, masks, t1, t2, exec_s)
    }

    /// Drafts, then [`EngineCore::schedule_and_build`].
    fn prepare(&mut self) -> Result<Option<Prepared>, Error> {
        self.propose_drafts()?;
        Ok(self.schedule_and_build())
    }

    /// Schedules the next step and builds its batch (`None`: nothing to
    /// run or move, whose empty record the scheduler still holds).
    fn schedule_and_build(&mut self) -> Option<Prepared> {
        let started = Instant::now();
        let out = self.scheduler.schedule();
        // A step that runs no sequence may still move blocks (its
        // preemptions' swap-outs): the executor applies them.
        if out.is_idle() {
            return None;
        }
        let (batch, rows, placeholders) = self.build_batch(&out);
        Some(Prepared { out, batch, rows, placeholders, schedule_s: started.elapsed().as_secs_f64() })
    }

    /// Retires a step that scheduled nothing.
    fn empty_step(&mut self) -> StepOutputs {
        self.retire_empty_record();
        self.collect(Vec::new())
    }

    /// The scheduler's record of a step that scheduled nothing, retired;
    /// what ended meanwhile waits in `finished` for the next outputs.
    fn retire_empty_record(&mut self) {
        let update = self.scheduler.update_from_output(&StepSamples::default());
        self.finished.extend(self.views.apply(&StepSamples::default(), &IdMap::default(), &update));
    }

    /// Completes a prepared batch just before it runs: the tokens that were
    /// still being sampled when it was scheduled, and the device-sampling
    /// rows (their draws and penalties read the requests as they are now).
    fn finalize(&mut self, step: &mut Prepared) {
        for &(index, sid, position) in &step.placeholders {
            // A sequence that ended meanwhile keeps 0: its row is computed
            // and dropped.
            if let Some(&t) = self.views.seqs.get(&sid).and_then(|v| v.tokens.get(position)) {
                step.batch.token_ids[index] = t;
            }
        }
        if self.device_sampling && !step.batch.argmax_only && !step.batch.hidden_states && !step.rows.is_empty() {
            self.device_sampling_rows(&mut step.batch, &step.rows);
        }
    }

    /// Everything after the forward pass of `step`: its samples, the
    /// scheduler's update, the view, the outputs.
    fn finish_step(
        &mut self,
        step: Prepared,
        result: vellum_base::Result<vellum_base::StepOutput>,
        masks: Option<sampling::Masks>,
        t1: Instant,
        t2: Instant,
        exec_s: f64,
    ) -> Result<StepOutputs, Error> {
        let Prepared { out, batch, rows, .. } = step;
        let result = match result {
            Ok(_) if std::mem::take(&mut self.fail_next_forward) => {
                let e = vellum_base::Error::Backend("injected fault (VELLUM_FAULT_INJECTION)".into());
                return Err(self.fail_step(&out, e));
            }
            Ok(r) => r,
            Err(e) => return Err(self.fail_step(&out, e)),
        };
        if batch.hidden_states {
            if result.hidden_size == 0 || result.hidden_states.len() != rows.len() * result.hidden_size {
                let e = vellum_base::Error::Backend(format!(
                    "a pooling step returned {} hidden-state values of width {} for {} rows",
                    result.hidden_states.len(),
                    result.hidden_size,
                    rows.len()
                ));
                return Err(self.fail_step(&out, e));
            }
            let outputs = self.pool(&out, &result, &rows);
            self.counters.num_steps += 1;
            self.counters.execute_s += (t2 - t1).as_secs_f64();
            self.counters.other_step_times.observe(exec_s);
            return Ok(outputs);
        }
        let (samples, draws) = if result.argmax.len() == rows.len() && batch.argmax_only {
            self.sample_argmax(&result.argmax, &rows)
        } else if !batch.sampling.is_empty() && result.samples.len() == rows.len() {
            self.sample_on_device(&result.samples, &rows, &batch.sampling)
        } else {
            self.sample(&result.logits, result.vocab_size, &rows, masks)
        };
        if let Some(executor) = self.executor.as_mut() {
            executor.recycle_logits(result.logits);
        }
        let update = self.scheduler.update_from_output(&samples);
        let done = self.views.apply(&samples, &draws, &update);
        self.finished.extend(done);
        let mut deltas = Vec::new();
        for rs in &samples.requests {
            if !self.finished.contains(&rs.request_id) {
                self.views.deltas(rs.request_id, &mut deltas);
            }
        }
        let outputs = self.collect(deltas);
        let t3 = Instant::now();
        let c = &mut self.counters;
        c.num_steps += 1;
        c.execute_s += (t2 - t1).as_secs_f64();
        if batch.is_uniform_decode() {
            c.decode_steps += 1;
            c.decode_execute_s += (t2 - t1).as_secs_f64();
            c.decode_step_times.observe(exec_s);
        } else {
            c.other_step_times.observe(exec_s);
        }
        c.sample_s += (t3 - t2).as_secs_f64();
        Ok(outputs)
    }

    /// A pooling step: adds each row's hidden state to its request's
    /// pooler, retires the step (nothing sampled: the scheduler advances
    /// the computed tokens), and ends every request whose prompt is now
    /// computed, with its vector.
    fn pool(&mut self, out: &vellum_scheduler::SchedulerOutput, result: &vellum_base::StepOutput, rows: &[Row]) -> StepOutputs {
        let width = result.hidden_size;
        for (i, row) in rows.iter().enumerate() {
            let (Row::Pool(rid, Some(pos)), Some(hidden)) = (*row, result.hidden_states.get(i * width..(i + 1) * width)) else { continue };
            if let Some(pooler) = self.views.reqs.get_mut(&rid).and_then(|r| r.pooler.as_mut()) {
                pooler.add(pos, hidden);
            }
        }
        let update = self.scheduler.update_from_output(&StepSamples::default());
        self.finished.extend(self.views.apply(&StepSamples::default(), &IdMap::default(), &update));
        for s in &out.scheduled {
            let Some(req) = self.views.reqs.get_mut(&s.request_id) else { continue };
            let num_prompt = req.seqs.first().and_then(|sid| self.views.seqs.get(sid)).map_or(usize::MAX, |v| v.num_prompt);
            if s.num_computed_tokens + s.num_scheduled_tokens < num_prompt {
                continue;
            }
            if let (Some(pooler), Some(params)) = (&req.pooler, req.params.pooling) {
                req.embedding = Some(params.finish(pooler.pooled()));
            }
            self.finish_request(s.request_id, FinishReason::Stop);
        }
        self.collect(Vec::new())
    }

    /// A test hook (`VELLUM_FAULT_INJECTION=error-at-step:N` in the
    /// server): the next forward pass runs, then reports a backend error,
    /// taking the path of a real device fault ([`Error::StepFailed`]).
    pub fn fail_next_forward_pass(&mut self) {
        self.fail_next_forward = true;
    }

    /// After a failed forward pass: ends the requests `out` scheduled
    /// (aborted, blocks freed; their outputs come with the next `step()` or
    /// [`EngineCore::take_finished`]) and retires the step with no samples,
    /// so that the scheduler's counters stay consistent for the others.
    fn fail_step(&mut self, out: &vellum_scheduler::SchedulerOutput, source: vellum_base::Error) -> Error {
        let mut requests: Vec<RequestId> = Vec::new();
        for s in &out.scheduled {
            if !requests.contains(&s.request_id) {
                requests.push(s.request_id);
            }
        }
        tracing::error!(error = %source, requests = requests.len(), "forward pass failed; aborting its requests");
        for &id in &requests {
            self.finish_request(id, FinishReason::Abort);
        }
        let update = self.scheduler.update_from_output(&StepSamples::default());
        self.finished.extend(self.views.apply(&StepSamples::default(), &IdMap::default(), &update));
        Error::StepFailed { requests, source }
    }

    /// Ends a request from outside (a stop string matched, a client went
    /// away): its blocks are freed now and its output is returned by the
    /// next `step()`.
    pub fn finish_request(&mut self, id: RequestId, reason: FinishReason) -> bool {
        let ended = self.scheduler.finish_request(id, reason);
        if ended && self.views.finish(id, reason) {
            self.finished.push(id);
        }
        ended
    }

    /// Ends one output sequence (`index`) of a request, e.g. when a stop
    /// string matched in one of several parallel samples; the request ends
    /// with its last sequence.
    pub fn finish_sequence(&mut self, id: RequestId, index: usize, reason: FinishReason) -> bool {
        let Some(req) = self.views.reqs.get(&id) else { return false };
        let Some(sid) = req.seqs.iter().copied().find(|sid| self.views.seqs.get(sid).is_some_and(|v| v.index == index)) else {
            return false;
        };
        if !self.scheduler.finish_sequence(id, sid, reason) {
            return false;
        }
        if let Some(v) = self.views.seqs.get_mut(&sid) {
            v.finish_reason.get_or_insert(reason);
        }
        if !self.scheduler.has_request(id) && self.views.finish(id, reason) {
            self.finished.push(id);
        }
        true
    }

    /// Outputs of requests that finished outside a step (see
    /// [`EngineCore::finish_request`]) and have not been returned yet.
    pub fn take_finished(&mut self) -> Vec<RequestOutput> {
        self.collect(Vec::new()).finished
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

    /// The outputs of every finished request, after `deltas` and the
    /// streamed tails they had not reported.
    fn collect(&mut self, mut deltas: Vec<SequenceDelta>) -> StepOutputs {
        let mut finished = Vec::new();
        for id in std::mem::take(&mut self.finished) {
            if let Some(req) = self.views.reqs.get(&id) {
                for sid in &req.seqs {
                    self.block_tables.remove(sid);
                }
            }
            if let Some(spec) = &mut self.speculator {
                spec.finish(id);
            }
            finished.extend(self.views.take_output(id, &mut deltas));
        }
        StepOutputs { deltas, finished }
    }
}

impl<E: ModelExecutor + Send> EngineCore<E> {
    /// Asynchronous scheduling (vLLM's `--async-scheduling`): a helper
    /// thread schedules step N+1 and builds its batch while this thread
    /// runs step N's forward pass, then applies step N's samples. The
    /// scheduler counts step N's computed tokens and expected samples as in
    /// flight (`num_scheduled_tokens`, `num_expected_tokens`), so step N+1
    /// decodes the token step N is sampling; its id is filled in from the
    /// view just before step N+1 runs (`finalize`), as are its
    /// device-sampling draws. A sequence that ends at step N (a stop token)
    /// has its row of step N+1 computed and dropped. Requests whose next
    /// sample reshapes them (beam search, a parallel request's first
    /// draw) and requests with several running sequences wait for their
    /// samples (the scheduler sees to it); a speculating engine steps
    /// synchronously (its drafts need the last token). The outputs are the
    /// synchronous path's.
    pub fn set_async_scheduling(&mut self, on: bool) {
        self.async_step = on.then_some(Self::step_async as StepFn<E>);
    }

    /// Whether steps are scheduled asynchronously.
    pub fn async_scheduling(&self) -> bool {
        self.async_step.is_some()
    }

    /// One step under asynchronous scheduling (see
    /// [`EngineCore::set_async_scheduling`]).
    fn step_async(&mut self) -> Result<StepOutputs, Error> {
        if self.executor.is_none() {
            return Err(executor_held());
        }
        // A step prepared ahead was counted then; only the first is not.
        let (mut step, unhidden_s) = match self.pending.take() {
            Some(p) => (p, 0.0),
            None => match self.prepare()? {
                Some(p) => {
                    let s = p.schedule_s;
                    (p, s)
                }
                None => return Ok(self.empty_step()),
            },
        };
        let t0 = Instant::now();
        self.finalize(&mut step);
        let Some(mut executor) = self.executor.take() else { return Err(executor_held()) };
        let t1 = Instant::now();
        // The forward pass runs on this thread (a backend's per-thread state,
        // its thread pool and device context, stay where they were made);
        // the scheduling of the next step runs on a helper, whose panic is
        // caught so that the executor is put back whatever happens.
        let (result, ahead, ahead_s) = std::thread::scope(|scope| {
            let core = &mut *self;
            let rows = &step.rows;
            let helper = scope.spawn(move || {
                let mut ahead_s = 0.0;
                let ahead = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let started = Instant::now();
                    let next = core.schedule_and_build();
                    ahead_s = started.elapsed().as_secs_f64();
                    // This step's structured-output masks: its rows are known
                    // and the grammars have every earlier token.
                    let masks = (core.overlap_masks && sampling::has_constrained_rows(&core.views.seqs, rows)).then(|| {
                        let started = Instant::now();
                        let m = sampling::structured_masks(&mut core.views.seqs, rows);
                        core.counters.structured_mask_s += started.elapsed().as_secs_f64();
                        m
                    });
                    (next, masks)
                }));
                (ahead, ahead_s)
            });
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| timed(|| executor.execute(&step.batch))));
            let (ahead, ahead_s) = helper.join().unwrap_or_else(|panic| (Err(panic), 0.0));
            (result, ahead, ahead_s)
        });
        self.executor = Some(executor);
        let (next, masks) = ahead.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        // Step N+1's record sits behind step N's. (A panic in either pass
        // goes on from here and ends the engine, as a panicking step does
        // synchronously: step N's record is not retired.)
        let retire_empty = next.is_none();
        self.pending = next;
        let (result, exec_s) = result.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        let t2 = Instant::now();
        self.counters.schedule_s += unhidden_s + (t1 - t0).as_secs_f64() + ahead_s;
        self.counters.schedule_overlapped_s += ahead_s;
        // Step N's update comes first, then an empty N+1 is retired at once.
        let outputs = self.finish_step(step, result, masks, t1, t2, exec_s);
        if retire_empty {
            self.retire_empty_record();
        }
        let mut outputs = outputs?;
        if retire_empty {
            let more = self.collect(Vec::new());
            outputs.deltas.extend(more.deltas);
            outputs.finished.extend(more.finished);
        }
        Ok(outputs)
    }
}

#[cfg(test)]
mod tests {
    use super::{StepTimes, STEP_SECONDS_BUCKETS};

    #[test]
    fn step_times_fall_in_the_first_bucket_that_holds_them() {
        let mut t = StepTimes::default();
        for s in [0.0005, 0.001, 0.0011, 0.03, 2.0] {
            t.observe(s);
        }
        assert_eq!(t.counts[0], 2, "at most 1 ms: {:?}", t.counts);
        assert_eq!((t.counts[1], t.counts[6], t.counts[STEP_SECONDS_BUCKETS.len()]), (1, 1, 1), "{:?}", t.counts);
        assert_eq!(t.count(), 5);
        assert!((t.sum_s - 2.0326).abs() < 1e-9);
    }
}
