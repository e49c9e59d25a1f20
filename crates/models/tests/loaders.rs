//! Integration tests: the real default model (fetched once into the cache),
//! tiny checkpoints written here in both formats, and malformed files.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use vellum_models::gguf::{GgmlType, GgufFile, MetadataValue};
// The readers' errors are `vellum-formats`' own.
use vellum_formats::Error;
use vellum_models::{
    fetch_default_model, resolve_model, ChatMessage, ChatTemplate, GgufWeights, ModelSource, SafetensorsWeights, Tokenizer, WeightSource,
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
    std::fs::write(dir.join("tokenizer.json"), from_gguf.hf_tokenizer().unwrap().to_string(false).unwrap()).unwrap();
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
    let qq = w.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!((qq.dtype, qq.shape.clone()), (GgmlType::Q4_1, vec![576, 576]));
    assert_eq!(vellum_models::gguf::dequantize(qq.dtype, &qq.data, 576 * 576).unwrap(), q.data);
    let e = w.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!(e.dtype, GgmlType::Q8_0);
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
        (
            "model.embed_tokens.weight",
            -15353.04449415207,
            2802153.619805813,
            [-0.10654449462890625, 0.032978057861328125, 0.08371353149414062, -0.15135955810546875, -0.0417022705078125],
        ),
        (
            "model.layers.29.mlp.down_proj.weight",
            49.83570861816406,
            126250.91435241699,
            [-0.2733154296875, 0.186279296875, 0.04840087890625, -0.016998291015625, 0.056640625],
        ),
        ("model.norm.weight", 1038.33203125, 1045.09765625, [1.7578125, 1.8203125, -1.2578125, 1.765625, 1.984375]),
        // Q rows are permuted, but the first and last rows and the sums are not affected.
        (
            "model.layers.0.self_attn.q_proj.weight",
            59.22322082519531,
            63395.39872741699,
            [-0.0963134765625, 0.1573486328125, 0.2841796875, 0.3294677734375, -0.255859375],
        ),
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
    let loaded = vellum_models::LoadedModel::open(&source).unwrap();
    assert_eq!(loaded.config.num_hidden_layers, 30);
    assert!(loaded.chat_template.is_some());
    assert_eq!(loaded.tokenizer.encode("The capital of France is", false).unwrap(), golden()[0].prompt_ids);
    assert!(loaded.weights.contains("model.layers.29.mlp.up_proj.weight"));
}

// --------------------------------------------- tiny checkpoints, written here

mod common;
use common::tiny_checkpoint::*;

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
        let q = g.tensor(&t.hf).unwrap();
        assert_eq!(vellum_models::gguf::dequantize(q.dtype, &q.data, a.n_elements()).unwrap(), a.data);
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
    let mut rng = Lcg::new(3);
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
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let s = SafetensorsWeights::open(&dir).unwrap();
    assert!(matches!(s.tensor_f32("model.norm.weight"), Err(Error::UnsupportedTensorType { dtype, .. }) if dtype == "I32"));
    let _ = std::fs::remove_dir_all(&dir);
}

// --------------------------------------------------------- malformed GGUF

fn open_bytes(dir: &Path, name: &str, bytes: &[u8]) -> vellum_formats::Result<GgufFile> {
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
    let mut rng = Lcg::new(11);
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

    // An unsupported tensor type (IQ2_XXS, type 16) opens, and fails by name on conversion.
    let mut w = GgufWriter::new();
    w.kv("general.architecture", Kv::Str("llama".into()));
    w.tensor("blk.0.ffn_down.weight", &[256, 2], 16, vec![0; 2 * 66]);
    let f = open_bytes(&dir, "iq2.gguf", &w.build().0).unwrap();
    match f.tensor_f32("blk.0.ffn_down.weight") {
        Err(Error::UnsupportedTensorType { tensor, dtype, .. }) => {
            assert_eq!((tensor.as_str(), dtype.as_str()), ("blk.0.ffn_down.weight", "IQ2_XXS"))
        }
        other => panic!("{other:?}"),
    }
    let weights = GgufWeights::from_file(f).unwrap();
    assert!(matches!(weights.model_config(), Err(Error::MissingMetadata { key, .. }) if key == "llama.embedding_length"));
    let _ = std::fs::remove_dir_all(&dir);
}
