//! Preemption (paper §4.5): a whole sequence group loses its blocks, by
//! swapping them to the host pool (all or nothing) or by recompute
//! (`num_computed_tokens ← 0`).

use super::policies::StepState;
use super::Scheduler;
use crate::scheduler_output::SchedulerOutput;
use crate::sequence_group::RequestStatus;
use vellum_base::{BlockAllocator, PreemptionMode, RequestId, SchedulingPolicy, SeqId};

impl<A: BlockAllocator> Scheduler<A> {
    /// Preempts a whole group: by swapping if configured and the host pool
    /// has room, else by recompute.
    pub(super) fn preempt(&mut self, id: RequestId, step: &mut StepState, out: &mut SchedulerOutput) {
        self.trim_to_scheduled(id);
        let req = self.requests.get_mut(&id).expect("preempted request is live");
        let seq_ids: Vec<SeqId> = req.running_seqs().map(|s| s.seq_id).collect();
        // No swap-out in a step that swaps in: a step's swap-outs run before
        // its swap-ins, so a host block a swap-in freed (and may hand to
        // this swap-out) would be overwritten before it is read, and a group
        // swapped in by this very step would be copied out before it was
        // copied back. Such a preemption recomputes instead.
        let swapped_in_now = !out.block_ops.swap_in.is_empty();
        let swaps = match self.config.preemption_mode {
            PreemptionMode::Swap if !swapped_in_now => self.allocator.swap_out(&seq_ids),
            _ => None,
        };
        let key = (if self.config.policy == SchedulingPolicy::Priority { req.priority } else { 0 }, req.arrival_order);
        self.running.remove(&key);
        if let Some(n) = &mut step.num_running_seqs {
            *n -= req.num_seq_slots();
        }
        step.preempted = true;
        req.num_preemptions += 1;
        self.num_preemptions += 1;
        out.preempted_requests.push(id);
        for s in &mut req.seqs {
            s.num_synced_blocks = 0;
        }
        match swaps {
            Some(swaps) => {
                out.block_ops.swap_out.extend(swaps);
                req.status = RequestStatus::Swapped;
                self.swapped.insert(key, id);
            }
            None => {
                for s in &mut req.seqs {
                    self.allocator.free(s.seq_id);
                    s.state.preempt();
                }
                req.status = RequestStatus::Waiting;
                self.waiting.insert(key, id);
            }
        }
    }
}
