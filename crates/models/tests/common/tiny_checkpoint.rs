//! Tiny random-weight checkpoints written by the tests themselves: a GGUF
//! file (F32/F16/BF16/Q8_0 tensors, Llama Q/K stored permuted as llama.cpp's
//! converter does) and the equivalent Hugging Face directory (config.json and
//! two safetensors shards). Shared by `tests/loaders.rs` here and by the CPU
//! backend's loader test (included there with `#[path]`).
#![allow(dead_code)]

use half::{bf16, f16};
use std::path::Path;

/// Deterministic pseudo-random values in [-1, 1) (the workspace's one
/// generator).
pub struct Lcg(vellum_base::SeededRng);
impl Lcg {
    pub fn new(seed: u64) -> Self {
        Self(vellum_base::SeededRng::new(seed))
    }
    pub fn next(&mut self) -> f32 {
        self.0.signed_f32()
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        self.0.signed_vec(n)
    }
}

/// A GGUF metadata value as written: type id then payload.
pub enum Kv {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    /// Element type id and elements.
    Array(u32, Vec<Kv>),
}

impl Kv {
    pub fn type_id(&self) -> u32 {
        match self {
            Kv::U8(_) => 0,
            Kv::I8(_) => 1,
            Kv::U16(_) => 2,
            Kv::I16(_) => 3,
            Kv::U32(_) => 4,
            Kv::I32(_) => 5,
            Kv::F32(_) => 6,
            Kv::Bool(_) => 7,
            Kv::Str(_) => 8,
            Kv::Array(..) => 9,
            Kv::U64(_) => 10,
            Kv::I64(_) => 11,
            Kv::F64(_) => 12,
        }
    }
    pub fn write(&self, out: &mut Vec<u8>) {
        match self {
            Kv::U8(v) => out.push(*v),
            Kv::I8(v) => out.extend(v.to_le_bytes()),
            Kv::U16(v) => out.extend(v.to_le_bytes()),
            Kv::I16(v) => out.extend(v.to_le_bytes()),
            Kv::U32(v) => out.extend(v.to_le_bytes()),
            Kv::I32(v) => out.extend(v.to_le_bytes()),
            Kv::U64(v) => out.extend(v.to_le_bytes()),
            Kv::I64(v) => out.extend(v.to_le_bytes()),
            Kv::F32(v) => out.extend(v.to_le_bytes()),
            Kv::F64(v) => out.extend(v.to_le_bytes()),
            Kv::Bool(v) => out.push(*v as u8),
            Kv::Str(s) => write_str(out, s),
            Kv::Array(ty, items) => {
                out.extend(ty.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for item in items {
                    item.write(out);
                }
            }
        }
    }
}

pub fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

pub struct GgufTensor {
    pub name: String,
    pub ne: Vec<u64>,
    pub ggml_type: u32,
    pub data: Vec<u8>,
}

/// A minimal GGUF v3 writer.
pub struct GgufWriter {
    pub kvs: Vec<(String, Kv)>,
    pub tensors: Vec<GgufTensor>,
    pub alignment: usize,
}

/// Byte offsets of interest in a written file, for corruption tests.
pub struct Layout {
    /// Where each tensor's `offset` field is.
    pub offset_fields: Vec<usize>,
    pub data_offset: usize,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self { kvs: Vec::new(), tensors: Vec::new(), alignment: 32 }
    }
    pub fn kv(&mut self, key: &str, v: Kv) {
        self.kvs.push((key.to_string(), v));
    }
    pub fn tensor(&mut self, name: &str, ne: &[usize], ggml_type: u32, data: Vec<u8>) {
        self.tensors.push(GgufTensor { name: name.into(), ne: ne.iter().map(|&d| d as u64).collect(), ggml_type, data });
    }
    pub fn build(&self) -> (Vec<u8>, Layout) {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            write_str(&mut out, k);
            out.extend(v.type_id().to_le_bytes());
            v.write(&mut out);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        let mut offset_fields = Vec::new();
        for t in &self.tensors {
            write_str(&mut out, &t.name);
            out.extend((t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ggml_type.to_le_bytes());
            offset_fields.push(out.len());
            out.extend((offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len()).next_multiple_of(self.alignment);
        }
        let data_offset = out.len().next_multiple_of(self.alignment);
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize(data_offset + off, 0);
            out.extend(&t.data);
        }
        (out, Layout { offset_fields, data_offset })
    }
}

/// ggml's Q8_0 quantization of a row-major tensor (rows a multiple of 32 long).
pub fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for block in x.chunks(32) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|v| (v * id).round() as i8 as u8));
    }
    out
}

pub fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn f16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect()
}

pub fn bf16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect()
}

/// llama.cpp's `permute`: `w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2).reshape(out, in)`.
pub fn llama_cpp_permute(w: &[f32], n_rows: usize, row_len: usize, n_head: usize) -> Vec<f32> {
    let hd = n_rows / n_head;
    let mut out = Vec::with_capacity(w.len());
    for h in 0..n_head {
        for j in 0..hd / 2 {
            for t in 0..2 {
                let src = h * hd + t * hd / 2 + j;
                out.extend_from_slice(&w[src * row_len..(src + 1) * row_len]);
            }
        }
    }
    out
}

pub const HIDDEN: usize = 64;
pub const N_HEAD: usize = 4;
pub const N_KV_HEAD: usize = 2;
pub const HEAD_DIM: usize = 16;
pub const FFN: usize = 96;
pub const N_LAYER: usize = 2;
pub const VOCAB: usize = 32;

/// The tiny model's dimensions (the constants above by default; the CUDA
/// suite uses a head size its paged kernels take, 64).
#[derive(Clone, Copy, Debug)]
pub struct TinyShape {
    pub hidden: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub n_layer: usize,
    pub vocab: usize,
}

pub const TINY: TinyShape =
    TinyShape { hidden: HIDDEN, n_head: N_HEAD, n_kv_head: N_KV_HEAD, head_dim: HEAD_DIM, ffn: FFN, n_layer: N_LAYER, vocab: VOCAB };

/// How a tensor is stored in the tiny GGUF.
#[derive(Clone, Copy, PartialEq)]
pub enum Stored {
    F32,
    F16,
    BF16,
    Q8_0,
}

pub struct TinyTensor {
    pub hf: String,
    pub gguf: String,
    pub shape: Vec<usize>,
    pub stored: Stored,
    /// Rows permuted by llama.cpp's converter: `Some(n_head)`.
    pub permute_heads: Option<usize>,
    pub values: Vec<f32>,
}

/// The tiny model's tensors in HF layout (values exactly representable
/// in their stored type where it is F16 or BF16).
pub fn tiny_tensors() -> Vec<TinyTensor> {
    tiny_tensors_of(TINY)
}

/// [`tiny_tensors`] of any shape.
pub fn tiny_tensors_of(shape: TinyShape) -> Vec<TinyTensor> {
    let mut rng = Lcg::new(7);
    let mut ts = Vec::new();
    let mut add = |hf: String, gguf: String, shape: Vec<usize>, stored: Stored, permute_heads: Option<usize>| {
        let mut values = rng.vec(shape.iter().product());
        match stored {
            Stored::F16 => values = values.iter().map(|v| f16::from_f32(*v).to_f32()).collect(),
            Stored::BF16 => values = values.iter().map(|v| bf16::from_f32(*v).to_f32()).collect(),
            _ => {}
        }
        ts.push(TinyTensor { hf, gguf, shape, stored, permute_heads, values });
    };
    add("model.embed_tokens.weight".into(), "token_embd.weight".into(), vec![shape.vocab, shape.hidden], Stored::Q8_0, None);
    for i in 0..shape.n_layer {
        let l = |s: &str| format!("model.layers.{i}.{s}");
        let b = |s: &str| format!("blk.{i}.{s}");
        let (q_type, k_type) = if i == 0 { (Stored::Q8_0, Stored::F32) } else { (Stored::F32, Stored::Q8_0) };
        add(l("input_layernorm.weight"), b("attn_norm.weight"), vec![shape.hidden], Stored::F32, None);
        add(
            l("self_attn.q_proj.weight"),
            b("attn_q.weight"),
            vec![shape.n_head * shape.head_dim, shape.hidden],
            q_type,
            Some(shape.n_head),
        );
        add(
            l("self_attn.k_proj.weight"),
            b("attn_k.weight"),
            vec![shape.n_kv_head * shape.head_dim, shape.hidden],
            k_type,
            Some(shape.n_kv_head),
        );
        add(l("self_attn.v_proj.weight"), b("attn_v.weight"), vec![shape.n_kv_head * shape.head_dim, shape.hidden], Stored::Q8_0, None);
        add(l("self_attn.q_proj.bias"), b("attn_q.bias"), vec![shape.n_head * shape.head_dim], Stored::F32, Some(shape.n_head));
        add(l("self_attn.k_proj.bias"), b("attn_k.bias"), vec![shape.n_kv_head * shape.head_dim], Stored::F32, Some(shape.n_kv_head));
        add(l("self_attn.v_proj.bias"), b("attn_v.bias"), vec![shape.n_kv_head * shape.head_dim], Stored::F32, None);
        add(l("self_attn.o_proj.weight"), b("attn_output.weight"), vec![shape.hidden, shape.n_head * shape.head_dim], Stored::F32, None);
        add(l("post_attention_layernorm.weight"), b("ffn_norm.weight"), vec![shape.hidden], Stored::F16, None);
        add(l("mlp.gate_proj.weight"), b("ffn_gate.weight"), vec![shape.ffn, shape.hidden], Stored::Q8_0, None);
        add(l("mlp.up_proj.weight"), b("ffn_up.weight"), vec![shape.ffn, shape.hidden], Stored::F32, None);
        add(l("mlp.down_proj.weight"), b("ffn_down.weight"), vec![shape.hidden, shape.ffn], Stored::Q8_0, None);
    }
    add("model.norm.weight".into(), "output_norm.weight".into(), vec![shape.hidden], Stored::BF16, None);
    add("lm_head.weight".into(), "output.weight".into(), vec![shape.vocab, shape.hidden], Stored::F32, None);
    ts
}

pub fn tiny_gguf_writer(tensors: &[TinyTensor]) -> GgufWriter {
    tiny_gguf_writer_of(TINY, tensors)
}

/// [`tiny_gguf_writer`] of any shape.
pub fn tiny_gguf_writer_of(shape: TinyShape, tensors: &[TinyTensor]) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.kv("general.architecture", Kv::Str("llama".into()));
    w.kv("llama.block_count", Kv::U32(shape.n_layer as u32));
    w.kv("llama.context_length", Kv::U32(256));
    w.kv("llama.embedding_length", Kv::U32(shape.hidden as u32));
    w.kv("llama.feed_forward_length", Kv::U32(shape.ffn as u32));
    w.kv("llama.attention.head_count", Kv::U32(shape.n_head as u32));
    w.kv("llama.attention.head_count_kv", Kv::U32(shape.n_kv_head as u32));
    w.kv("llama.rope.freq_base", Kv::F32(10000.0));
    w.kv("llama.attention.layer_norm_rms_epsilon", Kv::F32(1e-5));
    w.kv("tokenizer.ggml.tokens", Kv::Array(8, (0..shape.vocab).map(|i| Kv::Str(format!("t{i}"))).collect()));
    w.kv("tokenizer.ggml.bos_token_id", Kv::U32(1));
    w.kv("tokenizer.ggml.eos_token_id", Kv::U32(2));
    // The remaining value types, to check the reader parses them all.
    w.kv("test.u8", Kv::U8(200));
    w.kv("test.i8", Kv::I8(-100));
    w.kv("test.u16", Kv::U16(60000));
    w.kv("test.i16", Kv::I16(-30000));
    w.kv("test.i32", Kv::I32(-7));
    w.kv("test.u64", Kv::U64(1 << 40));
    w.kv("test.i64", Kv::I64(-(1 << 40)));
    w.kv("test.f64", Kv::F64(0.125));
    w.kv("test.bool", Kv::Bool(true));
    w.kv("test.nested", Kv::Array(9, vec![Kv::Array(4, vec![Kv::U32(1), Kv::U32(2)]), Kv::Array(4, vec![])]));
    for t in tensors {
        let stored_values = match t.permute_heads {
            Some(n_head) => llama_cpp_permute(&t.values, t.shape[0], t.shape.get(1).copied().unwrap_or(1), n_head),
            None => t.values.clone(),
        };
        let (ty, data) = match t.stored {
            Stored::F32 => (0, f32_bytes(&stored_values)),
            Stored::F16 => (1, f16_bytes(&stored_values)),
            Stored::BF16 => (30, bf16_bytes(&stored_values)),
            Stored::Q8_0 => (8, quantize_q8_0(&stored_values)),
        };
        let ne: Vec<usize> = t.shape.iter().rev().copied().collect();
        w.tensor(&t.gguf, &ne, ty, data);
    }
    w
}

pub const TINY_CONFIG_JSON: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false, "attention_bias": true,
  "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"
}"#;

/// Writes the tiny model as an HF directory: F32 safetensors (F16 or BF16
/// where the GGUF stores those), in two shards with an index.
pub fn write_tiny_hf_dir(dir: &Path, tensors: &[TinyTensor]) {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    std::fs::write(dir.join("config.json"), TINY_CONFIG_JSON).unwrap();
    let bytes: Vec<(Dtype, Vec<u8>)> = tensors
        .iter()
        .map(|t| match t.stored {
            Stored::F16 => (Dtype::F16, f16_bytes(&t.values)),
            Stored::BF16 => (Dtype::BF16, bf16_bytes(&t.values)),
            _ => (Dtype::F32, f32_bytes(&t.values)),
        })
        .collect();
    let mut weight_map = serde_json::Map::new();
    let half = tensors.len() / 2;
    for (shard, range) in [(1, 0..half), (2, half..tensors.len())] {
        let file = format!("model-0000{shard}-of-00002.safetensors");
        let views: Vec<(String, TensorView<'_>)> = range
            .map(|i| {
                weight_map.insert(tensors[i].hf.clone(), file.clone().into());
                (tensors[i].hf.clone(), TensorView::new(bytes[i].0, tensors[i].shape.clone(), &bytes[i].1).unwrap())
            })
            .collect();
        std::fs::write(dir.join(&file), safetensors::serialize(views, None).unwrap()).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}
