//! The contract between the engine and a backend that runs a model.

use crate::{Error, ForwardBatch, KvCacheSize, KvMemory, Result};

/// Logits of the rows a [`ForwardBatch`] asked for, brought to the host for
/// sampling.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutput {
    /// Row-major `[logits_indices.len(), vocab_size]`; empty when `argmax`
    /// is given.
    pub logits: Vec<f32>,
    /// Width of a row.
    pub vocab_size: usize,
    /// Per row, its largest logit's token (the lowest id among equals),
    /// computed where the logits are: only for a batch that is
    /// [`ForwardBatch::argmax_only`], and only by a backend that does it;
    /// empty otherwise.
    pub argmax: Vec<u32>,
    /// Row-major `[logits_indices.len(), hidden_size]` final hidden states,
    /// for a batch that asked for [`ForwardBatch::hidden_states`]; the
    /// logits are empty then.
    pub hidden_states: Vec<f32>,
    /// Width of a hidden-state row (0 without them).
    pub hidden_size: usize,
    /// Per logits row, the token the backend sampled, for a batch with
    /// [`ForwardBatch::sampling`] whose backend samples on its device;
    /// empty otherwise (the logits or the argmax come back instead).
    pub samples: Vec<DeviceSample>,
}

/// A token sampled where the logits are ([`StepOutput::samples`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceSample {
    /// The token.
    pub token: u32,
    /// Its logprob under the model (before penalties and filters); NaN
    /// unless the row asked for it.
    pub logprob: f32,
    /// The row's `num_logprobs` most likely (token, logprob), most likely
    /// first (ties: the lower id).
    pub top_logprobs: Vec<(u32, f32)>,
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
            // Unresolved (no scheduler budgets here): the cap, within half the free memory.
            KvCacheSize::Auto => (KvCacheSize::resolve_auto(u64::MAX, memory.available_bytes).0 / per_block) as usize,
            KvCacheSize::FractionOfFree(f) => ((memory.available_bytes as f64 * f as f64) as u64 / per_block) as usize,
            KvCacheSize::DeviceFraction(f) => (device_fraction_bytes(f, memory)? / per_block) as usize,
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

    /// Memory profiling (thesis §4.2.1): runs a dummy forward pass of
    /// `num_tokens` prompt tokens spread over up to `num_seqs` sequences
    /// (the step budget), every row's logits computed (a step of prompt
    /// logprobs), so that [`ModelExecutor::kv_memory`] reports the
    /// activation memory it took at its peak, plus the attention workspace
    /// the backend needs for contexts of `max_model_len`, and returns that.
    /// 0 where the backend's memory is the host's (no run).
    fn profile_run(&mut self, num_tokens: usize, num_seqs: usize, max_model_len: usize, block_size: usize) -> Result<u64> {
        let _ = (num_tokens, num_seqs, max_model_len, block_size);
        Ok(0)
    }

    /// Runs the model over `token_ids` (a fixed calibration text, one
    /// sequence) so that a backend that needs statistics of real
    /// activations can take them (the CPU's int8 path: its outlier
    /// channels; an FP8 KV cache: each layer's scales, from the largest
    /// keys and values of the pass); then a second pass, which fixes what
    /// they decided. Call it once, before the KV cache is allocated and
    /// before serving; a no-op where nothing needs it.
    fn calibrate(&mut self, token_ids: &[u32]) -> Result<()> {
        let _ = token_ids;
        Ok(())
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

    /// Records, once the KV cache is allocated and before serving, the
    /// decode steps the backend replays (CUDA graphs) for batches of up to
    /// `max_num_seqs` sequences, so that no request waits for a recording;
    /// `None` where the backend records none. The dummy steps write KV
    /// slots of blocks no request holds yet.
    fn capture_graphs(&mut self, max_num_seqs: usize) -> Result<Option<GraphCapture>> {
        let _ = max_num_seqs;
        Ok(None)
    }

    /// Applies `batch.block_ops`, runs the forward pass, returns logits.
    fn execute(&mut self, batch: &ForwardBatch) -> Result<StepOutput>;

    /// Whether [`ModelExecutor::execute`] samples the rows of a batch with
    /// [`ForwardBatch::sampling`] on its device (then the engine fills it
    /// in; a backend whose logits are on the host already leaves it false).
    fn samples_on_device(&self) -> bool {
        false
    }

    /// Takes back a step's logits once sampled, so that the next step can
    /// write into the same memory (a 64-row Gemma 3 step's logits are 67 MB:
    /// fresh pages every step cost a tenth of it in page faults).
    fn recycle_logits(&mut self, logits: Vec<f32>) {
        drop(logits);
    }
}

/// What [`ModelExecutor::capture_graphs`] recorded.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GraphCapture {
    /// Decode shapes recorded (batch sizes).
    pub graphs: usize,
    /// Seconds it took, the eager warm-up of each shape included.
    pub seconds: f64,
    /// Device memory the recorded graphs hold.
    pub memory_bytes: u64,
    /// What the KV cache's sizing left for them (0 when it was not sized
    /// from the device's memory).
    pub reserved_bytes: u64,
}

/// The KV cache's share under `--gpu-memory-utilization f`: `f` of the
/// device, less what is in use (weights, the runtime) and the profile run's
/// activation peak, and the memory recorded decode steps hold.
fn device_fraction_bytes(f: f32, memory: KvMemory) -> Result<u64> {
    let d = memory.device.ok_or_else(|| Error::InvalidConfig {
        field: "gpu_memory_utilization",
        message: "applies to a GPU (--device cuda); size this device's cache with --kv-cache-memory".into(),
    })?;
    let budget = (d.total_bytes as f64 * f as f64) as u64;
    let in_use = d.total_bytes.saturating_sub(d.free_bytes);
    let taken = in_use + d.activation_peak_bytes + d.graph_reserve_bytes;
    if taken >= budget {
        return Err(Error::InvalidConfig {
            field: "gpu_memory_utilization",
            message: format!(
                "{f} of {} MiB leaves nothing for the KV cache: {} MiB are in use (weights — on --device cuda with their bf16 copies, --cuda-bf16-weight-copies — and the runtime), a forward pass of the step budget takes {} MiB more and recorded decode steps {} MiB; raise it or lower --max-num-batched-tokens",
                d.total_bytes >> 20,
                in_use >> 20,
                d.activation_peak_bytes >> 20,
                d.graph_reserve_bytes >> 20
            ),
        });
    }
    Ok(budget - taken)
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

    fn profile_run(&mut self, num_tokens: usize, num_seqs: usize, max_model_len: usize, block_size: usize) -> Result<u64> {
        (**self).profile_run(num_tokens, num_seqs, max_model_len, block_size)
    }

    fn num_kv_blocks(&self, size: KvCacheSize, block_size: usize) -> Result<usize> {
        (**self).num_kv_blocks(size, block_size)
    }

    fn calibrate(&mut self, token_ids: &[u32]) -> Result<()> {
        (**self).calibrate(token_ids)
    }

    fn kv_group_windows(&self) -> Vec<Option<usize>> {
        (**self).kv_group_windows()
    }

    fn initialize_kv_cache(&mut self, num_blocks: usize, num_host_blocks: usize, block_size: usize) -> Result<()> {
        (**self).initialize_kv_cache(num_blocks, num_host_blocks, block_size)
    }

    fn capture_graphs(&mut self, max_num_seqs: usize) -> Result<Option<GraphCapture>> {
        (**self).capture_graphs(max_num_seqs)
    }

    fn execute(&mut self, batch: &ForwardBatch) -> Result<StepOutput> {
        (**self).execute(batch)
    }

    fn samples_on_device(&self) -> bool {
        (**self).samples_on_device()
    }

    fn recycle_logits(&mut self, logits: Vec<f32>) {
        (**self).recycle_logits(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeviceMemory;

    fn gpu(total: u64, free: u64, peak: u64) -> KvMemory {
        KvMemory {
            available_bytes: free,
            max_blocks: None,
            device: Some(DeviceMemory { total_bytes: total, free_bytes: free, activation_peak_bytes: peak, graph_reserve_bytes: 0 }),
        }
    }

    #[test]
    fn gpu_memory_utilization_leaves_the_weights_and_the_profiled_activations_out() {
        // 100 GiB device, 10 in use (weights, runtime), 5 of activations at the peak: 0.9 gives 75.
        let g = 1u64 << 30;
        let kv = device_fraction_bytes(0.9, gpu(100 * g, 90 * g, 5 * g)).expect("room");
        assert!(kv.abs_diff(75 * g) < 1 << 20, "{kv}"); // 0.9 is not exact in f32
                                                        // Nothing left: a typed error that names the flag and the numbers.
        let e = device_fraction_bytes(0.1, gpu(100 * g, 90 * g, 5 * g)).expect_err("no room").to_string();
        assert!(e.contains("gpu_memory_utilization") && e.contains("10240 MiB are in use"), "{e}");
        // Recorded decode steps' memory comes out of the cache's share too.
        let mut with_graphs = gpu(100 * g, 90 * g, 5 * g);
        with_graphs.device.as_mut().unwrap().graph_reserve_bytes = 2 * g;
        let kv = device_fraction_bytes(0.9, with_graphs).expect("room");
        assert!(kv.abs_diff(73 * g) < 1 << 20, "{kv}");
        // Host memory has no device totals.
        let host = KvMemory { available_bytes: g, max_blocks: None, device: None };
        assert!(device_fraction_bytes(0.9, host).is_err());
    }
}
