//! `IdSlab`: values keyed by integer ids, stored densely and addressed by
//! slot, so that hot loops can prefetch them.
//!
//! A `HashMap<Id, V>` keeps `V` inline in its buckets, so every lookup of a
//! large value is a probe whose key comparison reads the value's own cache
//! line: a miss the CPU cannot start before the probe, and a probe that
//! cannot be issued ahead of time. `IdSlab` keeps the values in a `Vec` and
//! only a small `id → slot` index in a hash map (16 bytes an entry, a few
//! kilobytes for a thousand requests, so it stays in L1/L2). Finding a
//! value's address is then cheap, and [`IdSlab::prefetch`] can start the load
//! of a value several iterations before it is used. At 1,000 running
//! requests the scheduler's step is bound by exactly these misses
//! (docs/benchmarks.md, "Scheduler step").
//!
//! Freed slots are reused (last freed, first reused), so the slab never
//! grows beyond the most values live at once.

use crate::IdMap;
use std::hash::Hash;

/// Values keyed by integer ids, stored in a dense vector of slots.
#[derive(Clone, Debug)]
pub struct IdSlab<K, V> {
    slots: Vec<Option<(K, V)>>,
    index: IdMap<K, u32>,
    free: Vec<u32>,
}

impl<K, V> Default for IdSlab<K, V> {
    fn default() -> Self {
        Self { slots: Vec::new(), index: IdMap::default(), free: Vec::new() }
    }
}

impl<K: Copy + Eq + Hash, V> IdSlab<K, V> {
    /// Number of live values.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no value is live.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Whether `key` is live.
    pub fn contains_key(&self, key: &K) -> bool {
        self.index.contains_key(key)
    }

    fn slot(&self, key: &K) -> Option<usize> {
        self.index.get(key).map(|&s| s as usize)
    }

    /// The value of `key`.
    pub fn get(&self, key: &K) -> Option<&V> {
        let slot = self.slot(key)?;
        self.slots[slot].as_ref().map(|(_, v)| v)
    }

    /// The value of `key`, mutably.
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        let slot = self.slot(key)?;
        self.slots[slot].as_mut().map(|(_, v)| v)
    }

    /// The slot of `key`: its value's address in the slab while the key
    /// stays live (a slot is reused once its key is removed, so a holder of
    /// a slot checks the key it finds there: [`IdSlab::get_slot`]).
    pub fn slot_of(&self, key: &K) -> Option<u32> {
        self.index.get(key).copied()
    }

    /// The key and value in `slot`, if one is live there: an index, no probe.
    pub fn get_slot(&self, slot: u32) -> Option<(&K, &V)> {
        self.slots.get(slot as usize)?.as_ref().map(|(k, v)| (k, v))
    }

    /// The key and value in `slot`, the value mutably.
    pub fn get_slot_mut(&mut self, slot: u32) -> Option<(&K, &mut V)> {
        self.slots.get_mut(slot as usize)?.as_mut().map(|(k, v)| (&*k, v))
    }

    /// Inserts `value` under `key`; returns the value it replaces.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        if let Some(slot) = self.slot(&key) {
            return self.slots[slot].replace((key, value)).map(|(_, v)| v);
        }
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize] = Some((key, value));
                s
            }
            None => {
                let s = u32::try_from(self.slots.len()).expect("fewer than 2^32 live ids");
                self.slots.push(Some((key, value)));
                s
            }
        };
        self.index.insert(key, slot);
        None
    }

    /// Removes `key`; returns its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let slot = self.index.remove(key)?;
        self.free.push(slot);
        self.slots[slot as usize].take().map(|(_, v)| v)
    }

    /// Live `(key, value)` pairs, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.slots.iter().filter_map(|e| e.as_ref().map(|(k, v)| (k, v)))
    }

    /// Live values, in slot order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }

    /// Starts loading the value of `key` into the cache (the index probe is
    /// the only memory it reads now). A hint: it changes no result.
    pub fn prefetch(&self, key: &K) {
        if let Some(slot) = self.slot(key) {
            prefetch(&self.slots[slot]);
        }
    }
}

impl<K: Copy + Eq + Hash, V> std::ops::Index<&K> for IdSlab<K, V> {
    type Output = V;

    fn index(&self, key: &K) -> &V {
        self.get(key).expect("IdSlab: no value for this key")
    }
}

impl<'a, K: Copy + Eq + Hash, V> IntoIterator for &'a IdSlab<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = Box<dyn Iterator<Item = (&'a K, &'a V)> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

/// Starts loading the cache lines of `*x` (at most its first four) for a
/// read soon. A hint with no effect on results; a no-op off x86_64.
#[inline(always)]
pub fn prefetch<T>(x: *const T) {
    #[cfg(target_arch = "x86_64")]
    {
        let bytes = std::mem::size_of::<T>().clamp(1, 256);
        let mut line = 0;
        while line < bytes {
            // SAFETY: a prefetch never faults, whatever the address, and
            // reads nothing the program sees; SSE is part of x86_64.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(x.cast::<i8>().wrapping_add(line)) };
            line += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RequestId;

    #[test]
    fn slots_are_reused_and_lookups_follow_keys() {
        let mut s: IdSlab<RequestId, String> = IdSlab::default();
        assert!(s.insert(RequestId(7), "a".into()).is_none());
        assert!(s.insert(RequestId(9), "b".into()).is_none());
        assert_eq!(s.insert(RequestId(7), "c".into()).as_deref(), Some("a"));
        assert_eq!(s.len(), 2);
        assert_eq!(s.remove(&RequestId(7)).as_deref(), Some("c"));
        assert!(s.get(&RequestId(7)).is_none() && !s.contains_key(&RequestId(7)));
        s.insert(RequestId(3), "d".into());
        assert_eq!(s.slots.len(), 2, "the freed slot was reused");
        assert_eq!(s[&RequestId(3)], "d");
        assert_eq!(s[&RequestId(9)], "b");
        s.get_mut(&RequestId(9)).unwrap().push('!');
        let mut all: Vec<(u64, String)> = s.iter().map(|(k, v)| (k.0, v.clone())).collect();
        all.sort();
        assert_eq!(all, [(3, "d".to_string()), (9, "b!".to_string())]);
        let slot = s.slot_of(&RequestId(3)).unwrap();
        assert_eq!(s.get_slot(slot), Some((&RequestId(3), &"d".to_string())));
        s.get_slot_mut(slot).unwrap().1.push('?');
        assert_eq!(s[&RequestId(3)], "d?");
        assert!(s.slot_of(&RequestId(42)).is_none() && s.get_slot(99).is_none());
        s.prefetch(&RequestId(3));
        s.prefetch(&RequestId(42));
        assert_eq!(s.remove(&RequestId(42)), None);
    }
}
