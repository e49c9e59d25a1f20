//! Weights on the device, in the backend's own layout: GGUF's Q4_1 and
//! Q8_0 blocks stay blocks (Q4_0 becomes Q4_1 exactly; Q8_0 is padded to
//! whole words), f16/bf16 stay 16-bit, anything else is widened to f32.
//! Every format is stored column-major over the output rows (block or
//! element `(k, n)` at `k * N + n`), so that neighbouring invocations —
//! neighbouring output columns — read neighbouring words. A weight larger
//! than a storage binding is split into chunks of whole rows.

use crate::context::GpuContext;
use crate::kernels::WeightFormat;
use crate::memory::DeviceBuffer;
use half::f16;
use std::sync::Arc;
use vellum_ops::quant::GgmlType;
use vellum_ops::{Error, Result, WeightView};

/// One chunk of a weight's rows.
#[derive(Debug)]
pub struct WeightChunk {
    /// First row (output column) of the chunk.
    pub row0: usize,
    /// Rows in the chunk.
    pub rows: usize,
    /// The chunk's data in its format's layout.
    pub data: DeviceBuffer,
}

/// A `[out, in]` weight on the device.
#[derive(Debug)]
pub struct GpuWeight {
    /// Rows (`N`, output features; the vocabulary of an embedding table).
    pub out: usize,
    /// Columns (`K`, input features).
    pub inp: usize,
    /// The storage format.
    pub format: WeightFormat,
    /// The rows, split to fit the binding limit.
    pub chunks: Vec<WeightChunk>,
}

impl GpuWeight {
    /// Bytes on the device.
    pub fn bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.data.buf.size()).sum()
    }
}

/// The device format for a file type, and bytes per row in it.
fn format_for(dtype: GgmlType, k: usize, view: &WeightView<'_>) -> WeightFormat {
    match dtype {
        GgmlType::Q4_1 if k.is_multiple_of(32) => WeightFormat::Q4_1,
        GgmlType::Q4_0 if k.is_multiple_of(32) && q4_0_offsets_fit(&view.data) => WeightFormat::Q4_1,
        GgmlType::Q8_0 if k.is_multiple_of(32) => WeightFormat::Q8_0,
        GgmlType::F16 => WeightFormat::F16,
        GgmlType::BF16 => WeightFormat::Bf16,
        _ => WeightFormat::F32,
    }
}

/// Whether every Q4_0 block's offset `-8·d` is itself an f16.
fn q4_0_offsets_fit(data: &[u8]) -> bool {
    data.chunks_exact(18).all(|b| (8.0 * f16::from_le_bytes([b[0], b[1]]).to_f32()).abs() <= 65504.0)
}

fn row_bytes(format: WeightFormat, k: usize) -> usize {
    match format {
        WeightFormat::F32 => 4 * k,
        WeightFormat::F16 | WeightFormat::Bf16 => 4 * k.div_ceil(2),
        WeightFormat::Q4_1 => k / 32 * 20,
        WeightFormat::Q8_0 => k / 32 * 36,
    }
}

/// The device words of rows `r0..r1` of `view` in `format`'s layout.
fn layout(view: &WeightView<'_>, format: WeightFormat, values: Option<&[f32]>, k: usize, r0: usize, r1: usize) -> Vec<u8> {
    let n = r1 - r0;
    let mut out = vec![0u8; n * row_bytes(format, k)];
    let src = &view.data;
    match format {
        WeightFormat::F32 => {
            let vals = values.unwrap_or(&[]);
            for r in 0..n {
                for c in 0..k {
                    let o = (c * n + r) * 4;
                    out[o..o + 4].copy_from_slice(&vals[(r0 + r) * k + c].to_le_bytes());
                }
            }
        }
        WeightFormat::F16 | WeightFormat::Bf16 => {
            // Both are 2-byte elements in the file; pairs along K share a word.
            for r in 0..n {
                for c in 0..k {
                    let s = ((r0 + r) * k + c) * 2;
                    let o = ((c / 2) * n + r) * 4 + (c % 2) * 2;
                    out[o..o + 2].copy_from_slice(&src[s..s + 2]);
                }
            }
        }
        WeightFormat::Q4_1 => {
            let blocks = k / 32;
            let (in_bytes, q4_0) = if view.dtype == GgmlType::Q4_0 { (18, true) } else { (20, false) };
            for r in 0..n {
                for b in 0..blocks {
                    let s = ((r0 + r) * blocks + b) * in_bytes;
                    let o = (b * n + r) * 20;
                    let blk = &src[s..s + in_bytes];
                    if q4_0 {
                        // Q4_0 value (q - 8)·d is Q4_1's q·d + m with m = -8·d.
                        let d = f16::from_le_bytes([blk[0], blk[1]]);
                        let m = f16::from_f32(-8.0 * d.to_f32());
                        out[o..o + 2].copy_from_slice(&blk[0..2]);
                        out[o + 2..o + 4].copy_from_slice(&m.to_le_bytes());
                        out[o + 4..o + 20].copy_from_slice(&blk[2..18]);
                    } else {
                        out[o..o + 20].copy_from_slice(blk);
                    }
                }
            }
        }
        WeightFormat::Q8_0 => {
            let blocks = k / 32;
            for r in 0..n {
                for b in 0..blocks {
                    let s = ((r0 + r) * blocks + b) * 34;
                    let o = (b * n + r) * 36;
                    out[o..o + 2].copy_from_slice(&src[s..s + 2]);
                    out[o + 4..o + 36].copy_from_slice(&src[s + 2..s + 34]);
                }
            }
        }
    }
    out
}

/// Uploads a `[out, in]` weight, split into chunks of at most `limit` bytes.
pub fn upload(ctx: &Arc<GpuContext>, view: &WeightView<'_>, limit: u64) -> Result<GpuWeight> {
    let (out, inp) = view.matrix_dims()?;
    let format = format_for(view.dtype, inp, view);
    let values = match format {
        WeightFormat::F32 => Some(view.to_f32()?),
        _ => None,
    };
    let per_row = row_bytes(format, inp).max(4) as u64;
    let rows_per_chunk = (limit / per_row) as usize;
    if rows_per_chunk == 0 {
        return Err(Error::Backend(vellum_base::Error::OutOfMemory {
            what: format!("{}: one row of {per_row} bytes exceeds the device's {limit}-byte storage binding", view.name),
            bytes: per_row,
        }));
    }
    let mut chunks = Vec::new();
    let mut row0 = 0;
    while row0 < out {
        let rows = rows_per_chunk.min(out - row0);
        let bytes = layout(view, format, values.as_deref(), inp, row0, row0 + rows);
        let data = DeviceBuffer::with_data(ctx, &view.name, &bytes)?;
        chunks.push(WeightChunk { row0, rows, data });
        row0 += rows;
    }
    Ok(GpuWeight { out, inp, format, chunks })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_column_major_over_rows() {
        // 2 rows × 2 Q8_0 blocks: block (b, n) lands at (b * 2 + n) * 36.
        let mut data = Vec::new();
        for r in 0..2u8 {
            for b in 0..2u8 {
                data.extend_from_slice(&f16::from_f32(1.0 + r as f32).to_le_bytes());
                data.extend((0..32).map(|e| r * 64 + b * 32 + e));
            }
        }
        let view = WeightView::new("w", vec![2, 64], GgmlType::Q8_0, data.into()).expect("whole blocks");
        let bytes = layout(&view, WeightFormat::Q8_0, None, 64, 0, 2);
        assert_eq!(bytes.len(), 4 * 36);
        for (b, n) in [(0usize, 0usize), (0, 1), (1, 0), (1, 1)] {
            let o = (b * 2 + n) * 36;
            assert_eq!(f16::from_le_bytes([bytes[o], bytes[o + 1]]).to_f32(), 1.0 + n as f32);
            assert_eq!(bytes[o + 4], (n * 64 + b * 32) as u8);
        }
        let f32_view = WeightView::from_f32("w", vec![2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let vals = f32_view.to_f32().expect("f32");
        let t = layout(&f32_view, WeightFormat::F32, Some(&vals), 3, 0, 2);
        let got: Vec<f32> = t.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert_eq!(got, [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    }
}
