//! Tensor parallelism (Megatron-LM's split, PagedAttention paper §4.6):
//! which part of every layer one rank holds.
//!
//! ```text
//!  embedding      vocabulary-parallel: rows vocab(r)          ─ all-reduce
//!  q, k, v        column-parallel: the rank's heads            (no communication)
//!  attention      over the rank's heads, in its own paged KV cache
//!  o_proj         row-parallel: inputs of the rank's heads     ─ all-reduce
//!  gate, up       column-parallel: intermediate(r)
//!  down_proj      row-parallel: inputs intermediate(r)         ─ all-reduce
//!  LM head        vocabulary-parallel: logits vocab(r)         ─ gathered by the runner
//! ```
//!
//! Query heads split evenly. KV heads split evenly when there are at least
//! as many as ranks; when there are fewer (grouped-query attention with
//! few KV heads), each is replicated on the ranks whose query heads read it,
//! as vLLM does. The KV-cache manager and the scheduler see one cache:
//! every rank holds the same blocks, each for its own heads.

use crate::ops::{OpResult, Ops};
use crate::{Result, WeightSource};
use std::ops::Range;
use vellum_base::{Error, ModelConfig};

/// Rank `rank` of a tensor-parallel group of `size` (`--tensor-parallel-size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorParallel {
    /// This rank, `0..size`.
    pub rank: usize,
    /// Ranks in the group.
    pub size: usize,
}

impl Default for TensorParallel {
    fn default() -> Self {
        Self::SINGLE
    }
}

impl TensorParallel {
    /// The whole model on one rank.
    pub const SINGLE: TensorParallel = TensorParallel { rank: 0, size: 1 };

    /// Every rank of a group of `size`.
    pub fn ranks(size: usize) -> impl Iterator<Item = TensorParallel> {
        (0..size).map(move |rank| TensorParallel { rank, size })
    }

    /// Whether this is a group of more than one rank.
    pub fn is_sharded(self) -> bool {
        self.size > 1
    }

    /// `Ok` when `config` splits over `size` ranks, else the typed error
    /// that says which dimension does not divide (vLLM's rules: the query
    /// heads and the MLP divide evenly; the KV heads divide, or divide the
    /// size and are replicated).
    pub fn check(size: usize, config: &ModelConfig) -> vellum_base::Result<()> {
        let refuse = |message: String| Err(Error::InvalidConfig { field: "tensor-parallel-size", message });
        let (nq, nkv, im) = (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size);
        if size == 0 {
            return refuse("--tensor-parallel-size must be at least 1".into());
        }
        if !nq.is_multiple_of(size) {
            return refuse(format!("--tensor-parallel-size {size} does not divide the model's {nq} attention heads"));
        }
        if nkv == 0 || !(nkv.is_multiple_of(size) || size.is_multiple_of(nkv)) {
            return refuse(format!(
                "--tensor-parallel-size {size} and the model's {nkv} KV heads: one must divide the other \
                 (fewer KV heads than ranks are replicated)"
            ));
        }
        if !im.is_multiple_of(size) {
            return refuse(format!("--tensor-parallel-size {size} does not divide the model's MLP width {im}"));
        }
        if config.vocab_size < size {
            return refuse(format!("--tensor-parallel-size {size} exceeds the vocabulary of {}", config.vocab_size));
        }
        Ok(())
    }

    /// The query heads this rank computes.
    pub fn q_heads(self, config: &ModelConfig) -> Range<usize> {
        even_share(config.num_attention_heads, self)
    }

    /// The KV heads this rank stores: its share, or the one head its query
    /// heads read when the KV heads are fewer than the ranks.
    pub fn kv_heads(self, config: &ModelConfig) -> Range<usize> {
        let nkv = config.num_key_value_heads;
        if nkv >= self.size {
            even_share(nkv, self)
        } else {
            let head = self.rank * nkv / self.size;
            head..head + 1
        }
    }

    /// This rank's columns of the MLP's intermediate activation.
    pub fn intermediate(self, config: &ModelConfig) -> Range<usize> {
        even_share(config.intermediate_size, self)
    }

    /// The vocabulary rows of the embedding and the LM head this rank holds:
    /// `vocab / size` each, the first `vocab % size` ranks one more (never
    /// an empty shard).
    pub fn vocab(self, config: &ModelConfig) -> Range<usize> {
        let (per, extra) = (config.vocab_size / self.size, config.vocab_size % self.size);
        let start = self.rank * per + self.rank.min(extra);
        start..start + per + usize::from(self.rank < extra)
    }
}

/// One rank's part of a model, in the units its weights are cut in.
pub(crate) struct Shard {
    /// Query heads ([`TensorParallel::q_heads`]).
    pub(crate) q_heads: Range<usize>,
    /// KV heads ([`TensorParallel::kv_heads`]).
    pub(crate) kv_heads: Range<usize>,
    /// The query heads' rows of q (and columns of o): `q_heads · head_dim`.
    pub(crate) q_cols: Range<usize>,
    /// The KV heads' rows of k and v: `kv_heads · head_dim`.
    pub(crate) kv_cols: Range<usize>,
    /// MLP columns ([`TensorParallel::intermediate`]).
    pub(crate) mlp: Range<usize>,
    /// Vocabulary rows ([`TensorParallel::vocab`]).
    pub(crate) vocab: Range<usize>,
}

impl TensorParallel {
    /// Every range of this rank's part of `config`'s model.
    pub(crate) fn shard(self, config: &ModelConfig) -> Shard {
        let hd = config.head_dim;
        let (q_heads, kv_heads) = (self.q_heads(config), self.kv_heads(config));
        Shard {
            q_cols: q_heads.start * hd..q_heads.end * hd,
            kv_cols: kv_heads.start * hd..kv_heads.end * hd,
            q_heads,
            kv_heads,
            mlp: self.intermediate(config),
            vocab: self.vocab(config),
        }
    }
}

/// Loads rank `tp`'s part of each weight through `ops`: the model
/// definitions call these with the full shape the checkpoint stores and the
/// range of that rank; on a single rank every range is whole and the
/// weights pass through unchanged.
pub(crate) struct ShardLoader<'a, O: Ops> {
    pub(crate) ops: &'a O,
    pub(crate) weights: &'a dyn WeightSource,
}

impl<O: Ops> ShardLoader<'_, O> {
    /// A column-parallel linear (`[out, in]`, output features `rows`).
    pub(crate) fn column(&self, name: &str, shape: [usize; 2], rows: Range<usize>) -> Result<O::Weight> {
        Ok(self.ops.linear_weight(self.weights.tensor_shaped(name, &shape)?.rows(rows)?)?)
    }

    /// Column-parallel linears that share their input (`(name, shape,
    /// rows)` each) as one stacked weight, where the backend multiplies
    /// them so ([`Ops::stacked_weight`]); `None`: load them apart.
    pub(crate) fn stacked(&self, name: &str, parts: &[(String, [usize; 2], Range<usize>)]) -> Result<Option<O::Weight>> {
        let mut views = Vec::with_capacity(parts.len());
        for (part, shape, rows) in parts {
            views.push(self.weights.tensor_shaped(part, shape)?.rows(rows.clone())?);
        }
        Ok(self.ops.stacked_weight(name, &views)?)
    }

    /// A row-parallel linear (`[out, in]`, input features `cols`).
    pub(crate) fn row(&self, name: &str, shape: [usize; 2], cols: Range<usize>) -> Result<O::Weight> {
        Ok(self.ops.linear_weight(self.weights.tensor_shaped(name, &shape)?.cols(cols)?)?)
    }

    /// A vocabulary-parallel embedding table (`[vocab, hidden]`, rows `rows`).
    pub(crate) fn embedding(&self, name: &str, shape: [usize; 2], rows: Range<usize>) -> Result<O::Weight> {
        Ok(self.ops.embedding_weight(self.weights.tensor_shaped(name, &shape)?.rows(rows)?)?)
    }

    /// Elements `range` of a 1-D parameter of `len` (a column-parallel
    /// bias), on the host.
    pub(crate) fn vector_part(&self, name: &str, len: usize, range: Range<usize>) -> Result<Vec<f32>> {
        Ok(self.weights.tensor_f32_shaped(name, &[len])?.data[range].to_vec())
    }
}

/// The step's embeddings: a lookup on a single rank; on a rank of a group,
/// its vocabulary shard's rows (zeros for the other tokens) summed over the
/// group.
pub(crate) fn embed<O: Ops>(
    ops: &O,
    table: &O::Weight,
    step: &O::Step,
    tp: TensorParallel,
    vocab_start: usize,
    vocab_size: usize,
) -> OpResult<O::Tensor> {
    if !tp.is_sharded() {
        return ops.embed(table, step);
    }
    let mut h = ops.embed_vocab_shard(table, step, vocab_start, vocab_size)?;
    ops.all_reduce(&mut h)?;
    Ok(h)
}

/// Rank `tp.rank`'s equal share of `n` (which `tp.size` divides).
fn even_share(n: usize, tp: TensorParallel) -> Range<usize> {
    let per = n / tp.size;
    tp.rank * per..(tp.rank + 1) * per
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(nq: usize, nkv: usize, im: usize, vocab: usize) -> ModelConfig {
        let json = format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "vocab_size": {vocab}, "hidden_size": {h}, "intermediate_size": {im},
                "num_hidden_layers": 1, "num_attention_heads": {nq}, "num_key_value_heads": {nkv}}}"#,
            h = nq * 64
        );
        ModelConfig::from_json_str(&json, "<test>").expect("a valid config")
    }

    #[test]
    fn every_rank_reads_the_kv_head_of_its_query_heads() {
        // SmolLM2-135M at TP 3: 9 query heads, 3 KV heads; Gemma 3 270M at
        // TP 4: 4 query heads, 1 KV head (replicated).
        for (c, size) in [(config(9, 3, 1536, 49152), 3), (config(4, 1, 2048, 262144), 4), (config(32, 8, 14336, 128256), 2)] {
            TensorParallel::check(size, &c).expect("divides");
            let group = c.num_attention_heads / c.num_key_value_heads;
            let mut vocab_end = 0;
            for tp in TensorParallel::ranks(size) {
                let (q, kv) = (tp.q_heads(&c), tp.kv_heads(&c));
                assert_eq!(q.len(), c.num_attention_heads / size);
                // Each query head's KV head (head / group) is one this rank stores.
                for head in q.clone() {
                    assert!(kv.contains(&(head / group)), "rank {} head {head} reads kv {} not in {kv:?}", tp.rank, head / group);
                }
                // and the rank's query heads map onto its KV heads in order.
                assert_eq!(q.len() % kv.len(), 0);
                let v = tp.vocab(&c);
                assert_eq!(v.start, vocab_end, "vocabulary shards tile the vocabulary");
                vocab_end = v.end;
            }
            assert_eq!(vocab_end, c.vocab_size);
        }
    }

    #[test]
    fn a_vocabulary_that_does_not_divide_is_split_without_an_empty_shard() {
        for (vocab, size) in [(6, 4), (49153, 3), (7, 2), (4, 4)] {
            let c = config(4, 4, 64, vocab);
            let shards: Vec<_> = TensorParallel::ranks(size).map(|tp| tp.vocab(&c)).collect();
            assert_eq!(shards[0].start, 0);
            assert_eq!(shards[size - 1].end, vocab);
            for w in shards.windows(2) {
                assert_eq!(w[0].end, w[1].start, "{vocab} over {size}: {shards:?}");
            }
            assert!(shards.iter().all(|r| !r.is_empty() && r.len() <= vocab.div_ceil(size)), "{vocab} over {size}: {shards:?}");
        }
    }

    #[test]
    fn shapes_that_do_not_divide_are_refused_by_name() {
        let c = config(9, 3, 1536, 49152);
        for (size, what) in [(2, "attention heads"), (4, "attention heads"), (0, "at least 1")] {
            let e = TensorParallel::check(size, &c).expect_err("refused").to_string();
            assert!(e.contains(what), "{size}: {e}");
        }
        let e = TensorParallel::check(2, &config(6, 3, 2048, 100)).expect_err("3 KV heads over 2 ranks").to_string();
        assert!(e.contains("KV heads"), "{e}");
        let e = TensorParallel::check(2, &config(4, 2, 1001, 100)).expect_err("odd MLP").to_string();
        assert!(e.contains("MLP width 1001"), "{e}");
        assert!(TensorParallel::check(1, &c).is_ok());
    }
}
