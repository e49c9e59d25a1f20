//! [`WeightView`]: a tensor as its file stores it, the unit weights cross
//! the seam in.

use crate::quant::{dequantize, GgmlType, DEQUANTIZABLE};
use crate::{Error, Result, Tensor};
use std::borrow::Cow;

/// A tensor as its file stores it, handed to a backend so that it picks its
/// own layout: f32/f16/bf16 elements or GGUF quantized blocks, with their
/// type.
///
/// `shape` is row-major in Hugging Face layout (`[out, in]` for a linear
/// layer); each row is `shape.last()` values, stored as
/// `shape.last() / block` blocks of `dtype` (a block is one element for
/// f32/f16/bf16), little-endian, rows in Hugging Face order (GGUF Q/K rows
/// already un-permuted). Borrowed from the memory map where possible.
#[derive(Clone, Debug)]
pub struct WeightView<'a> {
    /// The Hugging Face name.
    pub name: String,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// The element or block type (GGML's numbering names f32/f16/bf16 too).
    pub dtype: GgmlType,
    /// The stored bytes, row after row.
    pub data: Cow<'a, [u8]>,
}

impl<'a> WeightView<'a> {
    /// A view, checked to hold exactly `shape`'s values of `dtype`.
    pub fn new(name: &str, shape: Vec<usize>, dtype: GgmlType, data: Cow<'a, [u8]>) -> Result<Self> {
        let view = Self { name: name.to_string(), shape, dtype, data };
        let (block, block_bytes) = dtype.block_layout();
        let n = view.n_elements();
        let row = view.shape.last().copied().unwrap_or(1);
        let expected = (n / block).checked_mul(block_bytes);
        if row % block != 0 || expected != Some(view.data.len()) {
            return Err(Error::ShapeMismatch {
                tensor: name.to_string(),
                expected: view.shape.clone(),
                actual: vec![view.data.len() / block_bytes.max(1) * block],
            });
        }
        Ok(view)
    }

    /// An f32 view of `data` (owned), e.g. for tests and generated weights.
    ///
    /// # Panics
    /// If `data` does not hold `shape`'s values.
    pub fn from_f32(name: &str, shape: Vec<usize>, data: &[f32]) -> WeightView<'static> {
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        WeightView::new(name, shape, GgmlType::F32, Cow::Owned(bytes)).expect("from_f32: data must hold the shape's values")
    }

    /// Total values.
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// `(rows, cols)` of a matrix; a typed error for any other rank.
    pub fn matrix_dims(&self) -> Result<(usize, usize)> {
        match self.shape[..] {
            [rows, cols] => Ok((rows, cols)),
            _ => Err(Error::ShapeMismatch { tensor: self.name.clone(), expected: vec![0, 0], actual: self.shape.clone() }),
        }
    }

    /// Bytes of one row (`shape.last()` values).
    pub fn row_bytes(&self) -> usize {
        let (block, block_bytes) = self.dtype.block_layout();
        self.shape.last().copied().unwrap_or(1) / block * block_bytes
    }

    /// The values converted to f32, row-major.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        if !self.dtype.is_dequantizable() {
            return Err(Error::UnsupportedTensorType {
                tensor: self.name.clone(),
                dtype: self.dtype.to_string(),
                supported: DEQUANTIZABLE,
            });
        }
        dequantize(self.dtype, &self.data, self.n_elements()).ok_or_else(|| Error::ShapeMismatch {
            tensor: self.name.clone(),
            expected: self.shape.clone(),
            actual: vec![self.data.len()],
        })
    }

    /// The view as an f32 [`Tensor`].
    pub fn to_tensor(&self) -> Result<Tensor> {
        Ok(Tensor { shape: self.shape.clone(), data: self.to_f32()? })
    }

    /// The same view, checked to have shape `expected`.
    pub fn expect_shape(self, expected: &[usize]) -> Result<Self> {
        if self.shape != expected {
            return Err(Error::ShapeMismatch { tensor: self.name, expected: expected.to_vec(), actual: self.shape });
        }
        Ok(self)
    }
}
