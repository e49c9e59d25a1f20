//! A tensor's entry in a GGUF file's tensor table.

use vellum_ops::quant::GgmlType;

/// Where a tensor lies in a GGUF file and how it is stored. Validated at
/// open: its bytes lie inside the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The GGUF name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// ggml dimensions, fastest-varying first (`ne[0]` is the row length).
    pub ne: Vec<usize>,
    /// The storage type.
    pub ggml_type: GgmlType,
    /// Offset of the tensor's bytes from the start of the file.
    pub file_offset: usize,
    /// Number of bytes the tensor occupies.
    pub n_bytes: usize,
}

impl TensorInfo {
    /// Total elements.
    pub fn n_elements(&self) -> usize {
        self.ne.iter().product()
    }

    /// The row-major shape (slowest-varying first), the reverse of `ne`:
    /// a matrix with `ne = [in, out]` has shape `[out, in]`.
    pub fn shape(&self) -> Vec<usize> {
        self.ne.iter().rev().copied().collect()
    }
}
