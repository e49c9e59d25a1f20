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

    /// A one-layer model whose forward pass costs next to nothing (hidden
    /// 64, a 512-token vocabulary): the engine's and the server's own
    /// per-step cost, measured on any machine.
    pub const TINY: CheckpointShape = CheckpointShape {
        hidden: 64,
        intermediate: 128,
        layers: 1,
        heads: 1,
        kv_heads: 1,
        vocab: 512,
        max_positions: 4096,
        rope_theta: 10_000.0,
    };

    /// SmolLM2-135M's shape (the default model's: 9 query and 3 KV heads
    /// of 64, a 49,152-token vocabulary), with an LM head of its own.
    pub const SMOLLM2_135M: CheckpointShape = CheckpointShape {
        hidden: 576,
        intermediate: 1536,
        layers: 30,
        heads: 9,
        kv_heads: 3,
        vocab: 49_152,
        max_positions: 8192,
        rope_theta: 100_000.0,
    };

    /// Gemma 3 270M's size and vocabulary in the Llama layout (Gemma's
    /// sliding window, soft-cap and extra norms left out): hidden 640, 18
    /// layers, MLP 2048, 5 query heads and 1 KV head of 128 (Gemma's 4 of
    /// 256 do not fit the layout), a 262,144-token vocabulary and an LM
    /// head as large as Gemma's tied embedding. For what scales with the
    /// vocabulary — a decode step's LM head and its sampling — not for
    /// Gemma's attention.
    pub const GEMMA3_270M_SIZED: CheckpointShape = CheckpointShape {
        hidden: 640,
        intermediate: 2048,
        layers: 18,
        heads: 5,
        kv_heads: 1,
        vocab: 262_144,
        max_positions: 32_768,
        rope_theta: 1_000_000.0,
    };

    /// The shapes known by name: `llama3-8b`, `llama3-1b`, `smollm2-135m`,
    /// `gemma3-270m-sized`, `tiny`.
    pub fn named(name: &str) -> Option<CheckpointShape> {
        match name {
            "llama3-8b" => Some(Self::LLAMA3_8B),
            "llama3-1b" => Some(Self::LLAMA3_1B),
            "smollm2-135m" => Some(Self::SMOLLM2_135M),
            "gemma3-270m-sized" => Some(Self::GEMMA3_270M_SIZED),
            "tiny" => Some(Self::TINY),
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

/// Fills `out` chunk by chunk (`chunk_bytes` each) on every core, chunk
/// `c` from a generator seeded by `seed` and `c`: the same bytes on any
/// number of threads.
fn fill_seeded_chunks(out: &mut [u8], chunk_bytes: usize, seed: u64, fill: impl Fn(&mut SeededRng, &mut [u8]) + Sync) {
    let chunks: Vec<(usize, &mut [u8])> = out.chunks_mut(chunk_bytes).enumerate().collect();
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(chunks.len()).max(1);
    let per_thread = chunks.len().div_ceil(threads).max(1);
    let mut chunks = chunks.into_iter();
    let fill = &fill;
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let mine: Vec<(usize, &mut [u8])> = chunks.by_ref().take(per_thread).collect();
            scope.spawn(move || {
                for (c, bytes) in mine {
                    fill(&mut SeededRng::new(seed ^ (c as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)), bytes);
                }
            });
        }
    });
}

/// `n` values encoded in `dtype`, written in place into one buffer.
fn random_values(n: usize, fan_in: usize, norm: bool, dtype: CheckpointDtype, seed: u64) -> Vec<u8> {
    let scale = if norm { 0.05 } else { 1.0 / (fan_in as f32).sqrt() };
    let width = dtype.bytes();
    let mut out = vec![0u8; n * width];
    fill_seeded_chunks(&mut out, CHUNK * width, seed, |rng, bytes| {
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

/// The type a random GGUF file stores its matrices in (norms are F32, as
/// llama.cpp's converter writes them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufWeightType {
    /// Q8_0 blocks: an f16 scale and 32 int8 codes (the tensor-core issue's
    /// 8B benchmark model, 8.5 GB at Llama 3 8B's shape).
    Q8_0,
    /// Q4_1 blocks: an f16 scale, an f16 minimum and 32 4-bit codes (the
    /// default model's type).
    Q4_1,
    /// bf16 values.
    Bf16,
}

impl GgufWeightType {
    /// Parses `q8_0`, `q4_1`, `bf16`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "q8_0" => Some(Self::Q8_0),
            "q4_1" => Some(Self::Q4_1),
            "bf16" | "bfloat16" => Some(Self::Bf16),
            _ => None,
        }
    }

    /// ggml's id of the type.
    fn ggml_id(self) -> u32 {
        match self {
            Self::Q8_0 => 8,
            Self::Q4_1 => 3,
            Self::Bf16 => 30,
        }
    }

    /// Bytes of `n` values (a multiple of 32 for the blocks).
    fn bytes(self, n: usize) -> usize {
        match self {
            Self::Q8_0 => n / 32 * 34,
            Self::Q4_1 => n / 32 * 20,
            Self::Bf16 => 2 * n,
        }
    }
}

/// The GGUF names of a Llama tensor (`blk.N.attn_q.weight`, ...) for its
/// Hugging Face name.
fn gguf_name(hf: &str) -> String {
    let map = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
        ("input_layernorm.weight", "attn_norm.weight"),
        ("self_attn.q_proj.weight", "attn_q.weight"),
        ("self_attn.k_proj.weight", "attn_k.weight"),
        ("self_attn.v_proj.weight", "attn_v.weight"),
        ("self_attn.o_proj.weight", "attn_output.weight"),
        ("post_attention_layernorm.weight", "ffn_norm.weight"),
        ("mlp.gate_proj.weight", "ffn_gate.weight"),
        ("mlp.up_proj.weight", "ffn_up.weight"),
        ("mlp.down_proj.weight", "ffn_down.weight"),
    ];
    if let Some(rest) = hf.strip_prefix("model.layers.") {
        let (layer, tail) = rest.split_once('.').unwrap_or((rest, ""));
        let short = map.iter().find(|(h, _)| *h == tail).map_or(tail, |(_, g)| g);
        return format!("blk.{layer}.{short}");
    }
    map.iter().find(|(h, _)| *h == hf).map_or(hf.to_string(), |(_, g)| g.to_string())
}

/// One GGUF metadata value.
enum Meta {
    Bool(bool),
    U32(u32),
    F32(f32),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

impl Meta {
    fn write(&self, out: &mut Vec<u8>) {
        let string = |out: &mut Vec<u8>, s: &str| {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        };
        match self {
            Meta::Bool(v) => {
                out.extend(7u32.to_le_bytes());
                out.push(u8::from(*v));
            }
            Meta::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::Str(s) => {
                out.extend(8u32.to_le_bytes());
                string(out, s);
            }
            Meta::Strs(items) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for s in items {
                    string(out, s);
                }
            }
            Meta::I32s(items) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for v in items {
                    out.extend(v.to_le_bytes());
                }
            }
        }
    }
}

/// GGUF's data alignment.
const GGUF_ALIGNMENT: usize = 32;

/// Writes a random-weight Llama GGUF of `shape` to `path`, matrices in `ty`
/// (norms F32), as llama.cpp's converter lays one out (the metadata its
/// loader needs; Q and K rows in the converter's permuted order, which for
/// random values changes nothing but keeps the file's contract), with a
/// byte-level BPE tokenizer of the 256 bytes, `<|begin_of_text|>` and
/// `<|end_of_text|>`, padded with reserved control tokens to the model's
/// vocabulary so that every id below it names a token. Streamed tensor by
/// tensor; values as [`write_random_checkpoint`]'s (Q8_0: codes uniform in
/// ±127 with the scale that gives `±1/√fan_in`).
pub fn write_random_gguf(
    path: &Path,
    shape: &CheckpointShape,
    ty: GgufWeightType,
    seed: u64,
    mut progress: impl FnMut(u64, u64),
) -> Result<WriteReport> {
    shape.check()?;
    let tensors = shape.tensors();
    if let Some((name, s, _)) = tensors.iter().find(|(_, s, norm)| !norm && !s[s.len() - 1].is_multiple_of(32)) {
        return Err(Error::CheckpointShape(format!("{name}: rows of {} values are not whole blocks of 32", s[s.len() - 1])));
    }
    let stored = |s: &[usize], norm: bool| -> (u32, usize) {
        let n: usize = s.iter().product();
        if norm {
            (0, 4 * n)
        } else {
            (ty.ggml_id(), ty.bytes(n))
        }
    };
    let head_dim = shape.hidden / shape.heads;
    let mut tokens: Vec<String> = byte_chars().into_iter().map(|c| c.to_string()).collect();
    tokens.push("<|begin_of_text|>".into());
    tokens.push("<|end_of_text|>".into());
    let mut types = vec![1i32; 256];
    types.extend([3, 3]);
    for i in tokens.len()..shape.vocab {
        tokens.push(format!("<|reserved_special_token_{i}|>"));
        types.push(3);
    }
    if tokens.len() != shape.vocab {
        return Err(Error::CheckpointShape(format!("a vocabulary of {} cannot hold the 258 byte-level tokens", shape.vocab)));
    }
    let meta: Vec<(&str, Meta)> = vec![
        ("general.architecture", Meta::Str("llama".into())),
        ("general.name", Meta::Str("random".into())),
        ("general.alignment", Meta::U32(GGUF_ALIGNMENT as u32)),
        ("llama.block_count", Meta::U32(shape.layers as u32)),
        ("llama.context_length", Meta::U32(shape.max_positions as u32)),
        ("llama.embedding_length", Meta::U32(shape.hidden as u32)),
        ("llama.feed_forward_length", Meta::U32(shape.intermediate as u32)),
        ("llama.attention.head_count", Meta::U32(shape.heads as u32)),
        ("llama.attention.head_count_kv", Meta::U32(shape.kv_heads as u32)),
        ("llama.rope.dimension_count", Meta::U32(head_dim as u32)),
        ("llama.rope.freq_base", Meta::F32(shape.rope_theta as f32)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("llama.vocab_size", Meta::U32(shape.vocab as u32)),
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Meta::Str("llama-bpe".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(tokens)),
        ("tokenizer.ggml.token_type", Meta::I32s(types)),
        ("tokenizer.ggml.merges", Meta::Strs(Vec::new())),
        ("tokenizer.ggml.bos_token_id", Meta::U32(256)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(257)),
        ("tokenizer.ggml.add_bos_token", Meta::Bool(true)),
    ];
    let mut head = Vec::new();
    head.extend(b"GGUF");
    head.extend(3u32.to_le_bytes());
    head.extend((tensors.len() as u64).to_le_bytes());
    head.extend((meta.len() as u64).to_le_bytes());
    for (key, value) in &meta {
        head.extend((key.len() as u64).to_le_bytes());
        head.extend(key.as_bytes());
        value.write(&mut head);
    }
    let mut offset = 0usize;
    let mut total = 0u64;
    for (name, s, norm) in &tensors {
        let g = gguf_name(name);
        head.extend((g.len() as u64).to_le_bytes());
        head.extend(g.as_bytes());
        head.extend((s.len() as u32).to_le_bytes());
        for d in s.iter().rev() {
            head.extend((*d as u64).to_le_bytes());
        }
        let (id, bytes) = stored(s, *norm);
        head.extend(id.to_le_bytes());
        head.extend((offset as u64).to_le_bytes());
        offset = (offset + bytes).next_multiple_of(GGUF_ALIGNMENT);
        total += bytes as u64;
    }
    head.resize(head.len().next_multiple_of(GGUF_ALIGNMENT), 0);
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut w = BufWriter::with_capacity(8 << 20, file);
    let io = |e| Error::io(path, e);
    w.write_all(&head).map_err(io)?;
    let mut done = 0u64;
    for (i, (_, s, norm)) in tensors.iter().enumerate() {
        let n: usize = s.iter().product();
        let fan_in = *s.last().expect("a dimension");
        let tensor_seed = seed ^ ((i as u64 + 1) << 32);
        let bytes = match (norm, ty) {
            (true, _) => random_values(n, fan_in, true, CheckpointDtype::F32, tensor_seed),
            (false, GgufWeightType::Bf16) => random_values(n, fan_in, false, CheckpointDtype::Bf16, tensor_seed),
            (false, GgufWeightType::Q8_0) => random_q8_0(n, fan_in, tensor_seed),
            (false, GgufWeightType::Q4_1) => random_q4_1(n, fan_in, tensor_seed),
        };
        w.write_all(&bytes).map_err(io)?;
        let pad = bytes.len().next_multiple_of(GGUF_ALIGNMENT) - bytes.len();
        w.write_all(&[0u8; GGUF_ALIGNMENT][..pad]).map_err(io)?;
        done += bytes.len() as u64;
        progress(done, total);
    }
    w.flush().map_err(io)?;
    Ok(WriteReport { tensors: tensors.len(), shards: 1, weight_bytes: total })
}

/// `n` values (a multiple of 32) as Q8_0 blocks: codes uniform in ±127,
/// never all zero, scale `1/(127·√fan_in)`; chunk by chunk on every core.
fn random_q8_0(n: usize, fan_in: usize, seed: u64) -> Vec<u8> {
    let d = half::f16::from_f32(1.0 / (127.0 * (fan_in as f32).sqrt())).to_le_bytes();
    let mut out = vec![0u8; n / 32 * 34];
    fill_seeded_chunks(&mut out, CHUNK / 32 * 34, seed, |rng, bytes| {
        for block in bytes.chunks_exact_mut(34) {
            block[..2].copy_from_slice(&d);
            for eight in block[2..].chunks_exact_mut(8) {
                let r = rng.next_u64();
                for (j, b) in eight.iter_mut().enumerate() {
                    // 255 codes, -127..=127; a zero code becomes 1.
                    let code = ((r >> (8 * j)) & 0xff) as i32 % 255 - 127;
                    *b = (if code == 0 { 1 } else { code }) as i8 as u8;
                }
            }
        }
    });
    out
}

/// `n` values as Q4_1 blocks: codes uniform in 0..=15 over `±1/√fan_in`
/// (scale `2/(15·√fan_in)`, minimum `-1/√fan_in`).
fn random_q4_1(n: usize, fan_in: usize, seed: u64) -> Vec<u8> {
    let bound = 1.0 / (fan_in as f32).sqrt();
    let d = half::f16::from_f32(2.0 * bound / 15.0).to_le_bytes();
    let m = half::f16::from_f32(-bound).to_le_bytes();
    let mut out = vec![0u8; n / 32 * 20];
    fill_seeded_chunks(&mut out, CHUNK / 32 * 20, seed, |rng, bytes| {
        for block in bytes.chunks_exact_mut(20) {
            block[..2].copy_from_slice(&d);
            block[2..4].copy_from_slice(&m);
            for eight in block[4..].chunks_exact_mut(8) {
                eight.copy_from_slice(&rng.next_u64().to_le_bytes());
            }
        }
    });
    out
}

#[cfg(test)]
mod gguf_tests {
    use super::*;

    #[test]
    fn every_named_shape_is_consistent_and_unknown_names_are_none() {
        for (name, params_b) in
            [("llama3-8b", 8.03), ("llama3-1b", 1.5), ("smollm2-135m", 0.16), ("gemma3-270m-sized", 0.42), ("tiny", 0.0001)]
        {
            let shape = CheckpointShape::named(name).unwrap_or_else(|| panic!("{name} is known"));
            shape.check().unwrap_or_else(|e| panic!("{name}: {e}"));
            let b = shape.parameters() as f64 / 1e9;
            assert!((b - params_b).abs() <= params_b * 0.05 + 1e-4, "{name}: {b:.3} B parameters, expected ~{params_b}");
        }
        assert_eq!(CheckpointShape::GEMMA3_270M_SIZED.vocab, 262_144, "Gemma 3's vocabulary");
        assert!(CheckpointShape::named("gemma3-270m").is_none(), "the Llama-layout stand-in is not named as Gemma itself");
    }

    #[test]
    fn a_random_gguf_opens_with_its_shape_tokenizer_and_q8_0_blocks() {
        let shape = CheckpointShape {
            hidden: 64,
            intermediate: 96,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            vocab: 300,
            max_positions: 128,
            rope_theta: 10_000.0,
        };
        let dir = std::env::temp_dir().join(format!("vellum-random-gguf-{}", std::process::id()));
        let path = dir.join("m.gguf");
        let report = write_random_gguf(&path, &shape, GgufWeightType::Q8_0, 3, |_, _| {}).expect("writes");
        assert_eq!(report.tensors, 3 + 9 * 2);
        let weights = crate::GgufWeights::open(&path).expect("opens");
        use crate::WeightSource;
        let config = weights.model_config().expect("config");
        assert_eq!((config.hidden_size, config.num_hidden_layers, config.vocab_size), (64, 2, 300));
        let q = weights.tensor("model.layers.1.self_attn.q_proj.weight").expect("q");
        assert_eq!(q.shape, vec![64, 64]);
        let values = q.to_f32().expect("dequantizes");
        let bound = 1.0 / 8.0 + 1e-3;
        assert!(values.iter().all(|v| *v != 0.0 && v.abs() <= bound), "Q8_0 values within ±1/√64, never zero");
        let down = weights.tensor("model.layers.0.mlp.down_proj.weight").expect("down");
        assert_eq!(down.shape, vec![64, 96]);
        let norm = weights.tensor("model.norm.weight").expect("norm").to_f32().expect("f32");
        assert!(norm.iter().all(|v| (0.95..=1.05).contains(v)));
        let file = crate::gguf::GgufFile::open(&path).expect("reopens");
        assert_eq!(file.get_str("tokenizer.ggml.model").expect("model"), "gpt2");
        // Q4_1: 16 levels over ±1/√fan_in, both ends reached, as GGUF blocks.
        let report = write_random_gguf(&path, &shape, GgufWeightType::Q4_1, 3, |_, _| {}).expect("writes q4_1");
        assert_eq!(report.tensors, 3 + 9 * 2);
        let weights = crate::GgufWeights::open(&path).expect("opens");
        let q = weights.tensor("model.layers.1.self_attn.q_proj.weight").expect("q");
        assert_eq!(q.dtype, vellum_ops::quant::GgmlType::Q4_1);
        let values = q.to_f32().expect("dequantizes");
        let bound = 1.0 / 8.0 + 1e-3;
        assert!(values.iter().all(|v| v.abs() <= bound), "Q4_1 values within ±1/√64");
        let mut levels: Vec<i32> = values.iter().map(|v| ((v + 0.125) / (0.25 / 15.0)).round() as i32).collect();
        levels.sort_unstable();
        levels.dedup();
        assert_eq!(levels, (0..16).collect::<Vec<i32>>(), "every 4-bit code appears");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
