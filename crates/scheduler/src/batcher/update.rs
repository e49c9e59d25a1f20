//! Applying a step's samples: counters advance, tokens append, parallel
//! samples and beams fork or are dropped, stop conditions end sequences —
//! and what changed goes back as a [`StepUpdate`].

use super::Scheduler;
use crate::scheduler_output::{RequestSamples, SeqFork, StepSamples, StepUpdate};
use crate::sequence_group::{FinishReason, Request, Sequence};
use vellum_base::{BlockAllocator, IdSet, SeqId, TokenId};

impl<A: BlockAllocator> Scheduler<A> {
    /// Applies the oldest in-flight step: `num_computed_tokens += Δ` for
    /// every scheduled sequence, then the sampled tokens (appends, forks,
    /// frees), then the stop conditions. Every sequence scheduled with
    /// `samples: true` must receive a token (or, in a beam search, be left
    /// out to be dropped). Returns what changed ([`StepUpdate`]).
    pub fn update_from_output(&mut self, samples: &StepSamples) -> StepUpdate {
        let scheduled = self.in_flight.pop_front().expect("update_from_output without a scheduled step");
        for (s, slot) in &scheduled {
            // The slot named the request when the step was scheduled; one
            // that ended since may have left it to another.
            let Some((&id, req)) = self.requests.get_slot_mut(*slot) else { continue };
            if id != s.request_id {
                continue;
            }
            let Some(seq) = req.seqs.iter_mut().find(|q| q.seq_id == s.seq_id) else { continue };
            seq.num_in_flight_tokens -= s.num_scheduled_tokens;
            seq.num_in_flight_samples -= s.samples as usize;
            if seq.state.num_draft_tokens() > 0 && s.samples {
                continue; // verified with its samples in apply_samples
            }
            seq.state.advance(s.num_scheduled_tokens).expect("scheduled Δ fits the sequence");
        }
        self.spare_records.push(scheduled);
        let mut update = StepUpdate::default();
        for rs in &samples.requests {
            self.apply_samples(rs, &mut update);
        }
        update
    }

    fn apply_samples(&mut self, rs: &RequestSamples, update: &mut StepUpdate) {
        let rid = rs.request_id;
        let Some(req) = self.requests.get_mut(&rid) else {
            update.skipped.extend((0..rs.next.len()).map(|e| (rid, e)));
            return;
        };
        let is_beam = req.hot.is_beam;
        // Fast path: one token for a request whose set of sequences stays.
        if let [(seq_id, token)] = rs.next[..] {
            if !is_beam && !req.next_sample_reshapes() {
                match append_token(req, &mut self.allocator, seq_id, token, rs.num_rejected_drafts) {
                    Appended::Skipped => update.skipped.push((rid, 0)),
                    Appended::Running => {}
                    Appended::Stopped { reason, request_done } => {
                        update.finished_seqs.push((rid, seq_id, reason));
                        if request_done {
                            self.finish_request(rid, reason);
                            update.finished_requests.push((rid, reason));
                        }
                    }
                }
                return;
            }
        }
        // 1. Pair each entry with the sequence that takes its token: the
        //    parent for its first entry, a fork of it for every later one
        //    (forked from the parent's state before this token).
        let mut parents: IdSet<SeqId> = IdSet::default();
        let mut appends: Vec<(SeqId, TokenId, bool)> = Vec::with_capacity(rs.next.len());
        let mut children: Vec<Sequence> = Vec::new();
        for (entry, &(parent, token)) in rs.next.iter().enumerate() {
            let Some(p) = req.seqs.iter().find(|s| s.seq_id == parent && s.is_running()) else {
                update.skipped.push((rid, entry));
                continue;
            };
            if parents.insert(parent) {
                appends.push((parent, token, false));
                continue;
            }
            self.next_seq_id += 1;
            let child_id = SeqId(self.next_seq_id - 1);
            // A contiguous allocator may have no room to copy: the child then
            // recomputes its KV when next scheduled.
            let shares_blocks = self.allocator.fork(parent, child_id);
            children.push(Sequence::new(child_id, p.state.clone()));
            appends.push((child_id, token, !shares_blocks));
            update.forks.push(SeqFork { request_id: rid, entry, parent, child: child_id });
        }
        req.seqs.extend(children);
        req.forked = true;
        // 2. Beam search: candidates that no entry extends are dropped.
        if is_beam && !parents.is_empty() {
            let keep = |s: &Sequence| !s.is_running() || appends.iter().any(|a| a.0 == s.seq_id);
            for s in req.seqs.iter().filter(|s| !keep(s)) {
                self.allocator.free(s.seq_id);
                update.dropped_seqs.push((rid, s.seq_id));
            }
            req.seqs.retain(|s| keep(s));
        }
        // 3. Append; check the stop conditions.
        for (seq_id, token, recompute) in appends {
            if let Appended::Stopped { reason, .. } = append_token(req, &mut self.allocator, seq_id, token, rs.num_rejected_drafts) {
                update.finished_seqs.push((rid, seq_id, reason));
            }
            if recompute {
                if let Some(seq) = req.seqs.iter_mut().find(|s| s.seq_id == seq_id && s.is_running()) {
                    seq.state.preempt();
                }
            }
        }
        if is_beam && rs.next.is_empty() {
            for s in req.seqs.iter_mut().filter(|s| s.is_running()) {
                s.finish_reason = Some(FinishReason::Stop);
                self.allocator.free(s.seq_id);
                update.finished_seqs.push((rid, s.seq_id, FinishReason::Stop));
            }
        }
        if req.running_seqs().next().is_none() {
            let reason = req.seqs.iter().rev().find_map(|s| s.finish_reason).unwrap_or(FinishReason::Stop);
            self.finish_request(rid, reason);
            update.finished_requests.push((rid, reason));
        }
    }
}

/// What appending a sampled token did to its sequence.
enum Appended {
    /// The sequence was not running: nothing was appended.
    Skipped,
    /// Appended; the sequence goes on.
    Running,
    /// Appended, and a stop condition ended the sequence (its blocks are
    /// freed); `request_done` when no sequence of a non-beam request runs.
    Stopped {
        /// Why it ended.
        reason: FinishReason,
        /// The whole request is done.
        request_done: bool,
    },
}

/// Appends `token` to sequence `seq_id` (under speculative decoding, applies
/// the verification) and checks the stop conditions: EOS unless
/// `ignore_eos`, stop token ids, `min_tokens`, the length limit.
fn append_token<A: BlockAllocator>(
    req: &mut Request,
    allocator: &mut A,
    seq_id: SeqId,
    token: TokenId,
    num_rejected_drafts: usize,
) -> Appended {
    let Some(seq) = req.seqs.iter_mut().find(|s| s.seq_id == seq_id && s.is_running()) else { return Appended::Skipped };
    if seq.state.num_draft_tokens() > 0 {
        let delta = seq.state.num_remaining_tokens();
        seq.state.apply_speculative_result(delta, num_rejected_drafts, token).expect("rejections within the drafts");
        allocator.trim(seq_id, seq.state.num_computed_tokens());
    } else {
        seq.state.append_output_token(token).expect("a sampled sequence is caught up");
    }
    let n_out = seq.state.num_output_tokens();
    let stop_token = req.hot.stop_token_ids.contains(&token);
    let reason = if stop_token && n_out >= req.hot.min_tokens {
        FinishReason::Stop
    } else if seq.state.num_total_tokens() >= req.max_total_tokens {
        FinishReason::Length
    } else {
        return Appended::Running;
    };
    seq.finish_reason = Some(reason);
    allocator.free(seq_id);
    Appended::Stopped { reason, request_done: !req.hot.is_beam && req.running_seqs().next().is_none() }
}
