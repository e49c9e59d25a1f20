//! A token for every sampling row (the first sample of a parallel-sampling
//! request draws `n`; beam-search rows go through [`crate::beam`]), and the
//! prompt logprobs rows.

use super::batch::Row;
use super::EngineCore;
use crate::beam::beam_step;
use crate::outputs::PromptLogprob;
use crate::sampler::{has_penalties, log_softmax, sample_masked, top_k, AllowedTokens, RowStats, Sample};
use crate::sequences::{Draw, SeqView};
use crate::structured::Constraint;
use llguidance::toktrie::SimpleVob;
use vellum_base::{DeviceSample, IdMap, IdSet, ModelExecutor, RequestId, RowSampling, SamplingParams, SeqId};
use vellum_scheduler::{RequestSamples, StepSamples};

/// The allowed tokens of each constrained sampling row, and the vocabulary
/// size the mask covers.
pub(super) type Masks = IdMap<SeqId, (SimpleVob, usize)>;

/// Whether any of `rows` samples under a structured-output constraint.
pub(super) fn has_constrained_rows(seqs: &IdMap<SeqId, SeqView>, rows: &[Row]) -> bool {
    rows.iter().any(|r| matches!(r, Row::Sample(_, sid) if seqs.get(sid).is_some_and(|v| v.constraint.is_some())))
}

/// The structured-output masks of a step's sampling rows, in parallel: each
/// sequence's matcher is its own, and a mask can take a millisecond. Each
/// matcher has consumed every token sampled so far, so the masks depend
/// only on the step's rows, not on its logits: they may be computed while
/// the forward pass runs. A step without constrained rows allocates nothing.
pub(super) fn structured_masks(seqs: &mut IdMap<SeqId, SeqView>, rows: &[Row]) -> Masks {
    use rayon::prelude::*;
    if !has_constrained_rows(seqs, rows) {
        return Masks::default();
    }
    let wanted: IdSet<SeqId> = rows.iter().filter_map(|r| if let Row::Sample(_, sid) = r { Some(*sid) } else { None }).collect();
    let mut constrained: Vec<(SeqId, &mut Constraint)> =
        seqs.iter_mut().filter_map(|(sid, v)| v.constraint.as_mut().filter(|_| wanted.contains(sid)).map(|c| (*sid, c))).collect();
    constrained.par_iter_mut().with_max_len(1).map(|(sid, c)| (*sid, (c.allowed(), c.vocab_size()))).collect()
}

impl<E: ModelExecutor> EngineCore<E> {
    /// [`EngineCore::sample`] for a batch that was `argmax_only`, from the
    /// argmax the executor computed on the device: every row is a greedy
    /// sample that needs nothing else (no logprobs: NaN, as the host path
    /// leaves them when unasked).
    pub(super) fn sample_argmax(&mut self, argmax: &[u32], rows: &[Row]) -> (StepSamples, IdMap<RequestId, Vec<Draw>>) {
        let mut per_req: Vec<RequestSamples> = Vec::new();
        let mut draws: IdMap<RequestId, Vec<Draw>> = IdMap::default();
        let mut settled = IdSet::default();
        for (&token, &use_) in argmax.iter().zip(rows) {
            let (rid, sid, draft) = match use_ {
                Row::Sample(rid, sid) => (rid, sid, None),
                Row::Verify(rid, sid, i) => (rid, sid, Some(i)),
                Row::PromptLogprob(..) | Row::Pool(..) => continue,
            };
            let Some(seq) = self.views.seqs.get(&sid).filter(|v| v.finish_reason.is_none() && self.views.reqs.contains_key(&rid)) else {
                continue;
            };
            if !seq.drafts.is_empty() {
                let draw = Draw { token, logprob: f32::NAN, top: None, index: None };
                self.verify_row(rid, sid, draft, draw, &mut settled, &mut per_req, &mut draws);
                continue;
            }
            draws.entry(rid).or_default().push(Draw { token, logprob: f32::NAN, top: None, index: None });
            self.counters.generation_tokens += 1;
            match per_req.last_mut() {
                Some(last) if last.request_id == rid => last.next.push((sid, token)),
                _ => per_req.push(RequestSamples::tokens(rid, vec![(sid, token)])),
            }
        }
        (StepSamples { requests: per_req }, draws)
    }

    /// [`EngineCore::sample`] for a batch that carried
    /// [`ForwardBatch::sampling`](vellum_base::ForwardBatch::sampling), from
    /// the tokens the executor drew on its device: every row is a
    /// [`Row::Sample`]; each drawing row's request generator advances by
    /// the draw the row used, as the host sampler's would.
    pub(super) fn sample_on_device(
        &mut self,
        samples: &[DeviceSample],
        rows: &[Row],
        sampling: &[RowSampling],
    ) -> (StepSamples, IdMap<RequestId, Vec<Draw>>) {
        let mut per_req: Vec<RequestSamples> = Vec::new();
        let mut draws: IdMap<RequestId, Vec<Draw>> = IdMap::default();
        for ((sample, &use_), row) in samples.iter().zip(rows).zip(sampling) {
            let Row::Sample(rid, sid) = use_ else { continue };
            // A sequence that ended after the step was scheduled draws nothing.
            let live = self.views.seqs.get(&sid).is_some_and(|v| v.finish_reason.is_none());
            let Some(req) = self.views.reqs.get_mut(&rid).filter(|_| live) else { continue };
            if row.temperature > 0.0 {
                match self.views.seqs.get_mut(&sid).and_then(|v| v.rng.as_mut()) {
                    Some(own) => own.uniform(),
                    None => req.rng.uniform(),
                };
            }
            let top = req.params.logprobs.is_some().then(|| sample.top_logprobs.clone());
            draws.entry(rid).or_default().push(Draw { token: sample.token, logprob: sample.logprob, top, index: None });
            self.counters.generation_tokens += 1;
            match per_req.last_mut() {
                Some(last) if last.request_id == rid => last.next.push((sid, sample.token)),
                _ => per_req.push(RequestSamples::tokens(rid, vec![(sid, sample.token)])),
            }
        }
        (StepSamples { requests: per_req }, draws)
    }

    /// Samples every row: the entries for the scheduler, and per request
    /// the draws behind them (same order).
    ///
    /// `masks`: the structured-output masks of `rows` if they were computed
    /// beside the forward pass ([`structured_masks`]); else they are
    /// computed here.
    pub(super) fn sample(
        &mut self,
        logits: &[f32],
        vocab: usize,
        rows: &[Row],
        masks: Option<Masks>,
    ) -> (StepSamples, IdMap<RequestId, Vec<Draw>>) {
        let mut per_req: Vec<RequestSamples> = Vec::new();
        let mut draws: IdMap<RequestId, Vec<Draw>> = IdMap::default();
        let mut beam_rows: Vec<(RequestId, SeqId, usize)> = Vec::new();
        // What sampling reads of every sampling row (normalizer, top
        // entries, a plain draw's chunk sums), rows in parallel: the passes
        // over the vocabulary are most of a row's sampling time. Beam-search
        // rows take their own path.
        let stats: Vec<Option<RowStats>> = {
            use rayon::prelude::*;
            let wanted: Vec<Option<(&SamplingParams, bool)>> = rows
                .iter()
                .map(|r| match *r {
                    Row::Sample(rid, sid) | Row::Verify(rid, sid, _) => {
                        let req = self.views.reqs.get(&rid).filter(|q| q.params.beam_search.is_none())?;
                        let constrained = self.views.seqs.get(&sid).is_some_and(|v| v.constraint.is_some());
                        Some((&req.params, constrained))
                    }
                    Row::PromptLogprob(..) | Row::Pool(..) => None,
                })
                .collect();
            let stats_of = |row: usize| {
                wanted[row].map(|(params, constrained)| {
                    RowStats::new(&logits[row * vocab..(row + 1) * vocab], params, params.logprobs.unwrap_or(0), constrained)
                })
            };
            if rows.len() > 1 {
                (0..rows.len()).into_par_iter().map(stats_of).collect()
            } else {
                (0..rows.len()).map(stats_of).collect()
            }
        };
        let mut masks = match masks {
            Some(m) => m,
            None => {
                let started = std::time::Instant::now();
                let m = structured_masks(&mut self.views.seqs, rows);
                if !m.is_empty() {
                    self.counters.structured_mask_s += started.elapsed().as_secs_f64();
                }
                m
            }
        };
        let mut settled = IdSet::default();
        for (row, &use_) in rows.iter().enumerate() {
            let row_logits = &logits[row * vocab..(row + 1) * vocab];
            let (rid, sid, draft) = match use_ {
                Row::PromptLogprob(rid, pos) => {
                    self.record_prompt_logprob(rid, pos, row_logits);
                    continue;
                }
                Row::Pool(..) => continue, // pooling steps take `pool`
                Row::Sample(rid, sid) => (rid, sid, None),
                Row::Verify(rid, sid, i) => (rid, sid, Some(i)),
            };
            let (Some(req), Some(seq)) = (self.views.reqs.get_mut(&rid), self.views.seqs.get(&sid)) else { continue };
            if req.params.beam_search.is_some() {
                beam_rows.push((rid, sid, row));
                continue;
            }
            if seq.finish_reason.is_some() {
                continue; // ended after this step was scheduled (asynchronous scheduling): no draw
            }
            let Some(row_stats) = stats[row].as_ref() else { continue };
            if !seq.drafts.is_empty() {
                if settled.contains(&sid) {
                    continue; // an earlier draft was rejected: the rest are moot
                }
                // Draw as the non-speculative sampler would after the drafts
                // before this position (the history its penalties read).
                let i = draft.unwrap_or(seq.drafts.len());
                let history: Vec<_> = if has_penalties(&req.params) {
                    seq.output().iter().chain(&seq.drafts[..i]).copied().collect()
                } else {
                    Vec::new() // read by the penalties alone
                };
                let k = req.params.logprobs.unwrap_or(0);
                let Sample { token, logprob, top_logprobs } =
                    sample_masked(row_logits, row_stats, &req.params, &mut req.rng, k, (seq.prompt(), &history), None);
                let draw = Draw { token, logprob, top: req.params.logprobs.is_some().then_some(top_logprobs), index: None };
                self.verify_row(rid, sid, draft, draw, &mut settled, &mut per_req, &mut draws);
                continue;
            }
            // The first sample of a parallel-sampling request draws n tokens.
            let n = req.params.num_sequences();
            let first = !req.forked && n > 1;
            req.forked |= first;
            let k = req.params.logprobs.unwrap_or(0);
            let mut next = Vec::new();
            let ds = draws.entry(rid).or_default();
            // A structured-output constraint allows some tokens only; every
            // draw of this row comes from the same grammar state.
            let allowed = masks.remove(&sid);
            let allowed_fn = |f: &mut dyn FnMut(usize)| {
                if let Some((m, vocab)) = &allowed {
                    m.iter_set_entries(|t| {
                        if t < *vocab {
                            f(t)
                        }
                    });
                }
            };
            let mask: Option<AllowedTokens<'_>> = if allowed.is_some() { Some(&allowed_fn) } else { None };
            // A forked parallel sequence draws from its own generator.
            let mut own = seq.rng.clone();
            for i in 0..if first { n } else { 1 } {
                let rng = own.as_mut().unwrap_or(&mut req.rng);
                let Sample { token, logprob, top_logprobs } =
                    sample_masked(row_logits, row_stats, &req.params, rng, k, (seq.prompt(), seq.output()), mask);
                next.push((sid, token));
                let top = req.params.logprobs.is_some().then_some(top_logprobs);
                ds.push(Draw { token, logprob, top, index: first.then_some(i) });
            }
            if let (Some(r), Some(v)) = (own, self.views.seqs.get_mut(&sid)) {
                v.rng = Some(r);
            }
            self.counters.generation_tokens += next.len() as u64;
            match per_req.last_mut() {
                Some(last) if last.request_id == rid => last.next.extend(next),
                _ => per_req.push(RequestSamples::tokens(rid, next)),
            }
        }
        // Beam search: every running candidate of a request was scheduled
        // together; choose the next candidates over all of them.
        let mut i = 0;
        while i < beam_rows.len() {
            let rid = beam_rows[i].0;
            let j = i + beam_rows[i..].iter().take_while(|r| r.0 == rid).count();
            if let Some(req) = self.views.reqs.get_mut(&rid) {
                let cand_rows: Vec<(SeqId, usize)> = beam_rows[i..j].iter().map(|&(_, sid, row)| (sid, row)).collect();
                if let Some(beam) = req.params.beam_search.clone() {
                    let (next, ds) = beam_step(req, &beam, &self.views.seqs, &cand_rows, logits, vocab);
                    req.forked = true;
                    self.counters.generation_tokens += next.len() as u64;
                    per_req.push(RequestSamples::tokens(rid, next));
                    draws.insert(rid, ds);
                }
            }
            i = j;
        }
        (StepSamples { requests: per_req }, draws)
    }

    /// One row of a speculating sequence's verification: `draw` is the
    /// target's token at draft `draft`'s position (`None`: after the last
    /// draft). A draw equal to its draft (and no stop token) accepts it;
    /// any other ends the verification and is the sequence's next token.
    #[allow(clippy::too_many_arguments)] // The sampling loop's state, passed through.
    fn verify_row(
        &mut self,
        rid: RequestId,
        sid: SeqId,
        draft: Option<usize>,
        draw: Draw,
        settled: &mut IdSet<SeqId>,
        per_req: &mut Vec<RequestSamples>,
        draws: &mut IdMap<RequestId, Vec<Draw>>,
    ) {
        let (Some(req), Some(seq)) = (self.views.reqs.get(&rid), self.views.seqs.get(&sid)) else { return };
        if settled.contains(&sid) {
            return;
        }
        let num_drafts = seq.drafts.len();
        let i = draft.unwrap_or(num_drafts).min(num_drafts);
        let token = draw.token;
        draws.entry(rid).or_default().push(draw);
        self.counters.generation_tokens += 1;
        if i < num_drafts && token == seq.drafts[i] && !req.stop_token_ids.contains(&token) {
            return; // accepted: the next row checks the next draft
        }
        settled.insert(sid);
        per_req.push(RequestSamples { request_id: rid, next: vec![(sid, token)], num_rejected_drafts: num_drafts - i });
        if let Some(spec) = &mut self.speculator {
            spec.verified(rid, num_drafts, i);
        }
    }

    fn record_prompt_logprob(&mut self, rid: RequestId, pos: usize, row_logits: &[f32]) {
        let Some(req) = self.views.reqs.get_mut(&rid) else { return };
        let Some(token_id) = req.seqs.first().and_then(|s| self.views.seqs.get(s)).and_then(|v| v.prompt().get(pos).copied()) else {
            return;
        };
        let k = req.params.prompt_logprobs.unwrap_or(0);
        let Some(slots) = req.prompt_logprobs.as_mut() else { return };
        if slots[pos].is_some() {
            return; // recomputed after a preemption
        }
        let lp = log_softmax(row_logits);
        slots[pos] = Some(PromptLogprob { token_id, logprob: lp[token_id as usize], top: top_k(&lp, k) });
    }
}
