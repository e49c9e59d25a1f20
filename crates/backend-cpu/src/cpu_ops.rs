//! [`Ops`] on host memory: f32 activations, f32 weights, rayon threads.
//!
//! Weights keep the Hugging Face `[out, in]` layout, so every output of
//! `x · Wᵀ` is a dot product of two contiguous rows; outputs are split across
//! threads in column blocks. Inner loops are written to auto-vectorise and are
//! compiled twice — baseline and AVX2 — with the variant picked at run time.

use crate::kv_cache::KvCache;
use crate::paged_attention::{paged_attention, write_kv};
use rayon::prelude::*;
use vellum_core::AttentionMetadata;
use vellum_models::ops::{AttentionShape, Ops};
use vellum_models::rope::RopeTable;
use vellum_models::Tensor;

/// Row-major activations `[rows, cols]`.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Rows (tokens).
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// `rows * cols` values.
    pub data: Vec<f32>,
}

impl HostTensor {
    fn zeros(rows: usize, cols: usize) -> Self {
        Self { rows, cols, data: vec![0.0; rows * cols] }
    }
}

/// A weight matrix `[out, in]`, row-major.
#[derive(Clone, Debug)]
pub struct HostWeight {
    out: usize,
    inp: usize,
    data: Vec<f32>,
}

/// The CPU implementation of the model operations.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuOps;

#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..16 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_generic(a, b)
}

/// Dot product of two equal-length slices, AVX2 when the CPU has it.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports the features the function enables.
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_generic(a, b)
}

/// Output columns computed per task.
const COL_BLOCK: usize = 64;

impl Ops for CpuOps {
    type Tensor = HostTensor;
    type Weight = HostWeight;
    type Vector = Vec<f32>;
    type KvCache = KvCache;

    fn linear_weight(&self, name: &str, w: Tensor) -> vellum_models::Result<HostWeight> {
        match w.shape[..] {
            [out, inp] => Ok(HostWeight { out, inp, data: w.data }),
            _ => Err(vellum_models::Error::ShapeMismatch { tensor: name.to_string(), expected: vec![0, 0], actual: w.shape }),
        }
    }

    fn embedding_weight(&self, name: &str, w: Tensor) -> vellum_models::Result<HostWeight> {
        self.linear_weight(name, w)
    }

    fn vector(&self, data: Vec<f32>) -> Vec<f32> {
        data
    }

    fn embed(&self, table: &HostWeight, ids: &[u32]) -> HostTensor {
        let mut out = HostTensor::zeros(ids.len(), table.inp);
        for (row, &id) in out.data.chunks_exact_mut(table.inp).zip(ids) {
            let id = id as usize;
            assert!(id < table.out, "token id {id} outside the vocabulary of {}", table.out);
            row.copy_from_slice(&table.data[id * table.inp..(id + 1) * table.inp]);
        }
        out
    }

    fn linear(&self, x: &HostTensor, w: &HostWeight, bias: Option<&Vec<f32>>) -> HostTensor {
        assert_eq!(x.cols, w.inp, "linear: input width {} but weight takes {}", x.cols, w.inp);
        let (t, n, k) = (x.rows, w.out, w.inp);
        let tiles: Vec<Vec<f32>> = (0..n.div_ceil(COL_BLOCK))
            .into_par_iter()
            .map(|c| {
                let cols = c * COL_BLOCK..((c + 1) * COL_BLOCK).min(n);
                let mut tile = vec![0.0f32; t * cols.len()];
                for (j, o) in cols.clone().enumerate() {
                    let wrow = &w.data[o * k..(o + 1) * k];
                    let b = bias.map_or(0.0, |b| b[o]);
                    for r in 0..t {
                        tile[r * cols.len() + j] = dot(&x.data[r * k..(r + 1) * k], wrow) + b;
                    }
                }
                tile
            })
            .collect();
        let mut out = HostTensor::zeros(t, n);
        for (c, tile) in tiles.iter().enumerate() {
            let start = c * COL_BLOCK;
            let width = tile.len() / t.max(1);
            for r in 0..t {
                out.data[r * n + start..r * n + start + width].copy_from_slice(&tile[r * width..(r + 1) * width]);
            }
        }
        out
    }

    fn rms_norm(&self, x: &HostTensor, w: &Vec<f32>, eps: f32, group: usize) -> HostTensor {
        assert!(group > 0 && x.cols % group == 0 && w.len() == group, "rms_norm: width {} group {group} weight {}", x.cols, w.len());
        let mut out = x.clone();
        for g in out.data.chunks_exact_mut(group) {
            let ms = g.iter().map(|v| v * v).sum::<f32>() / group as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for (v, wi) in g.iter_mut().zip(w) {
                *v = *v * inv * wi;
            }
        }
        out
    }

    fn rope(&self, x: &mut HostTensor, head_dim: usize, positions: &[u32], table: &RopeTable) {
        assert_eq!(x.rows, positions.len(), "rope: one position per row");
        let half = head_dim / 2;
        let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
        let cols = x.cols;
        for (row, &pos) in x.data.chunks_exact_mut(cols).zip(positions) {
            table.cos_sin(pos, &mut cos, &mut sin);
            for head in row.chunks_exact_mut(head_dim) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x0, x1) = (a[i], b[i]);
                    a[i] = x0 * cos[i] - x1 * sin[i];
                    b[i] = x1 * cos[i] + x0 * sin[i];
                }
            }
        }
    }

    fn silu_mul(&self, gate: &HostTensor, up: &HostTensor) -> HostTensor {
        assert_eq!((gate.rows, gate.cols), (up.rows, up.cols), "silu_mul: shapes differ");
        let data = gate.data.iter().zip(&up.data).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        HostTensor { rows: gate.rows, cols: gate.cols, data }
    }

    fn add_assign(&self, x: &mut HostTensor, y: &HostTensor) {
        assert_eq!(x.data.len(), y.data.len(), "add_assign: shapes differ");
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
    }

    fn attention(
        &self,
        cache: &mut KvCache,
        layer: usize,
        q: &HostTensor,
        k: &HostTensor,
        v: &HostTensor,
        meta: &AttentionMetadata<'_>,
        shape: AttentionShape,
    ) -> HostTensor {
        let layout = cache.layout;
        let layer_cache = &mut cache.layers[layer];
        write_kv(layer_cache, &layout, &k.data, &v.data, meta.slot_mapping);
        let mut out = HostTensor::zeros(q.rows, shape.num_heads * shape.head_dim);
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        paged_attention(&mut out.data, &q.data, layer_cache, &layout, meta, shape.num_heads, scale);
        out
    }

    fn gather_rows(&self, x: &HostTensor, rows: &[u32]) -> HostTensor {
        let mut out = HostTensor::zeros(rows.len(), x.cols);
        for (dst, &r) in out.data.chunks_exact_mut(x.cols).zip(rows) {
            let r = r as usize;
            dst.copy_from_slice(&x.data[r * x.cols..(r + 1) * x.cols]);
        }
        out
    }

    fn to_host(&self, x: &HostTensor) -> Vec<f32> {
        x.data.clone()
    }
}
