//! Which quantized linear weights a GPU backend also keeps as bf16
//! (`--cuda-bf16-weight-copies`).

/// Which quantized linear weights `--device cuda` also keeps as bf16, for
/// cuBLAS: a product of three rows and more then multiplies the copy
/// instead of dequantizing the weight for every product (or running the
/// slower tensor-core GEMM), at two bytes a weight that the KV cache does
/// not get. The CUDA backend (`copies_budget` in its `ops.rs`) says what
/// that measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightCopies {
    /// While the copies stay within a quarter of the GPU and leave half of
    /// it free after each, in the order the weights load; a copy that does
    /// not fit is none (the default).
    #[default]
    Auto,
    /// A copy of every quantized linear weight (one that does not fit is
    /// an error).
    All,
    /// None.
    None,
}

impl std::str::FromStr for WeightCopies {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "all" => Ok(Self::All),
            "none" => Ok(Self::None),
            other => Err(format!("unknown weight-copy setting {other:?} (auto, all, none)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::WeightCopies;

    #[test]
    fn settings_parse_by_name() {
        assert_eq!(
            ["auto", "all", "none"].map(|s| s.parse::<WeightCopies>()),
            [Ok(WeightCopies::Auto), Ok(WeightCopies::All), Ok(WeightCopies::None)]
        );
        assert!("some".parse::<WeightCopies>().unwrap_err().contains("auto, all, none"));
    }
}
