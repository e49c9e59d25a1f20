//! A dense f32 tensor, what a weight view converts to (and the unit the
//! loaders' `WeightSource::tensor_f32` hands out).

/// A row-major f32 tensor with its shape. Matrices follow the Hugging Face
/// convention: a linear layer's weight is `[out_features, in_features]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Dimensions, slowest-varying first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values.
    pub data: Vec<f32>,
}

impl Tensor {
    /// Total elements.
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }
}
