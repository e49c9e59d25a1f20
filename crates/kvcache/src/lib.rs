//! # vellum-kvcache — the paged KV-cache manager
//!
//! PagedAttention's memory manager (paper §4.2–4.5, thesis §3.4, Listing
//! 4.2): KV memory is cut into fixed-size blocks; each sequence maps its
//! logical blocks to physical ones through a block table; blocks are shared
//! by reference count (parallel samples, beam candidates, common prefixes) and
//! copied on write.
//!
//! Reading order, bottom up:
//! [`FreeBlockQueue`] → [`BlockPool`] (reference counts, the prefix cache's
//! hash → block map) → [`KvCacheManager`] (block tables, copy-on-write,
//! prefix caching, swap). [`OrcaAllocator`] over a [`BuddyAllocator`] is the
//! paper's contiguous-reservation baseline.
//!
//! **Architecture invariant:** this crate never sees a tensor. It hands out
//! block ids and lists of block copies/swaps; the backend moves the bytes.
//! Both allocators implement [`vellum_base::BlockAllocator`], the only
//! interface the scheduler uses. Running out of blocks is a value (`None`),
//! not an error; a broken contract (double free, writing into a shared block)
//! panics with a message.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod block_hash;
mod block_pool;
mod buddy_allocator;
mod free_queue;
mod host_pool;
mod kv_cache_manager;
mod orca;

pub use block_hash::{group_block_hash, hash_block_tokens, BlockHash};
pub use block_pool::BlockPool;
pub use buddy_allocator::BuddyAllocator;
pub use free_queue::FreeBlockQueue;
pub use host_pool::HostPool;
pub use kv_cache_manager::{max_blocks_held, KvCacheManager, KvCacheManagerConfig};
pub use orca::{OrcaAllocator, OrcaMode};
