//! Paged KV cache in host memory (placeholder until the optimised kernel lands).

use vellum_core::{BlockCopy, BlockSwap};

/// Shape of one layer's pools: K and V each `[num_blocks, block_size, num_kv_heads, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheLayout {
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
}

impl KvCacheLayout {
    /// Elements of one block.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.num_kv_heads * self.head_dim
    }
}

/// K and V pools of one layer.
pub struct LayerKvCache {
    /// Keys.
    pub k: Vec<f32>,
    /// Values.
    pub v: Vec<f32>,
}

impl LayerKvCache {
    /// Zeroed pools.
    pub fn new(layout: &KvCacheLayout) -> Self {
        let n = layout.num_blocks * layout.block_elems();
        Self { k: vec![0.0; n], v: vec![0.0; n] }
    }
}

/// Every layer's pools plus the host swap pool.
pub struct KvCache {
    /// Device layout.
    pub layout: KvCacheLayout,
    /// Device pools per layer.
    pub layers: Vec<LayerKvCache>,
    /// Host pools per layer.
    pub host_layers: Vec<LayerKvCache>,
    /// Blocks in the host pool.
    pub num_host_blocks: usize,
}

impl KvCache {
    /// Zeroed caches.
    pub fn new(layout: KvCacheLayout, num_layers: usize, num_host_blocks: usize) -> Self {
        let host = KvCacheLayout { num_blocks: num_host_blocks, ..layout };
        Self {
            layout,
            layers: (0..num_layers).map(|_| LayerKvCache::new(&layout)).collect(),
            host_layers: (0..num_layers).map(|_| LayerKvCache::new(&host)).collect(),
            num_host_blocks,
        }
    }

    /// Bytes of one block across layers, K and V.
    pub fn block_bytes(layout: &KvCacheLayout, num_layers: usize) -> u64 {
        (2 * num_layers * layout.block_elems() * 4) as u64
    }

    /// Copy-on-write copies.
    pub fn copy_blocks(&mut self, copies: &[BlockCopy]) {
        let e = self.layout.block_elems();
        for layer in &mut self.layers {
            for c in copies {
                let (s, d) = (c.src.index() * e, c.dst.index() * e);
                layer.k.copy_within(s..s + e, d);
                layer.v.copy_within(s..s + e, d);
            }
        }
    }

    /// Device ↔ host.
    pub fn swap_blocks(&mut self, swaps: &[BlockSwap], to_host: bool) {
        let e = self.layout.block_elems();
        for (dev, host) in self.layers.iter_mut().zip(self.host_layers.iter_mut()) {
            for s in swaps {
                let (d, h) = (s.device.index() * e, s.host.index() * e);
                if to_host {
                    host.k[h..h + e].copy_from_slice(&dev.k[d..d + e]);
                    host.v[h..h + e].copy_from_slice(&dev.v[d..d + e]);
                } else {
                    dev.k[d..d + e].copy_from_slice(&host.k[h..h + e]);
                    dev.v[d..d + e].copy_from_slice(&host.v[h..h + e]);
                }
            }
        }
    }
}
