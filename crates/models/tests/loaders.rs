//! Integration tests: the real default model (fetched once into the cache),
//! tiny checkpoints written here in both formats, and malformed files.

use half::{bf16, f16};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use vellum_models::gguf::{GgmlType, GgufFile, MetadataValue};
use vellum_models::{
    fetch_default_model, resolve_model, ChatMessage, ChatTemplate, Error, GgufWeights, ModelSource,
    SafetensorsWeights, Tokenizer, WeightSource,
};

// ---------------------------------------------------------------- helpers

fn golden_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden/smollm2-135m-instruct-q4_1.json")
}

/// The default model, fetched at most once per test binary.
fn model_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| fetch_default_model().unwrap_or_else(|e| panic!("fetching the default model: {e}")))
}

fn real_model() -> &'static GgufWeights {
    static MODEL: OnceLock<GgufWeights> = OnceLock::new();
    MODEL.get_or_init(|| GgufWeights::open(model_path()).expect("open default model"))
}

/// A fresh, empty scratch directory for one test.
fn scratch_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vellum-models-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

struct Golden {
    prompt: String,
    prompt_ids: Vec<u32>,
}

fn golden() -> Vec<Golden> {
    let text = std::fs::read_to_string(golden_path()).expect("golden file (shared/ beside the repo)");
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json.as_array()
        .unwrap()
        .iter()
        .map(|r| Golden {
            prompt: r["prompt"].as_str().unwrap().to_string(),
            prompt_ids: r["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect(),
        })
        .collect()
}

/// Deterministic pseudo-random values in [-1, 1).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

// ------------------------------------------------------ the real model

#[test]
fn golden_prompts_tokenize_exactly_and_round_trip() {
    let tokenizer = Tokenizer::from_gguf(real_model().gguf()).unwrap();
    let cases = golden();
    assert_eq!(cases.len(), 9);
    for case in &cases {
        let ids = tokenizer.encode(&case.prompt, true).unwrap();
        assert_eq!(ids, case.prompt_ids, "prompt {:?}", case.prompt);
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), case.prompt);
    }
    assert_eq!(tokenizer.bos_token_id(), Some(1));
    assert_eq!(tokenizer.eos_token_ids(), &[2]);
    assert_eq!(tokenizer.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tokenizer.token_to_piece(1).as_deref(), Some("<|im_start|>"));
    assert_eq!(tokenizer.vocab_size(), 49152);
    assert_eq!(tokenizer.decode(&[1, 504, 2], true).unwrap(), "The");
}

#[test]
fn hf_tokenizer_json_matches_gguf_tokenizer() {
    let from_gguf = Tokenizer::from_gguf(real_model().gguf()).unwrap();
    let dir = scratch_dir("tokenizer-json");
    std::fs::write(dir.join("tokenizer.json"), from_gguf.inner().to_string(false).unwrap()).unwrap();
    std::fs::write(dir.join("config.json"), r#"{"bos_token_id": 1, "eos_token_id": 2}"#).unwrap();
    let from_json = Tokenizer::from_hf_dir(&dir).unwrap();
    for case in golden() {
        assert_eq!(from_json.encode(&case.prompt, true).unwrap(), case.prompt_ids);
    }
    assert_eq!((from_json.bos_token_id(), from_json.eos_token_ids()), (Some(1), &[2u32][..]));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn real_gguf_config_is_smollm2() {
    let c = real_model().model_config().unwrap();
    assert_eq!(c.architecture, "LlamaForCausalLM");
    assert_eq!(c.num_hidden_layers, 30);
    assert_eq!(c.hidden_size, 576);
    assert_eq!(c.intermediate_size, 1536);
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (9, 3, 64));
    assert_eq!(c.vocab_size, 49152);
    assert_eq!(c.rope_theta, 100000.0);
    assert_eq!(c.max_position_embeddings, 8192);
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-9);
    assert!(c.tie_word_embeddings && !c.attention_bias && !c.qk_norm);
    assert_eq!((c.bos_token_id, c.eos_token_ids.clone()), (Some(1), vec![2]));
}

#[test]
fn real_gguf_tensors_have_hf_names_and_shapes() {
    let w = real_model();
    let names = w.tensor_names();
    assert_eq!(names.len(), 272);
    assert!(!w.contains("lm_head.weight"));
    let embed = w.tensor_f32_shaped("model.embed_tokens.weight", &[49152, 576]).unwrap();
    assert!(embed.data.iter().all(|x| x.is_finite()));
    let q = w.tensor_f32_shaped("model.layers.0.self_attn.q_proj.weight", &[576, 576]).unwrap();
    let k = w.tensor_f32_shaped("model.layers.29.self_attn.k_proj.weight", &[192, 576]).unwrap();
    assert!(q.data.iter().chain(&k.data).all(|x| x.is_finite()));
    w.tensor_f32_shaped("model.layers.3.mlp.down_proj.weight", &[576, 1536]).unwrap();
    w.tensor_f32_shaped("model.norm.weight", &[576]).unwrap();
    assert!(matches!(
        w.tensor_f32_shaped("model.norm.weight", &[577]),
        Err(Error::ShapeMismatch { tensor, .. }) if tensor == "model.norm.weight"
    ));
    assert!(matches!(w.tensor_f32("lm_head.weight"), Err(Error::MissingTensor { .. })));

    // Quantized blocks, rows in HF order, dequantize to the same values.
    let qq = w.tensor_quantized("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!((qq.ggml_type, qq.shape.clone()), (GgmlType::Q4_1, vec![576, 576]));
    assert_eq!(vellum_models::gguf::dequantize(qq.ggml_type, &qq.data, 576 * 576).unwrap(), q.data);
    let e = w.tensor_quantized("model.embed_tokens.weight").unwrap();
    assert_eq!(e.ggml_type, GgmlType::Q8_0);
}

/// Expected values computed independently with the `gguf` Python package
/// (`gguf.quants.dequantize`, float64 sums), and for K its rows un-permuted
/// with numpy (`reshape(n_kv, 2, hd/2, in)` inverse of llama.cpp's permute).
// The literals are gguf-py's values printed in full; each is an exact f32.
#[allow(clippy::excessive_precision)]
#[test]
fn real_gguf_dequantizes_like_gguf_py() {
    let w = real_model();
    let cases: [(&str, f64, f64, [f32; 5]); 4] = [
        ("model.embed_tokens.weight", -15353.04449415207, 2802153.619805813,
         [-0.10654449462890625, 0.032978057861328125, 0.08371353149414062, -0.15135955810546875, -0.0417022705078125]),
        ("model.layers.29.mlp.down_proj.weight", 49.83570861816406, 126250.91435241699,
         [-0.2733154296875, 0.186279296875, 0.04840087890625, -0.016998291015625, 0.056640625]),
        ("model.norm.weight", 1038.33203125, 1045.09765625, [1.7578125, 1.8203125, -1.2578125, 1.765625, 1.984375]),
        // Q rows are permuted, but the first and last rows and the sums are not affected.
        ("model.layers.0.self_attn.q_proj.weight", 59.22322082519531, 63395.39872741699,
         [-0.0963134765625, 0.1573486328125, 0.2841796875, 0.3294677734375, -0.255859375]),
    ];
    for (name, sum, abs_sum, samples) in cases {
        let t = w.tensor_f32(name).unwrap();
        let s: f64 = t.data.iter().map(|&x| f64::from(x)).sum();
        let a: f64 = t.data.iter().map(|&x| f64::from(x).abs()).sum();
        assert!((s - sum).abs() < 1e-6 * abs_sum && (a - abs_sum).abs() < 1e-9 * abs_sum, "{name}: {s} {a}");
        let n = t.data.len();
        for (i, expected) in [0, 1, 17, 33, n - 1].into_iter().zip(samples) {
            assert_eq!(t.data[i], expected, "{name}[{i}]");
        }
    }
    let k = w.tensor_f32("model.layers.7.self_attn.k_proj.weight").unwrap();
    let col5: Vec<f32> = [0, 1, 32, 33, 64, 191].iter().map(|r| k.data[r * 576 + 5]).collect();
    assert_eq!(col5, [-0.218719482421875, -0.193878173828125, -0.35546875, 0.1446533203125, 0.05792236328125, -0.46044921875]);
}

#[test]
fn real_chat_template_renders_the_golden_chat_prompt() {
    let t = ChatTemplate::from_gguf(real_model().gguf()).unwrap().expect("the file has a chat template");
    let hi = t.render(&[ChatMessage::new("user", "Hi")], true).unwrap();
    assert_eq!(
        hi,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let chat = t.render(&[ChatMessage::new("user", "What is the boiling point of water in Celsius?")], true).unwrap();
    assert_eq!(chat, golden()[6].prompt);
    let with_system = t.render(&[ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")], false).unwrap();
    assert_eq!(with_system, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

#[test]
fn resolve_and_load_the_default_model() {
    let expected = model_path();
    let source = resolve_model(None).unwrap();
    assert_eq!(source, ModelSource::Gguf(expected.to_path_buf()));
    assert_eq!(resolve_model(model_path().to_str()).unwrap(), source);
    let loaded = source.load().unwrap();
    assert_eq!(loaded.config.num_hidden_layers, 30);
    assert!(loaded.chat_template.is_some());
    assert_eq!(loaded.tokenizer.encode("The capital of France is", false).unwrap(), golden()[0].prompt_ids);
    assert!(loaded.weights.contains("model.layers.29.mlp.up_proj.weight"));
}

// --------------------------------------------- tiny checkpoints, written here

/// A GGUF metadata value as written: type id then payload.
enum Kv {
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
    fn type_id(&self) -> u32 {
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
    fn write(&self, out: &mut Vec<u8>) {
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

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

struct GgufTensor {
    name: String,
    ne: Vec<u64>,
    ggml_type: u32,
    data: Vec<u8>,
}

/// A minimal GGUF v3 writer.
struct GgufWriter {
    kvs: Vec<(String, Kv)>,
    tensors: Vec<GgufTensor>,
    alignment: usize,
}

/// Byte offsets of interest in a written file, for corruption tests.
struct Layout {
    /// Where each tensor's `offset` field is.
    offset_fields: Vec<usize>,
    data_offset: usize,
}

impl GgufWriter {
    fn new() -> Self {
        Self { kvs: Vec::new(), tensors: Vec::new(), alignment: 32 }
    }
    fn kv(&mut self, key: &str, v: Kv) {
        self.kvs.push((key.to_string(), v));
    }
    fn tensor(&mut self, name: &str, ne: &[usize], ggml_type: u32, data: Vec<u8>) {
        self.tensors.push(GgufTensor { name: name.into(), ne: ne.iter().map(|&d| d as u64).collect(), ggml_type, data });
    }
    fn build(&self) -> (Vec<u8>, Layout) {
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
fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
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

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect()
}

fn bf16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect()
}

/// llama.cpp's `permute`: `w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2).reshape(out, in)`.
fn llama_cpp_permute(w: &[f32], n_rows: usize, row_len: usize, n_head: usize) -> Vec<f32> {
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

const HIDDEN: usize = 64;
const N_HEAD: usize = 4;
const N_KV_HEAD: usize = 2;
const HEAD_DIM: usize = 16;
const FFN: usize = 96;
const N_LAYER: usize = 2;
const VOCAB: usize = 32;

/// How a tensor is stored in the tiny GGUF.
#[derive(Clone, Copy, PartialEq)]
enum Stored {
    F32,
    F16,
    BF16,
    Q8_0,
}

struct TinyTensor {
    hf: String,
    gguf: String,
    shape: Vec<usize>,
    stored: Stored,
    /// Rows permuted by llama.cpp's converter: `Some(n_head)`.
    permute_heads: Option<usize>,
    values: Vec<f32>,
}

/// The tiny model's tensors in HF layout (values exactly representable
/// in their stored type where it is F16 or BF16).
fn tiny_tensors() -> Vec<TinyTensor> {
    let mut rng = Lcg(7);
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
    add("model.embed_tokens.weight".into(), "token_embd.weight".into(), vec![VOCAB, HIDDEN], Stored::Q8_0, None);
    for i in 0..N_LAYER {
        let l = |s: &str| format!("model.layers.{i}.{s}");
        let b = |s: &str| format!("blk.{i}.{s}");
        let (q_type, k_type) = if i == 0 { (Stored::Q8_0, Stored::F32) } else { (Stored::F32, Stored::Q8_0) };
        add(l("input_layernorm.weight"), b("attn_norm.weight"), vec![HIDDEN], Stored::F32, None);
        add(l("self_attn.q_proj.weight"), b("attn_q.weight"), vec![N_HEAD * HEAD_DIM, HIDDEN], q_type, Some(N_HEAD));
        add(l("self_attn.k_proj.weight"), b("attn_k.weight"), vec![N_KV_HEAD * HEAD_DIM, HIDDEN], k_type, Some(N_KV_HEAD));
        add(l("self_attn.v_proj.weight"), b("attn_v.weight"), vec![N_KV_HEAD * HEAD_DIM, HIDDEN], Stored::Q8_0, None);
        add(l("self_attn.q_proj.bias"), b("attn_q.bias"), vec![N_HEAD * HEAD_DIM], Stored::F32, Some(N_HEAD));
        add(l("self_attn.k_proj.bias"), b("attn_k.bias"), vec![N_KV_HEAD * HEAD_DIM], Stored::F32, Some(N_KV_HEAD));
        add(l("self_attn.v_proj.bias"), b("attn_v.bias"), vec![N_KV_HEAD * HEAD_DIM], Stored::F32, None);
        add(l("self_attn.o_proj.weight"), b("attn_output.weight"), vec![HIDDEN, N_HEAD * HEAD_DIM], Stored::F32, None);
        add(l("post_attention_layernorm.weight"), b("ffn_norm.weight"), vec![HIDDEN], Stored::F16, None);
        add(l("mlp.gate_proj.weight"), b("ffn_gate.weight"), vec![FFN, HIDDEN], Stored::Q8_0, None);
        add(l("mlp.up_proj.weight"), b("ffn_up.weight"), vec![FFN, HIDDEN], Stored::F32, None);
        add(l("mlp.down_proj.weight"), b("ffn_down.weight"), vec![HIDDEN, FFN], Stored::Q8_0, None);
    }
    add("model.norm.weight".into(), "output_norm.weight".into(), vec![HIDDEN], Stored::BF16, None);
    add("lm_head.weight".into(), "output.weight".into(), vec![VOCAB, HIDDEN], Stored::F32, None);
    ts
}

fn tiny_gguf_writer(tensors: &[TinyTensor]) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.kv("general.architecture", Kv::Str("llama".into()));
    w.kv("llama.block_count", Kv::U32(N_LAYER as u32));
    w.kv("llama.context_length", Kv::U32(256));
    w.kv("llama.embedding_length", Kv::U32(HIDDEN as u32));
    w.kv("llama.feed_forward_length", Kv::U32(FFN as u32));
    w.kv("llama.attention.head_count", Kv::U32(N_HEAD as u32));
    w.kv("llama.attention.head_count_kv", Kv::U32(N_KV_HEAD as u32));
    w.kv("llama.rope.freq_base", Kv::F32(10000.0));
    w.kv("llama.attention.layer_norm_rms_epsilon", Kv::F32(1e-5));
    w.kv("tokenizer.ggml.tokens", Kv::Array(8, (0..VOCAB).map(|i| Kv::Str(format!("t{i}"))).collect()));
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

const TINY_CONFIG_JSON: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": false, "attention_bias": true,
  "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"
}"#;

/// Writes the tiny model as an HF directory: F32 safetensors (F16 or BF16
/// where the GGUF stores those), in two shards with an index.
fn write_tiny_hf_dir(dir: &Path, tensors: &[TinyTensor]) {
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

#[test]
fn tiny_gguf_and_safetensors_agree() {
    let dir = scratch_dir("tiny-agree");
    let tensors = tiny_tensors();
    let gguf_path = dir.join("tiny.gguf");
    std::fs::write(&gguf_path, tiny_gguf_writer(&tensors).build().0).unwrap();
    let hf_dir = dir.join("hf");
    std::fs::create_dir_all(&hf_dir).unwrap();
    write_tiny_hf_dir(&hf_dir, &tensors);

    let g = GgufWeights::open(&gguf_path).unwrap();
    let s = SafetensorsWeights::open(&hf_dir).unwrap();
    assert_eq!(g.model_config().unwrap(), s.model_config().unwrap());
    assert!(g.model_config().unwrap().attention_bias);
    assert_eq!(g.tensor_names(), s.tensor_names());
    assert_eq!(g.tensor_names().len(), tensors.len());
    for t in &tensors {
        let a = g.tensor_f32(&t.hf).unwrap();
        let b = s.tensor_f32(&t.hf).unwrap();
        assert_eq!(a.shape, t.shape, "{}", t.hf);
        assert_eq!(b.shape, t.shape, "{}", t.hf);
        assert_eq!(b.data, t.values, "{}: safetensors returns what was written", t.hf);
        // Q8_0: error at most half a step (d = amax/127 <= 1/127) plus f16 rounding of d.
        let tol = if t.stored == Stored::Q8_0 { 0.5 / 127.0 + 1e-3 } else { 0.0 };
        for (i, (x, y)) in a.data.iter().zip(&b.data).enumerate() {
            assert!((x - y).abs() <= tol, "{}[{i}]: gguf {x} vs safetensors {y}", t.hf);
        }
        // Raw blocks, rows in HF order, dequantize to the same values.
        let q = g.tensor_quantized(&t.hf).unwrap();
        assert_eq!(vellum_models::gguf::dequantize(q.ggml_type, &q.data, a.n_elements()).unwrap(), a.data);
    }

    // Every metadata value type parsed back.
    let f = g.gguf();
    assert_eq!(f.get("test.u8"), Some(&MetadataValue::U8(200)));
    assert_eq!(f.get("test.i8"), Some(&MetadataValue::I8(-100)));
    assert_eq!(f.get("test.u16"), Some(&MetadataValue::U16(60000)));
    assert_eq!(f.get("test.i16"), Some(&MetadataValue::I16(-30000)));
    assert_eq!(f.get("test.i32"), Some(&MetadataValue::I32(-7)));
    assert_eq!(f.get("test.u64"), Some(&MetadataValue::U64(1 << 40)));
    assert_eq!(f.get("test.i64"), Some(&MetadataValue::I64(-(1 << 40))));
    assert_eq!(f.get("test.f64"), Some(&MetadataValue::F64(0.125)));
    assert_eq!(f.get("test.bool"), Some(&MetadataValue::Bool(true)));
    assert_eq!(
        f.get("test.nested"),
        Some(&MetadataValue::Array(vec![
            MetadataValue::Array(vec![MetadataValue::U32(1), MetadataValue::U32(2)]),
            MetadataValue::Array(vec![])
        ]))
    );
    assert_eq!((f.version(), f.alignment(), f.data_offset() % 32), (3, 32, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Interleaved-pair RoPE on GGUF rows and rotate_half RoPE on the
/// un-permuted rows give the same attention scores: the un-permutation is
/// what makes one model definition serve both loaders.
#[test]
fn unpermuted_qk_with_rotate_half_equals_gguf_layout_with_interleaved_rope() {
    let (n_head, hd, d_in) = (2, 8, 5);
    let mut rng = Lcg(3);
    let wq = rng.vec(n_head * hd * d_in);
    let wk = rng.vec(n_head * hd * d_in);
    let (x, y) = (rng.vec(d_in), rng.vec(d_in));
    let matvec = |w: &[f32], v: &[f32]| -> Vec<f32> { w.chunks(d_in).map(|r| r.iter().zip(v).map(|(a, b)| a * b).sum()).collect() };
    let angle = |pos: f32, j: usize| pos * 10000f32.powf(-((2 * j) as f32) / hd as f32);
    let rope_interleaved = |v: &mut [f32], pos: f32| {
        for head in v.chunks_mut(hd) {
            for j in 0..hd / 2 {
                let (c, s) = (angle(pos, j).cos(), angle(pos, j).sin());
                let (a, b) = (head[2 * j], head[2 * j + 1]);
                head[2 * j] = a * c - b * s;
                head[2 * j + 1] = a * s + b * c;
            }
        }
    };
    let rope_half = |v: &mut [f32], pos: f32| {
        for head in v.chunks_mut(hd) {
            for j in 0..hd / 2 {
                let (c, s) = (angle(pos, j).cos(), angle(pos, j).sin());
                let (a, b) = (head[j], head[j + hd / 2]);
                head[j] = a * c - b * s;
                head[j + hd / 2] = a * s + b * c;
            }
        }
    };
    let scores = |q: &[f32], k: &[f32]| -> Vec<f32> {
        q.chunks(hd).zip(k.chunks(hd)).map(|(a, b)| a.iter().zip(b).map(|(x, y)| x * y).sum()).collect()
    };
    // GGUF side: permuted weights, interleaved RoPE.
    let (wq_g, wk_g) = (llama_cpp_permute(&wq, n_head * hd, d_in, n_head), llama_cpp_permute(&wk, n_head * hd, d_in, n_head));
    let (mut qg, mut kg) = (matvec(&wq_g, &x), matvec(&wk_g, &y));
    rope_interleaved(&mut qg, 5.0);
    rope_interleaved(&mut kg, 2.0);
    // HF side: un-permuted weights, rotate_half RoPE.
    let wq_h = vellum_models::unpermute_rows(&wq_g, d_in, n_head, "q").unwrap();
    let wk_h = vellum_models::unpermute_rows(&wk_g, d_in, n_head, "k").unwrap();
    assert_eq!((&wq_h, &wk_h), (&wq, &wk));
    let (mut qh, mut kh) = (matvec(&wq_h, &x), matvec(&wk_h, &y));
    rope_half(&mut qh, 5.0);
    rope_half(&mut kh, 2.0);
    for (a, b) in scores(&qg, &kg).iter().zip(scores(&qh, &kh)) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
}

#[test]
fn safetensors_errors_are_typed() {
    let dir = scratch_dir("st-errors");
    let tensors = tiny_tensors();
    write_tiny_hf_dir(&dir, &tensors);
    let s = SafetensorsWeights::open(&dir).unwrap();
    match s.tensor_f32("model.layers.9.mlp.up_proj.weight") {
        Err(Error::MissingTensor { tensor, path }) => {
            assert_eq!(tensor, "model.layers.9.mlp.up_proj.weight");
            assert_eq!(path, dir);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(s.tensor_f32_shaped("model.norm.weight", &[65]), Err(Error::ShapeMismatch { .. })));
    // A truncated shard.
    let shard = dir.join("model-00001-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 10]).unwrap();
    assert!(matches!(SafetensorsWeights::open(&dir), Err(Error::MalformedSafetensors { .. })));
    // An unsupported dtype.
    use safetensors::tensor::TensorView;
    let data = [0u8; 8];
    let view = TensorView::new(safetensors::Dtype::I32, vec![2], &data).unwrap();
    std::fs::write(&shard, safetensors::serialize([("model.norm.weight", view)], None).unwrap()).unwrap();
    std::fs::write(dir.join("model.safetensors.index.json"), r#"{"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}"#).unwrap();
    let s = SafetensorsWeights::open(&dir).unwrap();
    assert!(matches!(s.tensor_f32("model.norm.weight"), Err(Error::UnsupportedTensorType { dtype, .. }) if dtype == "I32"));
    let _ = std::fs::remove_dir_all(&dir);
}

// --------------------------------------------------------- malformed GGUF

fn open_bytes(dir: &Path, name: &str, bytes: &[u8]) -> vellum_models::Result<GgufFile> {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    GgufFile::open(&path)
}

#[test]
fn malformed_gguf_gives_typed_errors() {
    let dir = scratch_dir("malformed");
    let (good, layout) = tiny_gguf_writer(&tiny_tensors()).build();
    open_bytes(&dir, "good.gguf", &good).unwrap();

    // Truncated anywhere: every cut through the header and tensor table, and some in the data.
    let cuts = (0..layout.data_offset + 64).chain((layout.data_offset..good.len()).step_by(997));
    for cut in cuts {
        match open_bytes(&dir, "cut.gguf", &good[..cut]) {
            Err(Error::MalformedGguf { what, .. }) => assert!(!what.is_empty()),
            other => panic!("cut at {cut}: expected MalformedGguf, got {other:?}"),
        }
    }

    let mut bad_magic = good.clone();
    bad_magic[..4].copy_from_slice(b"GGUX");
    assert!(matches!(open_bytes(&dir, "magic.gguf", &bad_magic), Err(Error::MalformedGguf { what, .. }) if what.contains("magic")));

    let mut past_eof = good.clone();
    let field = layout.offset_fields[3];
    past_eof[field..field + 8].copy_from_slice(&(good.len() as u64).next_multiple_of(32).to_le_bytes());
    assert!(matches!(open_bytes(&dir, "eof.gguf", &past_eof), Err(Error::MalformedGguf { what, .. }) if what.contains("past the end")));

    let mut huge = good.clone();
    huge[field..field + 8].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    assert!(matches!(open_bytes(&dir, "huge.gguf", &huge), Err(Error::MalformedGguf { .. })));

    let mut huge_count = good.clone();
    huge_count[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(open_bytes(&dir, "count.gguf", &huge_count), Err(Error::MalformedGguf { .. })));

    // Random byte corruption never panics.
    let mut rng = Lcg(11);
    for _ in 0..300 {
        let mut bytes = good.clone();
        for _ in 0..4 {
            let at = ((rng.next() + 1.0) / 2.0 * layout.data_offset as f32) as usize % layout.data_offset;
            bytes[at] = (rng.next() * 127.0) as i8 as u8;
        }
        let _ = open_bytes(&dir, "fuzz.gguf", &bytes).map(|f| {
            for t in f.tensors() {
                let _ = f.tensor_f32(&t.name);
            }
        });
    }

    // An unsupported tensor type opens, and fails by name on conversion.
    let mut w = GgufWriter::new();
    w.kv("general.architecture", Kv::Str("llama".into()));
    w.tensor("blk.0.ffn_down.weight", &[256, 2], 14, vec![0; 2 * 210]);
    let f = open_bytes(&dir, "q6k.gguf", &w.build().0).unwrap();
    match f.tensor_f32("blk.0.ffn_down.weight") {
        Err(Error::UnsupportedTensorType { tensor, dtype, .. }) => {
            assert_eq!((tensor.as_str(), dtype.as_str()), ("blk.0.ffn_down.weight", "Q6_K"))
        }
        other => panic!("{other:?}"),
    }
    let weights = GgufWeights::from_file(f).unwrap();
    assert!(matches!(weights.model_config(), Err(Error::MissingMetadata { key, .. }) if key == "llama.embedding_length"));
    let _ = std::fs::remove_dir_all(&dir);
}
