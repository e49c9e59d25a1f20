//! The running queue as a dense, index-addressed array (the thesis's
//! persistent batch, §4.6.2): the running requests in queue order, each
//! with the slot of its record in the scheduler's request slab, so a step
//! walks one contiguous array and reaches every request by an index instead
//! of a hash probe (docs/benchmarks.md, "Scheduler").
//!
//! Removal marks an entry and leaves it in place, so positions stay valid
//! while a step walks the queue and preempts; [`RunningQueue::compact`]
//! drops the marks once, at the start of the next step. Keys are unique
//! and the entries stay sorted by key, marked ones included, so lookups are
//! binary searches.

use super::QueueKey;
use vellum_base::RequestId;

/// One running request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RunningEntry {
    /// Its queue position: (priority under the priority policy, arrival).
    pub(crate) key: QueueKey,
    /// Its record's slot in the scheduler's request slab.
    pub(crate) slot: u32,
    /// Its id; `None` once removed (the entry waits for `compact`).
    pub(crate) id: Option<RequestId>,
}

/// Running requests in queue order.
#[derive(Clone, Debug, Default)]
pub(crate) struct RunningQueue {
    entries: Vec<RunningEntry>,
    num_removed: usize,
}

impl RunningQueue {
    /// Live entries.
    pub(crate) fn len(&self) -> usize {
        self.entries.len() - self.num_removed
    }

    /// Entries, removed ones included: positions stay valid until
    /// [`RunningQueue::compact`], and a removed entry has `id: None`.
    pub(crate) fn positions(&self) -> usize {
        self.entries.len()
    }

    /// The entry at `position` (see [`RunningQueue::positions`]).
    pub(crate) fn at(&self, position: usize) -> RunningEntry {
        self.entries[position]
    }

    /// Live entries in queue order.
    pub(crate) fn iter(&self) -> impl DoubleEndedIterator<Item = (QueueKey, u32, RequestId)> + '_ {
        self.entries.iter().filter_map(|e| e.id.map(|id| (e.key, e.slot, id)))
    }

    /// The live request at `key`.
    pub(crate) fn get(&self, key: &QueueKey) -> Option<RequestId> {
        let i = self.entries.binary_search_by(|e| e.key.cmp(key)).ok()?;
        self.entries[i].id
    }

    /// Adds a request at its queue position. A running request's key is
    /// unique; a marked entry with the same key (the request itself, removed
    /// earlier in the same step) is reused — no path does that today, since
    /// admissions stop after a preemption, but the queue stays sorted if one
    /// does.
    pub(crate) fn insert(&mut self, key: QueueKey, slot: u32, id: RequestId) {
        let entry = RunningEntry { key, slot, id: Some(id) };
        match self.entries.binary_search_by(|e| e.key.cmp(&key)) {
            Ok(i) => {
                assert!(self.entries[i].id.is_none(), "{id}: key {key:?} is already running");
                self.entries[i] = entry;
                self.num_removed -= 1;
            }
            // Arrivals come in order: usually a push at the end.
            Err(i) => self.entries.insert(i, entry),
        }
    }

    /// Marks the request at `key` as removed; returns whether it was live.
    pub(crate) fn remove(&mut self, key: &QueueKey) -> bool {
        let Ok(i) = self.entries.binary_search_by(|e| e.key.cmp(key)) else { return false };
        let was_live = self.entries[i].id.take().is_some();
        self.num_removed += was_live as usize;
        was_live
    }

    /// Drops the removed entries (one pass, only when there are some).
    pub(crate) fn compact(&mut self) {
        if self.num_removed > 0 {
            self.entries.retain(|e| e.id.is_some());
            self.num_removed = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_queue_order_through_removal_reinsertion_and_compaction() {
        let mut q = RunningQueue::default();
        for (arrival, slot) in [(3u64, 30u32), (1, 10), (2, 20), (5, 50)] {
            q.insert((0, arrival), slot, RequestId(arrival));
        }
        let order = |q: &RunningQueue| q.iter().map(|(k, s, id)| (k.1, s, id.0)).collect::<Vec<_>>();
        assert_eq!(order(&q), [(1, 10, 1), (2, 20, 2), (3, 30, 3), (5, 50, 5)]);
        assert!(q.remove(&(0, 2)) && !q.remove(&(0, 2)) && !q.remove(&(0, 4)));
        assert_eq!((q.len(), q.positions()), (3, 4));
        assert_eq!(q.get(&(0, 2)), None);
        assert_eq!(q.at(1).id, None, "a removed entry keeps its position");
        // Preempted and admitted again in the same step: its entry is reused.
        q.insert((0, 2), 21, RequestId(2));
        assert_eq!((q.len(), q.positions()), (4, 4));
        assert_eq!(q.get(&(0, 2)), Some(RequestId(2)));
        q.remove(&(0, 3));
        q.insert((0, 4), 40, RequestId(4));
        assert_eq!(order(&q), [(1, 10, 1), (2, 21, 2), (4, 40, 4), (5, 50, 5)]);
        q.compact();
        assert_eq!((q.len(), q.positions()), (4, 4));
        assert_eq!(q.iter().rev().map(|e| e.2 .0).collect::<Vec<_>>(), [5, 4, 2, 1]);
    }

    #[test]
    #[should_panic(expected = "already running")]
    fn a_live_key_is_not_inserted_twice() {
        let mut q = RunningQueue::default();
        q.insert((0, 1), 1, RequestId(1));
        q.insert((0, 1), 2, RequestId(2));
    }
}
