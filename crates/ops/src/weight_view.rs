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

    /// `parts` stacked along their rows (output features) as one `[Σ rows,
    /// cols]` weight of their type, named `name` — the q, k and v
    /// projections as one product, say; `None` when they differ in type or
    /// columns (a Q4_K_M file keeps some in Q6_K), or are not matrices.
    /// GGUF blocks never span rows, so the bytes concatenate as they are.
    pub fn concat_rows(name: &str, parts: &[WeightView<'_>]) -> Option<WeightView<'static>> {
        let first = parts.first()?;
        let (_, cols) = first.matrix_dims().ok()?;
        let mut rows = 0;
        for p in parts {
            let (r, c) = p.matrix_dims().ok()?;
            if p.dtype != first.dtype || c != cols {
                return None;
            }
            rows += r;
        }
        let data: Vec<u8> = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
        WeightView::new(name, vec![rows, cols], first.dtype, Cow::Owned(data)).ok()
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

    /// Rows `range` of a matrix (`[out, in]`: a column-parallel shard, the
    /// output features `range`), in any stored type: each row is whole
    /// blocks, so the rows' bytes are one contiguous run, borrowed where the
    /// view borrows. The whole range returns the view unchanged.
    pub fn rows(self, range: std::ops::Range<usize>) -> Result<WeightView<'a>> {
        let (rows, _) = self.matrix_dims()?;
        if range.start > range.end || range.end > rows {
            return Err(self.shard_error(&[range.end - range.start.min(range.end), self.shape[1]]));
        }
        if range == (0..rows) {
            return Ok(self);
        }
        let row_bytes = self.row_bytes();
        let bytes = range.start * row_bytes..range.end * row_bytes;
        let data = match self.data {
            Cow::Borrowed(b) => Cow::Borrowed(&b[bytes]),
            Cow::Owned(v) => Cow::Owned(v[bytes].to_vec()),
        };
        Ok(WeightView { name: self.name, shape: vec![range.len(), self.shape[1]], dtype: self.dtype, data })
    }

    /// Columns `range` of a matrix (`[out, in]`: a row-parallel shard, the
    /// input features `range`). Kept in the stored type when both ends fall
    /// on block boundaries (Q4_1's 32 values, a K-quant's 256); otherwise
    /// the shard is converted to f32, since a block cannot be split. The
    /// whole range returns the view unchanged (still borrowed).
    pub fn cols(self, range: std::ops::Range<usize>) -> Result<WeightView<'a>> {
        let (rows, cols) = self.matrix_dims()?;
        if range.start > range.end || range.end > cols {
            return Err(self.shard_error(&[rows, range.end - range.start.min(range.end)]));
        }
        if range == (0..cols) {
            return Ok(self);
        }
        let (block, block_bytes) = self.dtype.block_layout();
        if range.start.is_multiple_of(block) && range.end.is_multiple_of(block) {
            let row_bytes = self.row_bytes();
            let (from, to) = (range.start / block * block_bytes, range.end / block * block_bytes);
            let mut data = Vec::with_capacity(rows * (to - from));
            for row in self.data.chunks_exact(row_bytes.max(1)) {
                data.extend_from_slice(&row[from..to]);
            }
            return WeightView::new(&self.name, vec![rows, range.len()], self.dtype, Cow::Owned(data));
        }
        let values = self.to_f32()?;
        let mut data = Vec::with_capacity(rows * range.len() * 4);
        for row in values.chunks_exact(cols.max(1)) {
            data.extend(row[range.clone()].iter().flat_map(|v| v.to_le_bytes()));
        }
        WeightView::new(&self.name, vec![rows, range.len()], GgmlType::F32, Cow::Owned(data))
    }

    fn shard_error(&self, wanted: &[usize]) -> Error {
        Error::ShapeMismatch {
            tensor: format!("{} (a tensor-parallel shard)", self.name),
            expected: wanted.to_vec(),
            actual: self.shape.clone(),
        }
    }

    /// The same view, checked to have shape `expected`.
    pub fn expect_shape(self, expected: &[usize]) -> Result<Self> {
        if self.shape != expected {
            return Err(Error::ShapeMismatch { tensor: self.name, expected: expected.to_vec(), actual: self.shape });
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacked_rows_keep_each_parts_values_and_refuse_mixed_types() {
        let q = q8_matrix();
        let k = q8_matrix().rows(1..3).expect("rows");
        let qk = WeightView::concat_rows("qk", &[q.clone(), k.clone()]).expect("same type and columns");
        assert_eq!(qk.shape, vec![5, 64]);
        let (a, b, both) = (q.to_f32().unwrap(), k.to_f32().unwrap(), qk.to_f32().unwrap());
        assert_eq!(both, [a, b].concat());
        let f = WeightView::from_f32("f", vec![2, 64], &[0.5; 128]);
        assert!(WeightView::concat_rows("x", &[q.clone(), f]).is_none(), "Q8_0 and F32");
        let narrow = WeightView::from_f32("n", vec![2, 32], &[0.5; 64]);
        assert!(WeightView::concat_rows("x", &[WeightView::from_f32("g", vec![1, 64], &[1.0; 64]), narrow]).is_none(), "columns differ");
        assert!(WeightView::concat_rows("x", &[]).is_none());
    }

    /// A `[3, 64]` Q8_0 matrix: two blocks a row, scale 0.5, values that
    /// differ in every cell.
    fn q8_matrix() -> WeightView<'static> {
        let mut data = Vec::new();
        for r in 0..3i32 {
            for b in 0..2i32 {
                data.extend_from_slice(&HALF_BITS_OF_0_5.to_le_bytes());
                data.extend((0..32).map(|i| ((r * 40 + b * 32 + i) % 127 - 60) as i8 as u8));
            }
        }
        WeightView::new("w", vec![3, 64], GgmlType::Q8_0, Cow::Owned(data)).expect("a valid view")
    }

    /// 0.5 in IEEE half precision (a Q8_0 block's scale).
    const HALF_BITS_OF_0_5: u16 = 0x3800;

    #[test]
    fn shards_hold_the_values_of_their_rows_and_columns() {
        let full = q8_matrix().to_f32().expect("dequantizes");
        let row = |r: usize, cols: std::ops::Range<usize>| full[r * 64..(r + 1) * 64][cols].to_vec();
        // Rows: any range, the stored type kept.
        let rows = q8_matrix().rows(1..3).expect("rows");
        assert_eq!((rows.shape.clone(), rows.dtype), (vec![2, 64], GgmlType::Q8_0));
        assert_eq!(rows.to_f32().expect("dequantizes"), [row(1, 0..64), row(2, 0..64)].concat());
        // Columns on a block boundary keep the blocks.
        let cols = q8_matrix().cols(32..64).expect("cols");
        assert_eq!((cols.shape.clone(), cols.dtype), (vec![3, 32], GgmlType::Q8_0));
        assert_eq!(cols.to_f32().expect("dequantizes"), (0..3).flat_map(|r| row(r, 32..64)).collect::<Vec<_>>());
        // Columns inside a block cannot keep it: f32, same values.
        let cols = q8_matrix().cols(16..48).expect("cols");
        assert_eq!((cols.shape.clone(), cols.dtype), (vec![3, 32], GgmlType::F32));
        assert_eq!(cols.to_f32().expect("f32"), (0..3).flat_map(|r| row(r, 16..48)).collect::<Vec<_>>());
        // The whole range is the view itself, still borrowed; out of range is a typed error.
        assert_eq!(q8_matrix().rows(0..3).expect("all").data, q8_matrix().data);
        let stored = q8_matrix().data.into_owned();
        let borrowed = WeightView::new("w", vec![3, 64], GgmlType::Q8_0, Cow::Borrowed(&stored[..])).expect("a valid view");
        assert!(matches!(borrowed.clone().cols(0..64).expect("all").data, Cow::Borrowed(_)), "whole columns are not copied");
        assert!(matches!(borrowed.rows(0..3).expect("all").data, Cow::Borrowed(_)), "whole rows are not copied");
        assert!(matches!(q8_matrix().rows(2..4), Err(Error::ShapeMismatch { .. })));
        assert!(matches!(q8_matrix().cols(0..65), Err(Error::ShapeMismatch { .. })));
    }
}
