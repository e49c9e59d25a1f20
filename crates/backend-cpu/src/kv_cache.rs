//! The paged KV cache in host memory: one K pool and one V pool per layer,
//! plus a host swap pool with the same per-block layout.
//!
//! Every pool is one row-major `f32` tensor:
//!
//! ```text
//! K (and V) of one layer:  [num_blocks, block_size, num_kv_heads, head_dim]
//!
//!   block 0                      block 1                      ...
//!   ┌──────────────────────────┐ ┌──────────────────────────┐
//!   │ slot 0: h0[hd] h1[hd] …  │ │ slot bs:   h0[hd] …      │
//!   │ slot 1: h0[hd] h1[hd] …  │ │ slot bs+1: h0[hd] …      │
//!   │ …  (block_size slots)    │ │ …                        │
//!   └──────────────────────────┘ └──────────────────────────┘
//!
//! slot = block_id * block_size + offset      (the slot mapping's numbering)
//! element (slot, kv_head, d) = k[(slot * num_kv_heads + kv_head) * head_dim + d]
//! ```
//!
//! A block is therefore one contiguous run of
//! [`KvCacheLayout::block_elems`] floats in each pool, so copy-on-write and
//! swapping are plain slice copies, two per layer (K and V).

use vellum_core::{BlockCopy, BlockSwap};

/// Shape of the paged KV cache of one layer: K and V each
/// `[num_blocks, block_size, num_kv_heads, head_dim]`, row-major `f32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheLayout {
    /// Physical blocks in the pool.
    pub num_blocks: usize,
    /// Tokens (slots) per block.
    pub block_size: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl KvCacheLayout {
    /// Floats one block takes in one pool: `block_size * num_kv_heads * head_dim`.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.num_kv_heads * self.head_dim
    }

    /// Floats one slot (one token) takes in one pool: `num_kv_heads * head_dim`.
    pub fn slot_elems(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Floats of one whole pool: `num_blocks * block_elems()`.
    pub fn pool_elems(&self) -> usize {
        self.num_blocks * self.block_elems()
    }

    /// Slots in the pool: `num_blocks * block_size`.
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

/// K and V pools of one layer, each [`KvCacheLayout::pool_elems`] floats.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerKvCache {
    /// Keys, `[num_blocks, block_size, num_kv_heads, head_dim]`.
    pub k: Vec<f32>,
    /// Values, same layout as `k`.
    pub v: Vec<f32>,
}

impl LayerKvCache {
    /// Zeroed pools for `layout`.
    pub fn new(layout: &KvCacheLayout) -> Self {
        let n = layout.pool_elems();
        Self {
            k: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    /// Asserts that both pools have the size `layout` implies.
    pub(crate) fn assert_layout(&self, layout: &KvCacheLayout, what: &str) {
        let n = layout.pool_elems();
        assert!(
            self.k.len() == n && self.v.len() == n,
            "{what}: K/V pools hold {}/{} floats, layout {layout:?} needs {n}",
            self.k.len(),
            self.v.len()
        );
    }
}

/// All layers plus the host swap pool.
///
/// `layers[l]` is layer `l` in the device pool (`layout.num_blocks` blocks);
/// `host_layers[l]` is layer `l` in the host pool (`num_host_blocks` blocks,
/// otherwise the same layout). On the CPU backend both live in host memory;
/// the split keeps block ids of the two pools apart, as on a GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct KvCache {
    /// Layout of one layer of the device pool.
    pub layout: KvCacheLayout,
    /// Device pool, one entry per layer.
    pub layers: Vec<LayerKvCache>,
    /// Host swap pool, one entry per layer, `num_host_blocks` blocks each.
    pub host_layers: Vec<LayerKvCache>,
    /// Blocks in the host pool.
    pub num_host_blocks: usize,
}

impl KvCache {
    /// Zeroed device and host pools for `num_layers` layers.
    pub fn new(layout: KvCacheLayout, num_layers: usize, num_host_blocks: usize) -> Self {
        let host_layout = Self::host_layout_of(&layout, num_host_blocks);
        Self {
            layout,
            layers: (0..num_layers)
                .map(|_| LayerKvCache::new(&layout))
                .collect(),
            host_layers: (0..num_layers)
                .map(|_| LayerKvCache::new(&host_layout))
                .collect(),
            num_host_blocks,
        }
    }

    /// Bytes one block takes across all layers (K and V, `f32`).
    pub fn block_bytes(layout: &KvCacheLayout, num_layers: usize) -> u64 {
        // K and V, 4 bytes per f32.
        2 * layout.block_elems() as u64 * std::mem::size_of::<f32>() as u64 * num_layers as u64
    }

    /// Layout of one layer of the host pool.
    pub fn host_layout(&self) -> KvCacheLayout {
        Self::host_layout_of(&self.layout, self.num_host_blocks)
    }

    /// One batched copy for copy-on-write: every layer, K and V, `src` block
    /// → `dst` block. Copies apply in order.
    ///
    /// # Panics
    /// If a block id is outside the device pool.
    pub fn copy_blocks(&mut self, copies: &[BlockCopy]) {
        let n = self.layout.block_elems();
        for c in copies {
            let (src, dst) = (c.src.index(), c.dst.index());
            assert!(
                src < self.layout.num_blocks && dst < self.layout.num_blocks,
                "copy_blocks: {} -> {} outside the device pool of {} blocks",
                c.src,
                c.dst,
                self.layout.num_blocks
            );
            for layer in &mut self.layers {
                layer.k.copy_within(src * n..(src + 1) * n, dst * n);
                layer.v.copy_within(src * n..(src + 1) * n, dst * n);
            }
        }
    }

    /// Moves blocks between the pools: `to_host = true` copies each device
    /// block to its host block, `false` the host block back to the device
    /// block. Every layer, K and V.
    ///
    /// # Panics
    /// If a block id is outside its pool.
    pub fn swap_blocks(&mut self, swaps: &[BlockSwap], to_host: bool) {
        let n = self.layout.block_elems();
        for s in swaps {
            let (dev, host) = (s.device.index(), s.host.index());
            assert!(
                dev < self.layout.num_blocks,
                "swap_blocks: {} outside the device pool of {} blocks",
                s.device,
                self.layout.num_blocks
            );
            assert!(
                host < self.num_host_blocks,
                "swap_blocks: host block {} outside the host pool of {} blocks",
                s.host.0,
                self.num_host_blocks
            );
            let (d, h) = (dev * n..(dev + 1) * n, host * n..(host + 1) * n);
            for (device, host) in self.layers.iter_mut().zip(&mut self.host_layers) {
                if to_host {
                    host.k[h.clone()].copy_from_slice(&device.k[d.clone()]);
                    host.v[h.clone()].copy_from_slice(&device.v[d.clone()]);
                } else {
                    device.k[d.clone()].copy_from_slice(&host.k[h.clone()]);
                    device.v[d.clone()].copy_from_slice(&host.v[h.clone()]);
                }
            }
        }
    }

    fn host_layout_of(layout: &KvCacheLayout, num_host_blocks: usize) -> KvCacheLayout {
        KvCacheLayout {
            num_blocks: num_host_blocks,
            ..*layout
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_bytes_counts_k_and_v_of_every_layer() {
        let layout = KvCacheLayout {
            num_blocks: 10,
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
        };
        assert_eq!(layout.block_elems(), 16 * 3 * 64);
        assert_eq!(KvCache::block_bytes(&layout, 30), 2 * 16 * 3 * 64 * 4 * 30);
        let cache = KvCache::new(layout, 2, 4);
        assert_eq!(cache.layers[1].k.len(), 10 * 16 * 3 * 64);
        assert_eq!(cache.host_layers[1].v.len(), 4 * 16 * 3 * 64);
    }
}
