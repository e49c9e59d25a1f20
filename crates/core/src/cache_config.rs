//! Configuration of the paged KV cache.

use crate::{Error, Result};

/// How much memory the device KV pool gets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvCacheSize {
    /// What the configuration can use, within limits: `max_num_seqs`
    /// requests of `max_model_len` tokens (a sliding-window group holds
    /// only its window), capped at [`AUTO_KV_CACHE_CAP_BYTES`] and at half
    /// the memory the device has free once the weights are loaded. The
    /// engine resolves it with the scheduler's budgets in hand
    /// ([`KvCacheSize::resolve_auto`]); a small model on a large machine
    /// gets what it can use, not half the machine. The default off a GPU.
    Auto,
    /// Exactly this many blocks.
    NumBlocks(usize),
    /// This many bytes; the backend says how many blocks fit
    /// ([`crate::ModelExecutor::num_kv_blocks`]).
    MemoryBytes(u64),
    /// A fraction of the memory the backend reports free once the weights
    /// are loaded ([`crate::ModelExecutor::kv_memory`]).
    FractionOfFree(f32),
    /// vLLM's `--gpu-memory-utilization`: the fraction of a GPU's whole
    /// memory the engine may take — weights, the activations of a profile
    /// run at the step budget, and the KV cache, which gets what is left.
    DeviceFraction(f32),
}

/// The most an [`KvCacheSize::Auto`] cache takes: 4 GiB, vLLM's CPU default
/// (`VLLM_CPU_KVCACHE_SPACE`). SmolLM2-135M with a float16 cache holds
/// 186k tokens in it.
pub const AUTO_KV_CACHE_CAP_BYTES: u64 = 4 << 30;

/// Why a [`KvCacheSize::Auto`] cache got the size it got (for the log line
/// that tells a user which flag changes it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AutoKvLimit {
    /// Everything the configuration can use fits.
    Configuration,
    /// [`AUTO_KV_CACHE_CAP_BYTES`].
    Cap,
    /// Half the free memory.
    FreeMemory,
}

impl KvCacheSize {
    /// Resolves [`KvCacheSize::Auto`] to bytes: `wanted_bytes` (what the
    /// configuration can use), capped at [`AUTO_KV_CACHE_CAP_BYTES`] and
    /// half of `available_bytes`; with the limit that decided it.
    pub fn resolve_auto(wanted_bytes: u64, available_bytes: u64) -> (u64, AutoKvLimit) {
        let half_free = available_bytes / 2;
        if wanted_bytes <= AUTO_KV_CACHE_CAP_BYTES.min(half_free) {
            (wanted_bytes, AutoKvLimit::Configuration)
        } else if AUTO_KV_CACHE_CAP_BYTES <= half_free {
            (AUTO_KV_CACHE_CAP_BYTES, AutoKvLimit::Cap)
        } else {
            (half_free, AutoKvLimit::FreeMemory)
        }
    }
}

/// Element type of the stored keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvCacheDtype {
    /// 4 bytes per element: exact.
    F32,
    /// 2 bytes per element.
    F16,
    /// 2 bytes per element.
    Bf16,
    /// 1 byte per element: OCP FP8 E4M3 (4 exponent bits, 3 mantissa bits,
    /// finite to ±448, no infinities), each layer's keys and values divided
    /// by a scale of their own ([`KvScale`]) before they are rounded. Half
    /// the memory of a 16-bit cache: twice the tokens in the same pool.
    Fp8E4m3,
}

impl KvCacheDtype {
    /// Bytes per stored element.
    pub fn size_bytes(self) -> usize {
        match self {
            KvCacheDtype::F32 => 4,
            KvCacheDtype::F16 | KvCacheDtype::Bf16 => 2,
            KvCacheDtype::Fp8E4m3 => 1,
        }
    }

    /// The name `--kv-cache-dtype` takes.
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::F32 => "float32",
            KvCacheDtype::F16 => "float16",
            KvCacheDtype::Bf16 => "bfloat16",
            KvCacheDtype::Fp8E4m3 => "fp8_e4m3",
        }
    }

    /// Whether values are stored divided by a per-layer [`KvScale`] (only
    /// FP8 needs one: its range is ±448).
    pub fn is_scaled(self) -> bool {
        self == KvCacheDtype::Fp8E4m3
    }
}

/// The scales of one layer's stored keys and values: a value `x` is stored
/// as `x / k` (keys) or `x / v` (values), rounded to the cache's element
/// type, and read back as `stored · k` (vLLM's `k_scale`/`v_scale`, one per
/// layer). [`KvScale::ONE`] for every unscaled cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvScale {
    /// Multiplies a stored key.
    pub k: f32,
    /// Multiplies a stored value.
    pub v: f32,
}

impl KvScale {
    /// Values stored as they are.
    pub const ONE: KvScale = KvScale { k: 1.0, v: 1.0 };

    /// Where the largest |key| or |value| a calibration pass saw lands in an
    /// FP8 E4M3 cache: a quarter of the type's largest finite value (448),
    /// so that inputs up to four times the calibration's still fit. The
    /// headroom costs next to nothing: E4M3 keeps 3 mantissa bits from 2⁻⁶
    /// to 448, the same relative precision over a range of 2¹⁵, so only
    /// values below 1/7000 of the calibrated maximum lose precision.
    pub const FP8_CALIBRATED_MAX: f32 = crate::fp8::E4M3_MAX / 4.0;

    /// The scales that map the largest |key| `k_absmax` and |value|
    /// `v_absmax` of a calibration pass to [`KvScale::FP8_CALIBRATED_MAX`];
    /// a maximum that is zero or not finite keeps its scale at 1 (vLLM's
    /// default when a checkpoint has none).
    pub fn from_absmax(k_absmax: f32, v_absmax: f32) -> KvScale {
        // A scale too small to invert (a maximum below ~1e-36) counts as none.
        let scale = |m: f32| {
            let s = m / Self::FP8_CALIBRATED_MAX;
            if m.is_finite() && s.is_normal() && (1.0 / s).is_finite() {
                s
            } else {
                1.0
            }
        };
        KvScale { k: scale(k_absmax), v: scale(v_absmax) }
    }
}

/// The largest |key| and |value| each layer wrote during calibration passes
/// (a backend records them in `write_kv` while calibrating, see
/// `vellum_ops::Ops::set_calibrating`): what an FP8 cache allocated after
/// takes its scales from.
#[derive(Debug, Default)]
pub struct KvAbsmax(std::sync::Mutex<Vec<(f32, f32)>>);

impl KvAbsmax {
    /// Keeps `layer`'s largest |k| and |v| so far, `k` and `v` included.
    pub fn observe(&self, layer: usize, k: &[f32], v: &[f32]) {
        let absmax = |x: &[f32]| x.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
        let (km, vm) = (absmax(k), absmax(v));
        let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if seen.len() <= layer {
            seen.resize(layer + 1, (0.0, 0.0));
        }
        seen[layer] = (seen[layer].0.max(km), seen[layer].1.max(vm));
    }

    /// The scales of `num_layers` layers ([`KvScale::from_absmax`]);
    /// [`KvScale::ONE`] for a layer never observed (no calibration: vLLM's
    /// default without scales).
    pub fn scales(&self, num_layers: usize) -> Vec<KvScale> {
        let seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        (0..num_layers).map(|l| seen.get(l).map_or(KvScale::ONE, |&(k, v)| KvScale::from_absmax(k, v))).collect()
    }
}

/// Block size, pool sizes and caching switches.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheConfig {
    /// Tokens per block (paper default 16).
    pub block_size: usize,
    /// Size of the device pool.
    pub size: KvCacheSize,
    /// Bytes of host memory for swapped-out blocks. The host pool never
    /// holds more blocks than the device pool.
    pub swap_space_bytes: u64,
    /// Element type of the cache.
    pub dtype: KvCacheDtype,
    /// Automatic prefix caching.
    pub enable_prefix_caching: bool,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self { block_size: 16, size: KvCacheSize::Auto, swap_space_bytes: 1 << 30, dtype: KvCacheDtype::F32, enable_prefix_caching: true }
    }
}

impl CacheConfig {
    /// Checks ranges: a power-of-two block size up to 256, a positive pool.
    pub fn validate(&self) -> Result<()> {
        if !self.block_size.is_power_of_two() || self.block_size > 256 {
            return Err(Error::InvalidConfig {
                field: "block_size",
                message: format!("must be a power of two between 1 and 256, got {}", self.block_size),
            });
        }
        match self.size {
            KvCacheSize::NumBlocks(0) | KvCacheSize::MemoryBytes(0) => {
                Err(Error::InvalidConfig { field: "kv_cache_memory", message: "the KV cache must hold at least one block".into() })
            }
            KvCacheSize::FractionOfFree(f) if !(f > 0.0 && f <= 1.0) => Err(Error::InvalidConfig {
                field: "kv_cache_memory",
                message: format!("fraction of free memory must be in (0, 1], got {f}"),
            }),
            KvCacheSize::DeviceFraction(f) if !(f > 0.0 && f <= 1.0) => {
                Err(Error::InvalidConfig { field: "gpu_memory_utilization", message: format!("must be in (0, 1], got {f}") })
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibrated_maxima_land_a_quarter_below_the_fp8_range() {
        let s = KvScale::from_absmax(1120.0, 56.0);
        assert_eq!((s.k, s.v), (10.0, 0.5));
        // The maximum stored is 112: four times the calibration's still fits.
        assert_eq!(crate::fp8::to_f32(crate::fp8::from_f32(1120.0 * (1.0 / s.k))), 112.0);
        assert_eq!(crate::fp8::to_f32(crate::fp8::from_f32(4.0 * 1120.0 * (1.0 / s.k))), 448.0);
        for m in [0.0, -0.0, f32::NAN, f32::INFINITY, 1e-40] {
            assert_eq!(KvScale::from_absmax(m, m), KvScale::ONE, "{m}");
        }
    }

    #[test]
    fn recorded_maxima_become_each_layers_scales() {
        let seen = KvAbsmax::default();
        seen.observe(1, &[3.0, -112.0], &[0.5]);
        seen.observe(1, &[56.0], &[-5.6, 1.0]);
        assert_eq!(seen.scales(3), [KvScale::ONE, KvScale::from_absmax(112.0, 5.6), KvScale::ONE]);
        assert_eq!(seen.scales(3)[1].k, 1.0);
    }

    #[test]
    fn validation() {
        CacheConfig::default().validate().unwrap();
        for bs in [0, 3, 512] {
            let c = CacheConfig { block_size: bs, ..CacheConfig::default() };
            assert!(matches!(c.validate(), Err(Error::InvalidConfig { field: "block_size", .. })));
        }
        let c = CacheConfig { size: KvCacheSize::FractionOfFree(1.5), ..CacheConfig::default() };
        assert!(c.validate().is_err());
        let c = CacheConfig { size: KvCacheSize::NumBlocks(0), ..CacheConfig::default() };
        assert!(c.validate().is_err());
    }

    #[test]
    fn auto_takes_what_the_configuration_uses_within_the_cap_and_half_the_free_memory() {
        let gib = 1u64 << 30;
        assert_eq!(KvCacheSize::resolve_auto(gib / 4, 20 * gib), (gib / 4, AutoKvLimit::Configuration));
        assert_eq!(KvCacheSize::resolve_auto(48 * gib, 20 * gib), (AUTO_KV_CACHE_CAP_BYTES, AutoKvLimit::Cap));
        assert_eq!(KvCacheSize::resolve_auto(48 * gib, 6 * gib), (3 * gib, AutoKvLimit::FreeMemory));
        assert_eq!(KvCacheSize::resolve_auto(2 * gib, 2 * gib), (gib, AutoKvLimit::FreeMemory));
    }
}
