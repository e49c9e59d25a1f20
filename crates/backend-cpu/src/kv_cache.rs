//! The paged KV cache in host memory: one K pool and one V pool per layer,
//! plus a host swap pool with the same per-block layout.
//!
//! Every pool is one row-major tensor of the cache's [`KvCacheDtype`]
//! (`f32`, `f16`, `bf16` or FP8 E4M3; see [`KvPool`]):
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
//! [`KvCacheLayout::block_elems`] elements in each pool, so copy-on-write and
//! swapping are plain slice copies, two per layer (K and V), whatever the
//! dtype. Only [`crate::paged_attention::write_kv`] (rounding `f32` to the
//! storage type) and the attention kernel (widening back to `f32`, tile by
//! tile) look inside the elements. An FP8 pool stores each layer's values
//! divided by the layer's [`KvScale`] ([`KvCache::scales`]); swaps and
//! copies move the codes as they are, since a layer keeps its scale.

use std::ops::Range;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use vellum_base::{BlockCopy, BlockSwap, KvCacheDtype, KvCacheGroups, KvLayerSlot, KvScale};

/// Shape of the paged KV cache of one layer: K and V each
/// `[num_blocks, block_size, num_kv_heads, head_dim]`, row-major (elements of
/// the cache's dtype).
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
    /// Elements one block takes in one pool: `block_size * num_kv_heads * head_dim`.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.num_kv_heads * self.head_dim
    }

    /// Elements one slot (one token) takes in one pool: `num_kv_heads * head_dim`.
    pub fn slot_elems(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Elements of one whole pool: `num_blocks * block_elems()`.
    pub fn pool_elems(&self) -> usize {
        self.num_blocks * self.block_elems()
    }

    /// Slots in the pool: `num_blocks * block_size`.
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

/// One pool's elements in the cache's storage type ([`KvCacheDtype`]):
/// `f32` (exact), `f16`/`bf16` (half the memory; values are rounded to
/// nearest-even when written and widened to `f32` when read), or FP8 E4M3
/// (a quarter; values divided by the layer's scale, then rounded).
#[derive(Clone, Debug, PartialEq)]
pub enum KvPool {
    /// 4 bytes per element.
    F32(PoolBuf<f32>),
    /// 2 bytes per element: 10-bit mantissa, range ±65504.
    F16(PoolBuf<f16>),
    /// 2 bytes per element: 7-bit mantissa, the range of `f32`.
    Bf16(PoolBuf<bf16>),
    /// 1 byte per element: 3-bit mantissa, ±448 ([`vellum_base::fp8`]).
    Fp8E4m3(PoolBuf<Fp8E4m3>),
}

/// One FP8 E4M3 code ([`vellum_base::fp8`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Fp8E4m3(pub u8);

impl Fp8E4m3 {
    /// The code nearest `x` (ties to even, saturating at ±448).
    pub fn from_f32(x: f32) -> Self {
        Self(vellum_base::fp8::from_f32(x))
    }

    /// The code's value.
    pub fn to_f32(self) -> f32 {
        vellum_base::fp8::to_f32(self.0)
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
    impl Sealed for super::Fp8E4m3 {}
}

/// An element a [`PoolBuf`] holds: a plain value type every bit pattern of
/// which is a value, all-zero bits being +0.0 (`f32`, `f16`, `bf16`, FP8).
pub trait PoolElem: Copy + PartialEq + std::fmt::Debug + Send + Sync + sealed::Sealed + 'static {}
impl PoolElem for f32 {}
impl PoolElem for f16 {}
impl PoolElem for bf16 {}
impl PoolElem for Fp8E4m3 {}

/// `len` elements in an anonymous memory map of their own, zeros until
/// written: the OS maps a page when a block in it is first written, so a
/// cache sized for 256 requests costs the memory of the blocks in use and a
/// server answers before any of it is touched; dropping the pool gives its
/// pages back. (From the heap, a pool freed and allocated again would be
/// cleared by `calloc`, every page touched: the backend keeps freed heap
/// memory in the process.)
pub struct PoolBuf<T: PoolElem> {
    /// `None` for no elements (a map cannot be empty).
    map: Option<memmap2::MmapMut>,
    len: usize,
    _elem: std::marker::PhantomData<T>,
}

impl<T: PoolElem> PoolBuf<T> {
    /// `len` zeros, none of them resident yet.
    pub fn zeroed(len: usize) -> std::io::Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("a pool of {len} elements overflows")))?;
        let map = if bytes == 0 { None } else { Some(memmap2::MmapMut::map_anon(bytes)?) };
        Ok(Self { map, len, _elem: std::marker::PhantomData })
    }
}

impl<T: PoolElem> std::ops::Deref for PoolBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.map {
            // SAFETY: the map is page-aligned (past `T`'s alignment), holds
            // `len · size_of::<T>()` initialized bytes (zeros, then what was
            // written), every bit pattern of a `PoolElem` is a value, and the
            // slice borrows `self`, which owns the map.
            Some(m) => unsafe { std::slice::from_raw_parts(m.as_ptr().cast::<T>(), self.len) },
            None => &[],
        }
    }
}

impl<T: PoolElem> std::ops::DerefMut for PoolBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.map {
            // SAFETY: as in `deref`; `&mut self` makes the borrow unique.
            Some(m) => unsafe { std::slice::from_raw_parts_mut(m.as_mut_ptr().cast::<T>(), self.len) },
            None => &mut [],
        }
    }
}

impl<T: PoolElem> Clone for PoolBuf<T> {
    /// # Panics
    /// If the OS refuses the new map.
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed(self.len).unwrap_or_else(|e| panic!("cloning a KV pool of {} elements: {e}", self.len));
        copy.copy_from_slice(self);
        copy
    }
}

impl<T: PoolElem> std::fmt::Debug for PoolBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PoolBuf<{}>({} elements)", std::any::type_name::<T>(), self.len)
    }
}

impl<T: PoolElem> PartialEq for PoolBuf<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl KvPool {
    /// `n` zeros of type `dtype`, none of them resident yet ([`PoolBuf`]):
    /// the engine's default size keeps to half the memory free at startup
    /// ([`vellum_base::KvCacheSize::Auto`]), so the pages it may touch
    /// later are there.
    pub fn try_zeros(dtype: KvCacheDtype, n: usize) -> std::io::Result<Self> {
        Ok(match dtype {
            KvCacheDtype::F32 => KvPool::F32(PoolBuf::zeroed(n)?),
            KvCacheDtype::F16 => KvPool::F16(PoolBuf::zeroed(n)?),
            KvCacheDtype::Bf16 => KvPool::Bf16(PoolBuf::zeroed(n)?),
            KvCacheDtype::Fp8E4m3 => KvPool::Fp8E4m3(PoolBuf::zeroed(n)?),
        })
    }

    /// [`KvPool::try_zeros`].
    ///
    /// # Panics
    /// If the OS refuses the map.
    pub fn zeros(dtype: KvCacheDtype, n: usize) -> Self {
        Self::try_zeros(dtype, n).unwrap_or_else(|e| panic!("a KV pool of {n} {dtype:?} elements: {e}"))
    }

    /// The storage type.
    pub fn dtype(&self) -> KvCacheDtype {
        match self {
            KvPool::F32(_) => KvCacheDtype::F32,
            KvPool::F16(_) => KvCacheDtype::F16,
            KvPool::Bf16(_) => KvCacheDtype::Bf16,
            KvPool::Fp8E4m3(_) => KvCacheDtype::Fp8E4m3,
        }
    }

    /// Elements in the pool.
    pub fn len(&self) -> usize {
        match self {
            KvPool::F32(x) => x.len(),
            KvPool::F16(x) => x.len(),
            KvPool::Bf16(x) => x.len(),
            KvPool::Fp8E4m3(x) => x.len(),
        }
    }

    /// True for an empty pool.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stores `src` at elements `offset..offset + src.len()`, rounding to
    /// nearest (ties to even) for `f16`/`bf16`/FP8 (FP8 saturating at ±448).
    pub fn write_f32(&mut self, offset: usize, src: &[f32]) {
        let range = offset..offset + src.len();
        match self {
            KvPool::F32(x) => x[range].copy_from_slice(src),
            KvPool::F16(x) => x[range].convert_from_f32_slice(src),
            KvPool::Bf16(x) => x[range].convert_from_f32_slice(src),
            KvPool::Fp8E4m3(x) => x[range].iter_mut().zip(src).for_each(|(d, &s)| *d = Fp8E4m3::from_f32(s)),
        }
    }

    /// [`KvPool::write_f32`] of `src · inv_scale` (a value stored divided by
    /// its layer's scale, multiplied by the scale's inverse as every backend
    /// does, so that they round the same products).
    pub fn write_scaled(&mut self, offset: usize, src: &[f32], inv_scale: f32) {
        match self {
            KvPool::Fp8E4m3(x) => {
                let range = offset..offset + src.len();
                x[range].iter_mut().zip(src).for_each(|(d, &s)| *d = Fp8E4m3::from_f32(s * inv_scale));
            }
            _ if inv_scale == 1.0 => self.write_f32(offset, src),
            _ => {
                let scaled: Vec<f32> = src.iter().map(|&x| x * inv_scale).collect();
                self.write_f32(offset, &scaled);
            }
        }
    }

    /// Reads elements `offset..offset + dst.len()` into `dst` as `f32` (as
    /// stored: an FP8 code's value, not yet multiplied by its scale).
    pub fn read_f32(&self, offset: usize, dst: &mut [f32]) {
        let range = offset..offset + dst.len();
        match self {
            KvPool::F32(x) => dst.copy_from_slice(&x[range]),
            KvPool::F16(x) => x[range].convert_to_f32_slice(dst),
            KvPool::Bf16(x) => x[range].convert_to_f32_slice(dst),
            KvPool::Fp8E4m3(x) => dst.iter_mut().zip(&x[range]).for_each(|(d, s)| *d = s.to_f32()),
        }
    }

    /// The whole pool as `f32` (for tests and `HostIo::read_kv`).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.read_f32(0, &mut out);
        out
    }

    /// Copies elements `src` to `dst..` within the pool.
    fn copy_within(&mut self, src: Range<usize>, dst: usize) {
        match self {
            KvPool::F32(x) => x.copy_within(src, dst),
            KvPool::F16(x) => x.copy_within(src, dst),
            KvPool::Bf16(x) => x.copy_within(src, dst),
            KvPool::Fp8E4m3(x) => x.copy_within(src, dst),
        }
    }

    /// Copies `from[src]` to `self[dst..]`; both pools have the same dtype.
    fn copy_from(&mut self, dst: usize, from: &KvPool, src: Range<usize>) {
        let to = dst..dst + src.len();
        match (self, from) {
            (KvPool::F32(x), KvPool::F32(y)) => x[to].copy_from_slice(&y[src]),
            (KvPool::F16(x), KvPool::F16(y)) => x[to].copy_from_slice(&y[src]),
            (KvPool::Bf16(x), KvPool::Bf16(y)) => x[to].copy_from_slice(&y[src]),
            (KvPool::Fp8E4m3(x), KvPool::Fp8E4m3(y)) => x[to].copy_from_slice(&y[src]),
            (x, y) => panic!("copy between KV pools of different dtypes: {:?} <- {:?}", x.dtype(), y.dtype()),
        }
    }
}

/// K and V pools of one layer, each [`KvCacheLayout::pool_elems`] elements
/// of the same [`KvCacheDtype`].
#[derive(Clone, Debug, PartialEq)]
pub struct LayerKvCache {
    /// Keys, `[num_blocks, block_size, num_kv_heads, head_dim]`.
    pub k: KvPool,
    /// Values, same layout and dtype as `k`.
    pub v: KvPool,
}

impl LayerKvCache {
    /// Zeroed pools for `layout`, stored as `dtype`.
    ///
    /// # Panics
    /// If the OS refuses the memory ([`LayerKvCache::try_new`] says so instead).
    pub fn new(layout: &KvCacheLayout, dtype: KvCacheDtype) -> Self {
        let n = layout.pool_elems();
        Self { k: KvPool::zeros(dtype, n), v: KvPool::zeros(dtype, n) }
    }

    /// [`LayerKvCache::new`], an error if the OS refuses the memory.
    pub fn try_new(layout: &KvCacheLayout, dtype: KvCacheDtype) -> std::io::Result<Self> {
        let n = layout.pool_elems();
        Ok(Self { k: KvPool::try_zeros(dtype, n)?, v: KvPool::try_zeros(dtype, n)? })
    }

    /// The storage type of both pools.
    pub fn dtype(&self) -> KvCacheDtype {
        self.k.dtype()
    }

    /// Asserts that both pools have the size `layout` implies and one dtype.
    pub(crate) fn assert_layout(&self, layout: &KvCacheLayout, what: &str) {
        let n = layout.pool_elems();
        assert!(
            self.k.len() == n && self.v.len() == n,
            "{what}: K/V pools hold {}/{} elements, layout {layout:?} needs {n}",
            self.k.len(),
            self.v.len()
        );
        assert_eq!(self.k.dtype(), self.v.dtype(), "{what}: K and V pools have different dtypes");
    }
}

/// Every layer slot plus the host swap pool.
///
/// `layers[s]` is block slot `s` in the device pool (`layout.num_blocks`
/// blocks); `host_layers[s]` is slot `s` in the host pool (`num_host_blocks`
/// blocks, otherwise the same layout). With one KV-cache group slot `s` is
/// layer `s`; with several (local and global layers), the layers of each
/// group share the slots and `groups` says which slot and which group's
/// block tables a layer uses. On the CPU backend both pools live in host
/// memory; the split keeps block ids of the two pools apart, as on a GPU.
/// Every pool has the same dtype, so swapping is a plain copy.
#[derive(Clone, Debug, PartialEq)]
pub struct KvCache {
    /// Layout of one slot of the device pool.
    pub layout: KvCacheLayout,
    /// Storage type of every pool.
    pub dtype: KvCacheDtype,
    /// Which slot and group each layer uses.
    pub groups: KvCacheGroups,
    /// Device pool, one entry per layer slot.
    pub layers: Vec<LayerKvCache>,
    /// Host swap pool, one entry per layer slot, `num_host_blocks` blocks each.
    pub host_layers: Vec<LayerKvCache>,
    /// Blocks in the host pool.
    pub num_host_blocks: usize,
    /// Each layer's scales ([`KvScale::ONE`] unless the dtype is scaled,
    /// [`KvCacheDtype::is_scaled`]): layer `l` stores `x / scales[l]`.
    /// Fixed once allocated ([`KvCache::with_scales`], [`KvCache::scale`]).
    scales: Vec<KvScale>,
}

impl KvCache {
    /// Zeroed device and host pools for `num_layers` layers of one group,
    /// stored as `dtype`.
    pub fn new(layout: KvCacheLayout, num_layers: usize, num_host_blocks: usize, dtype: KvCacheDtype) -> Self {
        Self::grouped(layout, KvCacheGroups::single(num_layers, None), num_host_blocks, dtype)
    }

    /// Zeroed device and host pools for the slots of `groups`.
    ///
    /// # Panics
    /// If the OS refuses the memory ([`KvCache::try_grouped`] says so instead).
    pub fn grouped(layout: KvCacheLayout, groups: KvCacheGroups, num_host_blocks: usize, dtype: KvCacheDtype) -> Self {
        Self::try_grouped(layout, groups, num_host_blocks, dtype).unwrap_or_else(|e| panic!("a KV cache of {layout:?}: {e}"))
    }

    /// [`KvCache::grouped`], an error if the OS refuses the memory.
    pub fn try_grouped(layout: KvCacheLayout, groups: KvCacheGroups, num_host_blocks: usize, dtype: KvCacheDtype) -> std::io::Result<Self> {
        let host_layout = Self::host_layout_of(&layout, num_host_blocks);
        let slots = groups.layers_per_group();
        Ok(Self {
            layout,
            dtype,
            layers: (0..slots).map(|_| LayerKvCache::try_new(&layout, dtype)).collect::<std::io::Result<_>>()?,
            host_layers: (0..slots).map(|_| LayerKvCache::try_new(&host_layout, dtype)).collect::<std::io::Result<_>>()?,
            num_host_blocks,
            scales: vec![KvScale::ONE; groups.num_layers()],
            groups,
        })
    }

    /// The same cache with layer `l` scaled by `scales[l]` (layers past the
    /// end keep [`KvScale::ONE`]). A scale is fixed before anything is
    /// written: the codes already stored do not change with it.
    ///
    /// # Panics
    /// If the dtype is not scaled and a scale is not [`KvScale::ONE`].
    pub fn with_scales(mut self, scales: &[KvScale]) -> Self {
        assert!(
            self.dtype.is_scaled() || scales.iter().all(|s| *s == KvScale::ONE),
            "a {} cache stores values as they are",
            self.dtype.name()
        );
        for (d, s) in self.scales.iter_mut().zip(scales) {
            *d = *s;
        }
        self
    }

    /// Layer `layer`'s scales ([`KvScale::ONE`] for a layer the cache lacks).
    pub fn scale(&self, layer: usize) -> KvScale {
        self.scales.get(layer).copied().unwrap_or(KvScale::ONE)
    }

    /// Where `layer`'s K/V live, or `None` for a layer the cache lacks.
    pub fn layer_slot(&self, layer: usize) -> Option<KvLayerSlot> {
        (layer < self.groups.num_layers()).then(|| self.groups.slot(layer))
    }

    /// Layout of one layer of the host pool (feature `reference`: for tests).
    #[cfg(any(test, feature = "reference"))]
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
            assert!(dev < self.layout.num_blocks, "swap_blocks: {} outside the device pool of {} blocks", s.device, self.layout.num_blocks);
            assert!(
                host < self.num_host_blocks,
                "swap_blocks: host block {} outside the host pool of {} blocks",
                s.host.0,
                self.num_host_blocks
            );
            let (d, h) = (dev * n..(dev + 1) * n, host * n..(host + 1) * n);
            for (device, host) in self.layers.iter_mut().zip(&mut self.host_layers) {
                if to_host {
                    host.k.copy_from(h.start, &device.k, d.clone());
                    host.v.copy_from(h.start, &device.v, d.clone());
                } else {
                    device.k.copy_from(d.start, &host.k, h.clone());
                    device.v.copy_from(d.start, &host.v, h.clone());
                }
            }
        }
    }

    fn host_layout_of(layout: &KvCacheLayout, num_host_blocks: usize) -> KvCacheLayout {
        KvCacheLayout { num_blocks: num_host_blocks, ..*layout }
    }
}

#[cfg(test)]
mod tests {
    fn resident_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
            .unwrap_or(0)
    }

    #[test]
    fn a_pool_is_zeros_and_resident_only_where_written() {
        let mut pool = PoolBuf::<f16>::zeroed(512 << 20).expect("maps 1 GiB");
        assert_eq!(pool.len(), 512 << 20);
        let before = resident_kib();
        assert!(pool[..1 << 20].iter().chain(&pool[(511 << 20)..]).all(|v| *v == f16::ZERO));
        pool[12345] = f16::from_f32(1.5);
        // Reading pages maps the shared zero page; a write maps one page.
        assert!(resident_kib() < before + (64 << 10), "{} KiB resident after touching 1 GiB's ends", resident_kib() - before);
        drop(pool);
        let mut small = PoolBuf::<bf16>::zeroed(1000).expect("maps");
        small[7] = bf16::from_f32(-2.0);
        let copy = small.clone();
        assert_eq!(copy[7], bf16::from_f32(-2.0));
        assert!(copy == small);
        assert!(PoolBuf::<f32>::zeroed(0).expect("empty").is_empty());
        assert!(PoolBuf::<f32>::zeroed(usize::MAX / 2).is_err());
    }
    use super::*;

    #[test]
    fn block_bytes_counts_k_and_v_of_every_layer() {
        let layout = KvCacheLayout { num_blocks: 10, block_size: 16, num_kv_heads: 3, head_dim: 64 };
        assert_eq!(layout.block_elems(), 16 * 3 * 64);
        for (dtype, bytes) in [(KvCacheDtype::F32, 4), (KvCacheDtype::F16, 2), (KvCacheDtype::Bf16, 2), (KvCacheDtype::Fp8E4m3, 1)] {
            let spec = vellum_base::KvCacheSpec::uniform(30, 3, 64, 16, dtype);
            assert_eq!(spec.block_bytes(), 2 * 16 * 3 * 64 * bytes * 30);
            let cache = KvCache::new(layout, 2, 4, dtype);
            assert_eq!(cache.layers[1].k.len(), 10 * 16 * 3 * 64);
            assert_eq!(cache.host_layers[1].v.len(), 4 * 16 * 3 * 64);
            assert_eq!(cache.host_layers[1].dtype(), dtype);
        }
    }

    #[test]
    fn half_pools_round_to_nearest() {
        let x = [1.0f32 + 1.0 / 4096.0, 1.0 + 3.0 / 2048.0, -0.1, 70000.0];
        let mut f = KvPool::zeros(KvCacheDtype::F16, 4);
        f.write_f32(0, &x);
        // f16 has an ulp of 2^-10 at 1: 1 + 2^-12 rounds down, 1 + 3·2^-11
        // (halfway) to even; 70000 overflows to infinity.
        let got = f.to_f32_vec();
        assert_eq!(&got[..2], &[1.0, 1.0 + 2.0 / 1024.0]);
        assert!((got[2] + 0.1).abs() <= 0.1 * 2f32.powi(-11));
        assert_eq!(got[3], f32::INFINITY);
        let mut b = KvPool::zeros(KvCacheDtype::Bf16, 4);
        b.write_f32(0, &x);
        let got = b.to_f32_vec();
        assert_eq!(&got[..2], &[1.0, 1.0]);
        assert!((got[2] + 0.1).abs() <= 0.1 * 2f32.powi(-8));
        assert!((got[3] - 70000.0).abs() <= 70000.0 * 2f32.powi(-8));
    }

    #[test]
    fn fp8_pools_store_values_over_their_scale() {
        let x = [1.0f32, 1.0 + 1.0 / 16.0, -0.1, 500.0, 3.0];
        let mut p = KvPool::zeros(KvCacheDtype::Fp8E4m3, 5);
        p.write_f32(0, &x);
        let got = p.to_f32_vec();
        // 3 mantissa bits: 1 + 2^-4 is halfway between 1 and 1.125 (to even);
        // past 448 saturates.
        assert_eq!(&got[..2], &[1.0, 1.0]);
        assert!((got[2] + 0.1).abs() <= 0.1 / 16.0);
        assert_eq!(got[3], 448.0);
        // Scaled by 4: 500 fits, 3 / 4 = 0.75 is exact.
        p.write_scaled(0, &x, 0.25);
        let got = p.to_f32_vec();
        assert_eq!(got[3], 128.0, "500 / 4 = 125 rounds to 128 (a step of 8 there)");
        assert_eq!(got[4], 0.75);
    }

    #[test]
    fn a_cache_keeps_one_scale_a_layer() {
        let layout = KvCacheLayout { num_blocks: 2, block_size: 4, num_kv_heads: 1, head_dim: 8 };
        let s = KvScale { k: 0.5, v: 2.0 };
        let cache = KvCache::new(layout, 3, 0, KvCacheDtype::Fp8E4m3).with_scales(&[KvScale::ONE, s]);
        assert_eq!((cache.scale(0), cache.scale(1), cache.scale(2), cache.scale(9)), (KvScale::ONE, s, KvScale::ONE, KvScale::ONE));
        let unscaled = std::panic::catch_unwind(|| KvCache::new(layout, 1, 0, KvCacheDtype::F16).with_scales(&[s]));
        assert!(unscaled.is_err(), "an f16 cache takes no scale");
    }
}
