//! What a backend's kernels support, declared by the backend and checked
//! before a model is loaded (vLLM's `validate_configuration`): an
//! unsupported head size, block size or KV-cache element type is a typed
//! error naming the value and what is supported, not a failure inside the
//! first allocation or kernel launch.

use crate::{Error, KvCacheDtype, Unsupported};
use std::fmt;

/// The sizes (head sizes, block sizes) a kernel takes: every positive
/// multiple of `multiple_of` up to `max`, or only the `listed` ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sizes {
    /// Any positive multiple of `multiple_of`, at most `max`.
    Multiples {
        /// The step.
        multiple_of: usize,
        /// The largest size.
        max: usize,
    },
    /// Exactly these.
    Only(&'static [usize]),
}

impl Sizes {
    /// Every positive size.
    pub const ANY: Sizes = Sizes::Multiples { multiple_of: 1, max: usize::MAX };

    /// Whether `n` is one of them.
    pub fn allows(&self, n: usize) -> bool {
        match *self {
            Sizes::Multiples { multiple_of, max } => n > 0 && n.is_multiple_of(multiple_of.max(1)) && n <= max,
            Sizes::Only(list) => list.contains(&n),
        }
    }
}

impl fmt::Display for Sizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Sizes::Multiples { multiple_of: 1, max: usize::MAX } => write!(f, "any"),
            Sizes::Multiples { multiple_of, max: usize::MAX } => write!(f, "multiples of {multiple_of}"),
            Sizes::Multiples { multiple_of: 1, max } => write!(f, "1 to {max}"),
            Sizes::Multiples { multiple_of, max } => write!(f, "multiples of {multiple_of} up to {max}"),
            Sizes::Only(list) => {
                let names: Vec<String> = list.iter().map(|n| n.to_string()).collect();
                write!(f, "{}", names.join(", "))
            }
        }
    }
}

/// What a backend's attention kernels and KV cache support
/// ([`crate::AttentionBackend::capabilities`]). Sliding windows and logit
/// soft-capping are part of the attention contract every backend meets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Head sizes of the attention kernels.
    pub head_dims: Sizes,
    /// Tokens per KV block.
    pub block_sizes: Sizes,
    /// Element types the KV cache can be stored in.
    pub kv_dtypes: &'static [KvCacheDtype],
    /// Whether models that mix local and global layers get a block table
    /// per KV-cache group ([`crate::KvCacheGroups`]); without, one group of
    /// every layer, whose blocks are all kept.
    pub kv_groups: bool,
}

/// The attention configuration a model and the engine's flags ask of a
/// backend, checked against its [`Capabilities`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionRequirements {
    /// The model's head size.
    pub head_dim: usize,
    /// `--block-size`.
    pub block_size: usize,
    /// The KV cache's element type (`--kv-cache-dtype`, resolved).
    pub kv_dtype: KvCacheDtype,
}

impl AttentionRequirements {
    /// What a cache of geometry `spec` asks of a backend.
    pub fn of(spec: &crate::KvCacheSpec) -> Self {
        Self { head_dim: spec.head_dim, block_size: spec.block_size, kv_dtype: spec.dtype }
    }
}

impl Capabilities {
    /// `Ok` if `backend` (its name, for the message) supports `wanted`;
    /// otherwise [`Error::Unsupported`] naming the first value it does not,
    /// and what it does support.
    pub fn check(&self, backend: &str, wanted: &AttentionRequirements) -> Result<(), Error> {
        let unsupported = |what: &str, value: String, supported: String| {
            Error::Unsupported(Box::new(Unsupported { backend: backend.to_string(), what: what.to_string(), value, supported }))
        };
        if !self.head_dims.allows(wanted.head_dim) {
            return Err(unsupported("head size", wanted.head_dim.to_string(), self.head_dims.to_string()));
        }
        if !self.block_sizes.allows(wanted.block_size) {
            return Err(unsupported("block size (--block-size)", wanted.block_size.to_string(), self.block_sizes.to_string()));
        }
        if !self.kv_dtypes.contains(&wanted.kv_dtype) {
            let names: Vec<&str> = self.kv_dtypes.iter().map(|d| d.name()).collect();
            return Err(unsupported("KV-cache element type (--kv-cache-dtype)", wanted.kv_dtype.name().to_string(), names.join(", ")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU_LIKE: Capabilities = Capabilities {
        head_dims: Sizes::Only(&[64, 128, 256]),
        block_sizes: Sizes::Only(&[8, 16, 32]),
        kv_dtypes: &[KvCacheDtype::F16, KvCacheDtype::Bf16],
        kv_groups: true,
    };

    fn wanted(head_dim: usize, block_size: usize, kv_dtype: KvCacheDtype) -> AttentionRequirements {
        AttentionRequirements { head_dim, block_size, kv_dtype }
    }

    #[test]
    fn sizes_allow_what_they_say_and_print_it() {
        let wgpu_like = Sizes::Multiples { multiple_of: 4, max: 256 };
        assert!(wgpu_like.allows(4) && wgpu_like.allows(256) && !wgpu_like.allows(258) && !wgpu_like.allows(6) && !wgpu_like.allows(0));
        assert_eq!(wgpu_like.to_string(), "multiples of 4 up to 256");
        assert!(Sizes::ANY.allows(1) && Sizes::ANY.allows(1 << 40) && !Sizes::ANY.allows(0));
        assert_eq!(Sizes::ANY.to_string(), "any");
        assert_eq!(Sizes::Only(&[8, 16, 32]).to_string(), "8, 16, 32");
        assert!(!Sizes::Only(&[8, 16, 32]).allows(24));
    }

    #[test]
    fn an_unsupported_value_is_named_with_what_is_supported() {
        assert!(GPU_LIKE.check("cuda", &wanted(128, 16, KvCacheDtype::F16)).is_ok());
        let e = GPU_LIKE.check("cuda", &wanted(192, 16, KvCacheDtype::F16)).expect_err("192 is not listed");
        assert!(matches!(&e, Error::Unsupported(u) if u.what == "head size" && u.value == "192"), "{e:?}");
        assert_eq!(e.to_string(), "the cuda backend does not support head size 192 (supported: 64, 128, 256)");
        let e = GPU_LIKE.check("cuda", &wanted(128, 64, KvCacheDtype::F16)).expect_err("block size 64");
        assert!(e.to_string().contains("block size (--block-size) 64 (supported: 8, 16, 32)"), "{e}");
        let e = GPU_LIKE.check("cuda", &wanted(128, 16, KvCacheDtype::F32)).expect_err("f32 cache");
        assert!(e.to_string().contains("--kv-cache-dtype) float32 (supported: float16, bfloat16)"), "{e}");
    }
}
