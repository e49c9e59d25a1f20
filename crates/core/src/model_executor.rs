//! The contract between the engine and a backend that runs a model.

use crate::{Error, ForwardBatch, KvCacheSize, KvMemory, Result};

/// Logits of the rows a [`ForwardBatch`] asked for, brought to the host for
/// sampling.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutput {
    /// Row-major `[logits_indices.len(), vocab_size]`.
    pub logits: Vec<f32>,
    /// Width of a row.
    pub vocab_size: usize,
}

/// Runs a model's forward pass over a paged KV cache that it owns.
pub trait ModelExecutor {
    /// The backend and device, for logs.
    fn describe(&self) -> String;

    /// Bytes one KV block of `block_size` tokens takes across all layers.
    fn kv_block_bytes(&self, block_size: usize) -> u64;

    /// What the device can give the KV cache once the weights are loaded.
    fn kv_memory(&self, block_size: usize) -> KvMemory;

    /// Memory profiling (thesis §4.2.1): how many KV blocks of `block_size`
    /// tokens to allocate for `size`, within the device's limits.
    fn num_kv_blocks(&self, size: KvCacheSize, block_size: usize) -> Result<usize> {
        let per_block = self.kv_block_bytes(block_size).max(1);
        let memory = self.kv_memory(block_size);
        let wanted = match size {
            KvCacheSize::NumBlocks(n) => n,
            KvCacheSize::MemoryBytes(b) => (b / per_block) as usize,
            KvCacheSize::FractionOfFree(f) => ((memory.available_bytes as f64 * f as f64) as u64 / per_block) as usize,
        };
        // A device that addresses fewer blocks per pool caps the cache there.
        let blocks = memory.max_blocks.map_or(wanted, |max| wanted.min(max));
        if blocks == 0 {
            return Err(Error::InvalidConfig {
                field: "kv_cache_memory",
                message: format!("no KV block of {per_block} bytes fits ({size:?}, {} bytes available)", memory.available_bytes),
            });
        }
        Ok(blocks)
    }

    /// The window of each KV-cache group, in block-table order (see
    /// [`KvCacheGroups`](crate::KvCacheGroups)): the KV-cache manager keeps a
    /// block table per group and releases the blocks that slid out of a
    /// group's window. One full-attention group by default.
    fn kv_group_windows(&self) -> Vec<Option<usize>> {
        vec![None]
    }

    /// Allocates the device pool and the host swap pool.
    fn initialize_kv_cache(&mut self, num_blocks: usize, num_host_blocks: usize, block_size: usize) -> Result<()>;

    /// Applies `batch.block_ops`, runs the forward pass, returns logits.
    fn execute(&mut self, batch: &ForwardBatch) -> Result<StepOutput>;

    /// Takes back a step's logits once sampled, so that the next step can
    /// write into the same memory (a 64-row Gemma 3 step's logits are 67 MB:
    /// fresh pages every step cost a tenth of it in page faults).
    fn recycle_logits(&mut self, logits: Vec<f32>) {
        drop(logits);
    }
}

impl<T: ModelExecutor + ?Sized> ModelExecutor for Box<T> {
    fn describe(&self) -> String {
        (**self).describe()
    }

    fn kv_block_bytes(&self, block_size: usize) -> u64 {
        (**self).kv_block_bytes(block_size)
    }

    fn kv_memory(&self, block_size: usize) -> KvMemory {
        (**self).kv_memory(block_size)
    }

    fn num_kv_blocks(&self, size: KvCacheSize, block_size: usize) -> Result<usize> {
        (**self).num_kv_blocks(size, block_size)
    }

    fn kv_group_windows(&self) -> Vec<Option<usize>> {
        (**self).kv_group_windows()
    }

    fn initialize_kv_cache(&mut self, num_blocks: usize, num_host_blocks: usize, block_size: usize) -> Result<()> {
        (**self).initialize_kv_cache(num_blocks, num_host_blocks, block_size)
    }

    fn execute(&mut self, batch: &ForwardBatch) -> Result<StepOutput> {
        (**self).execute(batch)
    }

    fn recycle_logits(&mut self, logits: Vec<f32>) {
        (**self).recycle_logits(logits)
    }
}
