//! Pooling: what an embedding request asks instead of sampling.
//!
//! A pooling request is a prompt whose final hidden states (after the
//! model's last norm, before the LM head) are reduced to one vector: the
//! last token's (decoder embedding models such as Qwen3-Embedding and
//! e5-mistral), the mean over the prompt (sentence-transformers' mean
//! pooling), or the first token's (`CLS`). The request is prefill only:
//! it ends, and frees its KV blocks, in the step that computes its last
//! prompt token.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// How a prompt's hidden states become one vector (vLLM's `pooling_type`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum PoolingType {
    /// The last prompt token's hidden state.
    #[default]
    Last,
    /// The mean of every prompt token's hidden state.
    Mean,
    /// The first prompt token's hidden state.
    Cls,
}

impl PoolingType {
    /// Parses vLLM's names (`LAST`, `MEAN`, `CLS`; any case).
    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_uppercase().as_str() {
            "LAST" => Some(Self::Last),
            "MEAN" => Some(Self::Mean),
            "CLS" => Some(Self::Cls),
            _ => None,
        }
    }

    /// Whether the pooled vector reads hidden states a prefix-cache hit
    /// would skip (a hit always covers position 0: `MEAN` reads it with
    /// every other, `CLS` reads only it), so that such requests must
    /// compute their whole prompt; `LAST` reads the last position, which a
    /// hit never covers.
    pub fn needs_whole_prompt(self) -> bool {
        !matches!(self, Self::Last)
    }
}

/// One request's pooling.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PoolingParams {
    /// How the hidden states are reduced.
    pub pooling_type: PoolingType,
    /// Divide the vector by its L2 norm (after truncation).
    pub normalize: bool,
    /// Keep the first `dimensions` entries (Matryoshka truncation).
    pub dimensions: Option<usize>,
}

impl PoolingParams {
    /// Checks `dimensions` against the model's hidden size.
    pub fn validate(&self, hidden_size: usize) -> Result<()> {
        match self.dimensions {
            Some(d) if d == 0 || d > hidden_size => Err(Error::InvalidSamplingParam {
                param: "dimensions",
                message: format!("must be in [1, {hidden_size}] (the model's hidden size), got {d}"),
            }),
            _ => Ok(()),
        }
    }

    /// The request's vector from the pooled hidden state: truncated to
    /// `dimensions`, then normalized if asked.
    pub fn finish(&self, mut pooled: Vec<f32>) -> Vec<f32> {
        if let Some(d) = self.dimensions {
            pooled.truncate(d);
        }
        if self.normalize {
            let norm = pooled.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt();
            if norm > 0.0 {
                for x in &mut pooled {
                    *x = (f64::from(*x) / norm) as f32;
                }
            }
        }
        pooled
    }
}

/// Accumulates one request's pooled hidden state over the steps that
/// compute its prompt (a chunked prefill sees it in pieces; a prompt
/// recomputed after a preemption shows positions again, which are not
/// counted twice).
#[derive(Clone, Debug, PartialEq)]
pub struct Pooler {
    pooling_type: PoolingType,
    /// The sum of the rows seen (`Mean`), or the row kept (`Last`, `Cls`), in f64.
    acc: Vec<f64>,
    /// `Mean`: the next position to count.
    next: usize,
}

impl Pooler {
    /// An empty pooler.
    pub fn new(pooling_type: PoolingType) -> Self {
        Self { pooling_type, acc: Vec::new(), next: 0 }
    }

    /// Whether prompt position `pos` of a `prompt_len`-token prompt is
    /// read.
    pub fn wants(pooling_type: PoolingType, pos: usize, prompt_len: usize) -> bool {
        match pooling_type {
            PoolingType::Last => pos + 1 == prompt_len,
            PoolingType::Mean => pos < prompt_len,
            PoolingType::Cls => pos == 0,
        }
    }

    /// Adds the hidden state of prompt position `pos`, one
    /// [`Pooler::wants`]; positions come in order.
    pub fn add(&mut self, pos: usize, row: &[f32]) {
        match self.pooling_type {
            PoolingType::Mean => {
                if pos < self.next {
                    return; // seen before a preemption
                }
                if self.acc.is_empty() {
                    self.acc = vec![0.0; row.len()];
                }
                for (a, &x) in self.acc.iter_mut().zip(row) {
                    *a += f64::from(x);
                }
                self.next = pos + 1;
            }
            PoolingType::Last | PoolingType::Cls => self.acc = row.iter().map(|&x| f64::from(x)).collect(),
        }
    }

    /// The pooled vector (empty if no row was seen).
    pub fn pooled(&self) -> Vec<f32> {
        let div = if self.pooling_type == PoolingType::Mean { self.next.max(1) as f64 } else { 1.0 };
        self.acc.iter().map(|&a| (a / div) as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_last_and_cls_pool_the_rows_they_read() {
        let rows = [[1.0f32, 2.0], [3.0, 4.0], [5.0, 9.0]];
        let pool = |t: PoolingType| {
            let mut p = Pooler::new(t);
            for (pos, r) in rows.iter().enumerate() {
                if Pooler::wants(t, pos, rows.len()) {
                    p.add(pos, r);
                }
            }
            // A recompute after a preemption shows the first rows again.
            if Pooler::wants(t, 0, rows.len()) {
                p.add(0, &rows[0]);
            }
            p.pooled()
        };
        assert_eq!(pool(PoolingType::Mean), vec![3.0, 5.0]);
        assert_eq!(pool(PoolingType::Last), vec![5.0, 9.0]);
        assert_eq!(pool(PoolingType::Cls), vec![1.0, 2.0]);
    }

    #[test]
    fn truncation_comes_before_normalization() {
        let p = PoolingParams { normalize: true, dimensions: Some(2), ..Default::default() };
        assert_eq!(p.finish(vec![3.0, 4.0, 100.0]), vec![0.6, 0.8]);
        assert!(p.validate(2).is_ok());
        assert!(p.validate(1).unwrap_err().to_string().contains("dimensions"));
        assert!(PoolingParams { dimensions: Some(0), ..p }.validate(8).is_err());
        // A zero vector stays zero.
        assert_eq!(PoolingParams { normalize: true, ..Default::default() }.finish(vec![0.0, 0.0]), vec![0.0, 0.0]);
    }

    #[test]
    fn pooling_types_parse_by_vllms_names() {
        assert_eq!(PoolingType::parse("mean"), Some(PoolingType::Mean));
        assert_eq!(PoolingType::parse("LAST"), Some(PoolingType::Last));
        assert_eq!(PoolingType::parse("Cls"), Some(PoolingType::Cls));
        assert_eq!(PoolingType::parse("max"), None);
        assert!(PoolingType::Mean.needs_whole_prompt() && !PoolingType::Last.needs_whole_prompt());
    }
}
