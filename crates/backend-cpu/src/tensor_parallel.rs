//! An in-process tensor-parallel group: the all-reduce the CPU backend's
//! ranks meet in, one thread per rank (`vellum-models`' `ModelRunner` runs
//! them), as NCCL's ranks meet on GPUs.
//!
//! Each all-reduce is a rendezvous: every rank deposits its partial sums;
//! the last to arrive adds the deposits up **in rank order** into one
//! result, which every rank copies out. All ranks therefore hold the same
//! bits afterwards (their residual streams never drift apart), and the sum
//! is the same whichever rank arrives last.
//!
//! A rank whose step fails calls [`HostGroup::fail`]; ranks waiting in (or
//! later entering) an all-reduce then get an error instead of waiting for a
//! deposit that will never come. The group stays failed until
//! [`HostGroup::reset`], once every rank has left the step.

use std::sync::{Condvar, Mutex, MutexGuard};
use vellum_base::Error;
use vellum_ops::GROUP_FAILED;

/// The shared state of a group of `size` ranks.
#[derive(Debug)]
pub struct HostGroup {
    size: usize,
    state: Mutex<State>,
    /// Signalled when a round completes or the group fails.
    done: Condvar,
}

#[derive(Debug, Default)]
struct State {
    /// This round's deposits, by rank.
    deposits: Vec<Vec<f32>>,
    /// Ranks that deposited in this round.
    arrived: usize,
    /// Rounds completed: a waiter leaves when it moves past its own.
    round: u64,
    /// The last completed round's sum.
    result: Vec<f32>,
    failed: bool,
}

impl HostGroup {
    /// A group of `size` ranks (at least one).
    pub fn new(size: usize) -> Self {
        let size = size.max(1);
        let state = State { deposits: vec![Vec::new(); size], ..State::default() };
        Self { size, state: Mutex::new(state), done: Condvar::new() }
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock failed the group
        // (its guard calls `fail`); the state itself stays consistent.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sums `x` over the ranks, in place, as rank `rank`; every rank passes
    /// a buffer of the same length.
    pub fn all_reduce(&self, rank: usize, x: &mut [f32]) -> vellum_base::Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        let failed = || Error::Backend(format!("tensor parallel: {GROUP_FAILED}"));
        let mut state = self.lock();
        if state.failed {
            return Err(failed());
        }
        if rank >= self.size || state.arrived >= self.size {
            state.failed = true;
            self.done.notify_all();
            return Err(Error::Backend(format!("tensor parallel: rank {rank} of a group of {} out of turn", self.size)));
        }
        let deposit = &mut state.deposits[rank];
        deposit.clear();
        deposit.extend_from_slice(x);
        state.arrived += 1;
        let my_round = state.round;
        if state.arrived == self.size {
            if state.deposits.iter().any(|d| d.len() != x.len()) {
                state.failed = true;
                self.done.notify_all();
                return Err(Error::Backend("tensor parallel: ranks all-reduced tensors of different sizes".into()));
            }
            let State { deposits, result, .. } = &mut *state;
            result.clear();
            result.extend_from_slice(&deposits[0]);
            for deposit in &deposits[1..] {
                for (sum, v) in result.iter_mut().zip(deposit) {
                    *sum += v;
                }
            }
            state.arrived = 0;
            state.round += 1;
            self.done.notify_all();
        } else {
            while state.round == my_round && !state.failed {
                state = self.done.wait(state).unwrap_or_else(|poisoned| poisoned.into_inner());
            }
            if state.round == my_round {
                return Err(failed());
            }
        }
        // The result stays until the last rank of the next round arrives,
        // which is after this rank has left this one.
        x.copy_from_slice(&state.result);
        Ok(())
    }

    /// Fails the group: ranks waiting in an all-reduce, and every later
    /// all-reduce, return an error.
    pub fn fail(&self) {
        self.lock().failed = true;
        self.done.notify_all();
    }

    /// Makes a failed group usable again: called when no rank is inside an
    /// all-reduce (every rank's thread has left the failed step), it drops
    /// the half-finished round.
    pub fn reset(&self) {
        let mut state = self.lock();
        state.failed = false;
        state.arrived = 0;
        state.deposits.iter_mut().for_each(Vec::clear);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_the_same_sum_in_rank_order() {
        for size in [2, 3, 4] {
            let group = HostGroup::new(size);
            let results: Vec<Vec<f32>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..size)
                    .map(|rank| {
                        let group = &group;
                        s.spawn(move || {
                            let mut out = Vec::new();
                            for round in 0..50 {
                                // Element 0's sum depends on the order of addition
                                // (1e8 + 1 rounds back to 1e8 in f32).
                                let first = [1e8f32, 1.0, -1e8, 1.0][rank];
                                let mut x = vec![first, 1.0 + rank as f32, round as f32];
                                group.all_reduce(rank, &mut x).expect("no rank fails");
                                out.extend(x);
                            }
                            out
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().expect("no panic")).collect()
            });
            for r in &results[1..] {
                assert_eq!(r, &results[0], "bitwise the same on every rank");
            }
            let expected_second: f32 = (0..size).map(|r| 1.0 + r as f32).sum();
            assert_eq!(results[0][1], expected_second);
            // Element 0: the fold in rank order, bit for bit.
            let in_rank_order = [1e8f32, 1.0, -1e8, 1.0][..size].iter().fold(0f32, |acc, v| acc + v);
            assert_eq!(results[0][0].to_bits(), in_rank_order.to_bits(), "size {size}");
        }
    }

    #[test]
    fn a_failed_rank_releases_the_others_with_an_error() {
        let group = HostGroup::new(3);
        std::thread::scope(|s| {
            let waiters: Vec<_> = (0..2)
                .map(|rank| {
                    let group = &group;
                    s.spawn(move || group.all_reduce(rank, &mut [1.0]))
                })
                .collect();
            std::thread::sleep(std::time::Duration::from_millis(20));
            group.fail();
            for w in waiters {
                let e = w.join().expect("no panic").expect_err("the third rank never came");
                assert!(e.to_string().contains("another rank"), "{e}");
            }
        });
        assert!(group.all_reduce(2, &mut [1.0]).is_err(), "a failed group stays failed");
        // Reset with no rank inside: usable again.
        group.reset();
        let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|rank| {
                    let group = &group;
                    s.spawn(move || {
                        let mut x = vec![rank as f32];
                        group.all_reduce(rank, &mut x).map(|_| x)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("no panic").expect("the reset group works")).collect()
        });
        assert!(sums.iter().all(|x| x == &[3.0]));
    }
}
