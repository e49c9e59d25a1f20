//! `IdMap`: a `HashMap` keyed by our integer ids with a cheap hash.
//!
//! Ids are small integers handed out by the engine, not attacker-chosen, so
//! SipHash's flooding protection buys nothing on the scheduler's hot path;
//! a multiply-shift hash (Fibonacci hashing) spreads them well enough.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hasher for integer ids.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, i: u32) {
        self.write_u64(i as u64);
    }

    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0 ^ i).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    }

    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }
}

/// A `HashMap` over integer ids.
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// A `HashSet` over integer ids.
pub type IdSet<K> = std::collections::HashSet<K, BuildHasherDefault<IdHasher>>;
