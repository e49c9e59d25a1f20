//! A random-weight BERT encoder as sentence-transformers saves one, for
//! tests of encoder embedding models on machines that cannot download any.
//!
//! [`write_random_bert`] writes `config.json` (`BertModel`), one
//! `model.safetensors` of float32 tensors (named with or without the
//! `bert.` prefix, a pooler included, as checkpoints carry it), a WordPiece
//! `tokenizer.json` over [`BERT_WORDS`] (BERT's normalizer, pre-tokenizer
//! and `[CLS] … [SEP]` template, with the fixed-length padding and the
//! truncation sentence-transformers saves), and optionally the
//! sentence-transformers pooling files. Values are uniform in `±0.2`
//! (LayerNorm weights `1 ± 0.1`), seeded.

use crate::{Error, Result};
use std::path::Path;
use vellum_base::SeededRng;

/// The shape of a [`write_random_bert`] checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BertShape {
    /// Hidden size.
    pub hidden: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Learned positions.
    pub max_positions: usize,
}

/// How [`write_random_bert`] lays the checkpoint out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BertOptions {
    /// Weights seed.
    pub seed: u64,
    /// Tensor names under `bert.` (as `BertForMaskedLM` files name them).
    pub prefixed: bool,
    /// `config.json` leaves out what BERT defaults (`layer_norm_eps`,
    /// `hidden_act`, `type_vocab_size`, `position_embedding_type`).
    pub minimal_config: bool,
    /// sentence-transformers files: `1_Pooling/config.json` with this mode
    /// (`"cls"` or `"mean"`) and `modules.json` with a `Normalize` module.
    pub pooling: Option<&'static str>,
}

/// The words of the tokenizer after `[PAD]`, `[UNK]`, `[CLS]`, `[SEP]`
/// (ids 0–3): word `i` has id `4 + i`.
pub const BERT_WORDS: &[&str] =
    &["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away", "##s", "##ing", "blue", "sky", ".", ","];

/// Writes the checkpoint into `dir` (created if needed).
pub fn write_random_bert(dir: &Path, shape: &BertShape, options: &BertOptions) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let (h, im) = (shape.hidden, shape.intermediate);
    let vocab = 4 + BERT_WORDS.len();
    let prefix = if options.prefixed { "bert." } else { "" };
    // (name, shape, LayerNorm weight)
    let mut tensors: Vec<(String, Vec<usize>, bool)> = vec![
        (format!("{prefix}embeddings.word_embeddings.weight"), vec![vocab, h], false),
        (format!("{prefix}embeddings.position_embeddings.weight"), vec![shape.max_positions, h], false),
        (format!("{prefix}embeddings.token_type_embeddings.weight"), vec![2, h], false),
        (format!("{prefix}embeddings.LayerNorm.weight"), vec![h], true),
        (format!("{prefix}embeddings.LayerNorm.bias"), vec![h], false),
    ];
    for l in 0..shape.layers {
        let p = |s: &str| format!("{prefix}encoder.layer.{l}.{s}");
        for (name, out, inp) in [
            ("attention.self.query", h, h),
            ("attention.self.key", h, h),
            ("attention.self.value", h, h),
            ("attention.output.dense", h, h),
            ("intermediate.dense", im, h),
            ("output.dense", h, im),
        ] {
            tensors.push((p(&format!("{name}.weight")), vec![out, inp], false));
            tensors.push((p(&format!("{name}.bias")), vec![out], false));
        }
        for norm in ["attention.output.LayerNorm", "output.LayerNorm"] {
            tensors.push((p(&format!("{norm}.weight")), vec![h], true));
            tensors.push((p(&format!("{norm}.bias")), vec![h], false));
        }
    }
    tensors.push((format!("{prefix}pooler.dense.weight"), vec![h, h], false));
    tensors.push((format!("{prefix}pooler.dense.bias"), vec![h], false));

    let mut rng = SeededRng::new(options.seed);
    let mut header = serde_json::Map::new();
    let mut data: Vec<u8> = Vec::new();
    for (name, s, norm) in &tensors {
        let n: usize = s.iter().product();
        let start = data.len();
        for _ in 0..n {
            let u: f32 = rng.signed_f32();
            let v = if *norm { 1.0 + 0.1 * u } else { 0.2 * u };
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(name.clone(), serde_json::json!({"dtype": "F32", "shape": s, "data_offsets": [start, data.len()]}));
    }
    let path = dir.join("model.safetensors");
    let mut header = serde_json::to_vec(&serde_json::Value::Object(header))
        .map_err(|e| Error::MalformedSafetensors { path: path.clone(), what: e.to_string() })?;
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend_from_slice(&data);
    std::fs::write(&path, file).map_err(|e| Error::io(&path, e))?;

    let mut config = serde_json::json!({
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": vocab, "hidden_size": h,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads, "intermediate_size": im,
        "max_position_embeddings": shape.max_positions, "pad_token_id": 0
    });
    if !options.minimal_config {
        for (k, v) in [
            ("hidden_act", serde_json::json!("gelu")),
            ("layer_norm_eps", serde_json::json!(1e-12)),
            ("type_vocab_size", serde_json::json!(2)),
            ("position_embedding_type", serde_json::json!("absolute")),
        ] {
            config[k] = v;
        }
    }
    write(dir, "config.json", &config)?;
    write(dir, "tokenizer.json", &wordpiece_tokenizer())?;
    if let Some(mode) = options.pooling {
        let pooling = serde_json::json!({
            "word_embedding_dimension": h,
            "pooling_mode_cls_token": mode == "cls",
            "pooling_mode_mean_tokens": mode == "mean",
        });
        std::fs::create_dir_all(dir.join("1_Pooling")).map_err(|e| Error::io(dir, e))?;
        write(dir, "1_Pooling/config.json", &pooling)?;
        let modules = serde_json::json!([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        ]);
        write(dir, "modules.json", &modules)?;
    }
    Ok(())
}

fn write(dir: &Path, name: &str, v: &serde_json::Value) -> Result<()> {
    let path = dir.join(name);
    std::fs::write(&path, v.to_string()).map_err(|e| Error::io(&path, e))
}

/// BERT's WordPiece `tokenizer.json` over [`BERT_WORDS`], with the padding
/// and truncation sentence-transformers saves (a batch setting, which a
/// single prompt must not get).
fn wordpiece_tokenizer() -> serde_json::Value {
    let special = |id: usize, content: &str| serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let mut vocab = serde_json::Map::new();
    for (i, w) in ["[PAD]", "[UNK]", "[CLS]", "[SEP]"].iter().chain(BERT_WORDS).enumerate() {
        vocab.insert(w.to_string(), serde_json::json!(i));
    }
    let token = |id: &str, ty: u32| serde_json::json!({"SpecialToken": {"id": id, "type_id": ty}});
    let seq = |id: &str, ty: u32| serde_json::json!({"Sequence": {"id": id, "type_id": ty}});
    serde_json::json!({
        "version": "1.0",
        "truncation": {"direction": "Right", "max_length": 6, "strategy": "LongestFirst", "stride": 0},
        "padding": {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"},
        "added_tokens": [special(0, "[PAD]"), special(1, "[UNK]"), special(2, "[CLS]"), special(3, "[SEP]")],
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true, "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [token("[CLS]", 0), seq("A", 0), token("[SEP]", 0)],
            "pair": [token("[CLS]", 0), seq("A", 0), token("[SEP]", 0), seq("B", 1), token("[SEP]", 1)],
            "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]}, "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}},
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##", "max_input_chars_per_word": 100, "vocab": vocab}
    })
}
