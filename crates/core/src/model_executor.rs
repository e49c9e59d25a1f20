//! The contract between the engine and a backend that runs a model.

use crate::{ForwardBatch, Result};

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
    /// Bytes one KV block of `block_size` tokens takes across all layers.
    fn kv_block_bytes(&self, block_size: usize) -> u64;

    /// Memory profiling (thesis §4.2.1): how many KV blocks fit in
    /// `budget_bytes` once weights and activations are accounted for.
    fn num_kv_blocks_for_budget(&self, budget_bytes: u64, block_size: usize) -> usize {
        let per_block = self.kv_block_bytes(block_size).max(1);
        (budget_bytes / per_block) as usize
    }

    /// Allocates the device pool and the host swap pool.
    fn initialize_kv_cache(&mut self, num_blocks: usize, num_host_blocks: usize, block_size: usize) -> Result<()>;

    /// Applies `batch.block_ops`, runs the forward pass, returns logits.
    fn execute(&mut self, batch: &ForwardBatch) -> Result<StepOutput>;
}

impl<T: ModelExecutor + ?Sized> ModelExecutor for Box<T> {
    fn kv_block_bytes(&self, block_size: usize) -> u64 {
        (**self).kv_block_bytes(block_size)
    }

    fn num_kv_blocks_for_budget(&self, budget_bytes: u64, block_size: usize) -> usize {
        (**self).num_kv_blocks_for_budget(budget_bytes, block_size)
    }

    fn initialize_kv_cache(&mut self, num_blocks: usize, num_host_blocks: usize, block_size: usize) -> Result<()> {
        (**self).initialize_kv_cache(num_blocks, num_host_blocks, block_size)
    }

    fn execute(&mut self, batch: &ForwardBatch) -> Result<StepOutput> {
        (**self).execute(batch)
    }
}
