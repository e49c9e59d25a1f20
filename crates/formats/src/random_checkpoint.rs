//! Random-weight Hugging Face checkpoints of real shapes, for benchmarks and
//! tests on machines that cannot download weights.
//!
//! [`write_random_checkpoint`] writes a directory `SafetensorsWeights` and
//! any Hugging Face loader open: `config.json` (`LlamaForCausalLM`),
//! `tokenizer.json` (a byte-level BPE of the 256 bytes plus
//! `<|begin_of_text|>`, put first as Llama 3's is, and `<|end_of_text|>`:
//! every text encodes, ids stay below the model's vocabulary), and the weights in safetensors shards of at
//! most `max_shard_bytes` with `model.safetensors.index.json`, streamed to
//! disk tensor by tensor. Values are uniform in `±1/√fan_in` (norm weights
//! `1 ± 0.05`), never zeros, from a seeded generator split in fixed chunks,
//! so the same seed gives the same files on any number of threads.

use crate::{Error, Result};
use std::io::{BufWriter, Write};
use std::path::Path;
use vellum_base::SeededRng;

/// A Llama-family shape (the Llama 3 layout: GQA, SwiGLU, untied head).
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointShape {
    /// Hidden size.
    pub hidden: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Vocabulary (embedding and LM-head rows).
    pub vocab: usize,
    /// Context length the config declares.
    pub max_positions: usize,
    /// RoPE base.
    pub rope_theta: f64,
}

impl CheckpointShape {
    /// Llama 3 8B: 32 layers of 4096, 32 query and 8 KV heads of 128,
    /// MLP 14336, vocabulary 128256 (8.03 B parameters; 16.1 GB in bf16).
    pub const LLAMA3_8B: CheckpointShape = CheckpointShape {
        hidden: 4096,
        intermediate: 14336,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        vocab: 128_256,
        max_positions: 8192,
        rope_theta: 500_000.0,
    };

    /// Llama 3.2 1B's shape (untied here): 16 layers of 2048, 32/8 heads of
    /// 64, MLP 8192.
    pub const LLAMA3_1B: CheckpointShape = CheckpointShape {
        hidden: 2048,
        intermediate: 8192,
        layers: 16,
        heads: 32,
        kv_heads: 8,
        vocab: 128_256,
        max_positions: 8192,
        rope_theta: 500_000.0,
    };

    /// The shapes known by name: `llama3-8b`, `llama3-1b`.
    pub fn named(name: &str) -> Option<CheckpointShape> {
        match name {
            "llama3-8b" => Some(Self::LLAMA3_8B),
            "llama3-1b" => Some(Self::LLAMA3_1B),
            _ => None,
        }
    }

    /// Every tensor, in file order: Hugging Face name, shape, whether it is
    /// a norm weight.
    fn tensors(&self) -> Vec<(String, Vec<usize>, bool)> {
        let head_dim = self.hidden / self.heads;
        let (q, kv) = (self.heads * head_dim, self.kv_heads * head_dim);
        let mut out = vec![("model.embed_tokens.weight".to_string(), vec![self.vocab, self.hidden], false)];
        for i in 0..self.layers {
            let l = |s: &str| format!("model.layers.{i}.{s}");
            out.push((l("input_layernorm.weight"), vec![self.hidden], true));
            out.push((l("self_attn.q_proj.weight"), vec![q, self.hidden], false));
            out.push((l("self_attn.k_proj.weight"), vec![kv, self.hidden], false));
            out.push((l("self_attn.v_proj.weight"), vec![kv, self.hidden], false));
            out.push((l("self_attn.o_proj.weight"), vec![self.hidden, q], false));
            out.push((l("post_attention_layernorm.weight"), vec![self.hidden], true));
            out.push((l("mlp.gate_proj.weight"), vec![self.intermediate, self.hidden], false));
            out.push((l("mlp.up_proj.weight"), vec![self.intermediate, self.hidden], false));
            out.push((l("mlp.down_proj.weight"), vec![self.hidden, self.intermediate], false));
        }
        out.push(("model.norm.weight".to_string(), vec![self.hidden], true));
        out.push(("lm_head.weight".to_string(), vec![self.vocab, self.hidden], false));
        out
    }

    /// Parameters.
    pub fn parameters(&self) -> u64 {
        self.tensors().iter().map(|(_, s, _)| s.iter().product::<usize>() as u64).sum()
    }

    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::CheckpointShape(what));
        if self.heads == 0 || self.kv_heads == 0 || !self.hidden.is_multiple_of(self.heads) || !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!("{} heads, {} KV heads and hidden {} do not divide", self.heads, self.kv_heads, self.hidden));
        }
        if [self.hidden, self.intermediate, self.layers, self.vocab, self.max_positions].contains(&0) {
            return bad(format!("a zero size in {self:?}"));
        }
        Ok(())
    }
}

/// The element type the weights are written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointDtype {
    /// `F32`.
    F32,
    /// `F16`.
    F16,
    /// `BF16`.
    Bf16,
}

impl CheckpointDtype {
    /// Parses `f32`, `f16`/`float16`, `bf16`/`bfloat16`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f32" | "float32" => Some(Self::F32),
            "f16" | "float16" => Some(Self::F16),
            "bf16" | "bfloat16" => Some(Self::Bf16),
            _ => None,
        }
    }

    fn bytes(self) -> usize {
        if self == Self::F32 {
            4
        } else {
            2
        }
    }

    fn safetensors_name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Bf16 => "BF16",
        }
    }

    fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::F16 => "float16",
            Self::Bf16 => "bfloat16",
        }
    }

    /// Writes `v` into `slot` (`self.bytes()` long), little-endian.
    fn encode(self, v: f32, slot: &mut [u8]) {
        match self {
            Self::F32 => slot.copy_from_slice(&v.to_le_bytes()),
            Self::F16 => slot.copy_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            Self::Bf16 => slot.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }
}

/// What [`write_random_checkpoint`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteReport {
    /// Tensors written.
    pub tensors: usize,
    /// Safetensors shards.
    pub shards: usize,
    /// Bytes of weights (headers excluded).
    pub weight_bytes: u64,
}

/// Values per generator chunk: the unit of work of one thread, and what
/// keeps the output independent of the thread count.
const CHUNK: usize = 1 << 20;

/// Writes a random-weight checkpoint of `shape` into `dir` (created if
/// needed), calling `progress(bytes_done, bytes_total)` after each tensor.
pub fn write_random_checkpoint(
    dir: &Path,
    shape: &CheckpointShape,
    dtype: CheckpointDtype,
    seed: u64,
    max_shard_bytes: u64,
    mut progress: impl FnMut(u64, u64),
) -> Result<WriteReport> {
    shape.check()?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let tensors = shape.tensors();
    let size = |s: &[usize]| (s.iter().product::<usize>() * dtype.bytes()) as u64;
    let total: u64 = tensors.iter().map(|(_, s, _)| size(s)).sum();

    // Shards: consecutive tensors up to max_shard_bytes (one tensor alone may exceed it).
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut in_shard = 0u64;
    for (i, (_, s, _)) in tensors.iter().enumerate() {
        let b = size(s);
        if in_shard > 0 && in_shard + b > max_shard_bytes {
            shards.push(Vec::new());
            in_shard = 0;
        }
        shards.last_mut().expect("one shard").push(i);
        in_shard += b;
    }
    let n_shards = shards.len();
    let shard_name = |k: usize| format!("model-{:05}-of-{:05}.safetensors", k + 1, n_shards);

    let mut weight_map = serde_json::Map::new();
    let mut done = 0u64;
    for (k, members) in shards.iter().enumerate() {
        let path = dir.join(shard_name(k));
        let mut header = serde_json::Map::new();
        let mut offset = 0u64;
        for &i in members {
            let (name, s, _) = &tensors[i];
            let b = size(s);
            header.insert(
                name.clone(),
                serde_json::json!({ "dtype": dtype.safetensors_name(), "shape": s, "data_offsets": [offset, offset + b] }),
            );
            offset += b;
            weight_map.insert(name.clone(), serde_json::Value::String(shard_name(k)));
        }
        let mut header = serde_json::to_vec(&serde_json::Value::Object(header))
            .map_err(|e| Error::MalformedSafetensors { path: path.clone(), what: e.to_string() })?;
        // The data starts 8-byte aligned: pad the header with spaces.
        while header.len() % 8 != 0 {
            header.push(b' ');
        }
        let file = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut w = BufWriter::with_capacity(8 << 20, file);
        let io = |e| Error::io(&path, e);
        w.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
        w.write_all(&header).map_err(io)?;
        for &i in members {
            let (_, s, norm) = &tensors[i];
            let n: usize = s.iter().product();
            let fan_in = *s.last().expect("a dimension");
            let bytes = random_values(n, fan_in, *norm, dtype, seed ^ ((i as u64 + 1) << 32));
            w.write_all(&bytes).map_err(io)?;
            done += bytes.len() as u64;
            progress(done, total);
        }
        w.flush().map_err(io)?;
    }

    let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    write_json(&dir.join("model.safetensors.index.json"), &index)?;
    write_json(&dir.join("config.json"), &config_json(shape, dtype))?;
    write_json(&dir.join("tokenizer.json"), &byte_level_tokenizer())?;
    Ok(WriteReport { tensors: tensors.len(), shards: n_shards, weight_bytes: total })
}

/// `n` values encoded in `dtype`, chunk by chunk on every core, written in
/// place into one buffer.
fn random_values(n: usize, fan_in: usize, norm: bool, dtype: CheckpointDtype, seed: u64) -> Vec<u8> {
    let scale = if norm { 0.05 } else { 1.0 / (fan_in as f32).sqrt() };
    let width = dtype.bytes();
    let mut out = vec![0u8; n * width];
    let chunks: Vec<(usize, &mut [u8])> = out.chunks_mut(CHUNK * width).enumerate().collect();
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(chunks.len()).max(1);
    let per_thread = chunks.len().div_ceil(threads).max(1);
    let mut chunks = chunks.into_iter();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let mine: Vec<(usize, &mut [u8])> = chunks.by_ref().take(per_thread).collect();
            scope.spawn(move || {
                for (c, bytes) in mine {
                    let mut rng = SeededRng::new(seed ^ (c as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    for slot in bytes.chunks_exact_mut(width) {
                        let u = rng.signed_f32() * scale;
                        // Never exactly zero: a zero weight hides a kernel that skips work.
                        let v = if norm {
                            1.0 + u
                        } else if u == 0.0 {
                            scale * 0.5
                        } else {
                            u
                        };
                        dtype.encode(v, slot);
                    }
                }
            });
        }
    });
    out
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text =
        serde_json::to_string_pretty(value).map_err(|e| Error::MalformedSafetensors { path: path.to_path_buf(), what: e.to_string() })?;
    std::fs::write(path, text).map_err(|e| Error::io(path, e))
}

fn config_json(shape: &CheckpointShape, dtype: CheckpointDtype) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden / shape.heads,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "torch_dtype": dtype.torch_name(),
        "bos_token_id": 256,
        "eos_token_id": 257,
    })
}

/// GPT-2's byte-to-character map: printable bytes stand for themselves,
/// the others for the characters from U+0100 on.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut next = 0x100u32;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("a Latin-1 character")
            } else {
                let c = char::from_u32(next).expect("a character above U+0100");
                next += 1;
                c
            }
        })
        .collect()
}

/// A byte-level BPE with no merges: 256 byte tokens, then the two specials.
fn byte_level_tokenizer() -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> =
        byte_chars().into_iter().enumerate().map(|(i, c)| (c.to_string(), serde_json::Value::from(i))).collect();
    let special = |id: usize, content: &str| serde_json::json!({ "id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true });
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(256, "<|begin_of_text|>"), special(257, "<|end_of_text|>")],
        "normalizer": null,
        "pre_tokenizer": { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true },
        // <|begin_of_text|> first, as Llama 3's tokenizer.json adds it.
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{ "SpecialToken": { "id": "<|begin_of_text|>", "type_id": 0 } }, { "Sequence": { "id": "A", "type_id": 0 } }],
            "pair": [
                { "SpecialToken": { "id": "<|begin_of_text|>", "type_id": 0 } },
                { "Sequence": { "id": "A", "type_id": 0 } },
                { "SpecialToken": { "id": "<|begin_of_text|>", "type_id": 1 } },
                { "Sequence": { "id": "B", "type_id": 1 } },
            ],
            "special_tokens": { "<|begin_of_text|>": { "id": "<|begin_of_text|>", "ids": [256], "tokens": ["<|begin_of_text|>"] } },
        },
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": [],
        },
    })
}
