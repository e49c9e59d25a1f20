#![allow(dead_code)] // each target uses one function

//! What each fuzz target does with its input, shared by the libFuzzer
//! targets (`fuzz/fuzz_targets/`) and the stable regression test that
//! replays crashers and seeds in CI (`crates/models/tests/fuzz_regressions.rs`).
//! Every function must return normally on any input: a panic, a hang or an
//! allocation blow-up is a bug.

use std::path::PathBuf;
use std::sync::OnceLock;
use vellum_base::ModelConfig;
use vellum_models::gguf::GgufFile;
use vellum_models::{ChatMessage, ChatTemplate, GgufWeights, Tokenizer, WeightSource};

/// A file of this process's own for the GGUF bytes (the reader memory-maps
/// a path, as it does for a user's download).
fn scratch_path() -> PathBuf {
    let dir = std::env::var_os("VELLUM_FUZZ_DIR").map(PathBuf::from).unwrap_or_else(|| {
        let shm = PathBuf::from("/dev/shm");
        if shm.is_dir() {
            shm
        } else {
            std::env::temp_dir()
        }
    });
    let thread = format!("{:?}", std::thread::current().id()).replace(|c: char| !c.is_ascii_alphanumeric(), "");
    dir.join(format!("vellum-fuzz-{}-{thread}.gguf", std::process::id()))
}

/// A GGUF file as a user downloads it: the reader, every tensor's bytes,
/// the model config, the tokenizer (encode and decode) and the chat
/// template it carries.
pub fn gguf_file(data: &[u8]) {
    let path = scratch_path();
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(file) = GgufFile::open(&path) {
        for t in file.tensors() {
            if let Ok(bytes) = file.tensor_bytes(&t.name) {
                std::hint::black_box(bytes.len());
            }
            // Dequantizing is bounded by the file's own size.
            let _ = file.tensor_f32(&t.name);
        }
        if let Ok(tok) = Tokenizer::from_gguf(&file) {
            for text in ["Hello, wörld! 🦀 ", "  <s>\n\t\u{0}", ""] {
                if let Ok(ids) = tok.encode(text, true) {
                    let _ = tok.decode(&ids, false);
                }
            }
            let n = tok.vocab_size() as u32;
            let _ = tok.decode(&[0, 1, n.saturating_sub(1), n, u32::MAX], true);
        }
        if let Ok(Some(t)) = ChatTemplate::from_gguf(&file) {
            let _ = t.render(&[ChatMessage::new("user", "hi")], true);
        }
        if let Ok(w) = GgufWeights::from_file(file) {
            let _ = w.model_config();
        }
    }
    let _ = std::fs::remove_file(&path);
}

/// A `config.json`.
pub fn model_config(data: &[u8]) {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = ModelConfig::from_json_str(s, "fuzz/config.json");
    }
}

/// A chat template (the bytes before the first NUL) rendered over hostile
/// messages (the rest, split at NULs into role/content pairs).
pub fn chat_template(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let source = parts.next().unwrap_or_default();
    let rest: Vec<&str> = parts.collect();
    let mut messages: Vec<ChatMessage> = rest.chunks(2).map(|p| ChatMessage::new(p[0], p.get(1).copied().unwrap_or(""))).collect();
    if messages.is_empty() {
        messages.push(ChatMessage::new("user", "hello"));
    }
    if let Ok(t) = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into())) {
        let _ = t.render(&messages, true);
        let _ = t.render(&messages, false);
    }
}

/// The real tokenizers, when their files are in the model cache: the
/// default model's byte-level BPE and Gemma 3's SentencePiece.
fn real_tokenizers() -> &'static [Tokenizer] {
    static TOKENIZERS: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    TOKENIZERS.get_or_init(|| {
        let cache = std::env::var_os("VELLUM_CACHE").map(PathBuf::from).unwrap_or_else(|| {
            let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
            std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or(home.join(".cache")).join("vellum")
        });
        ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"]
            .iter()
            .filter_map(|f| GgufFile::open(&cache.join(f)).ok())
            .filter_map(|file| Tokenizer::from_gguf(&file).ok())
            .collect()
    })
}

/// The byte-level character GPT-2's BPE writes for byte `b`.
fn byte_level_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    if printable(b) {
        return char::from(b);
    }
    let shift = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + shift).expect("below U+0200")
}

/// Arbitrary text through the real tokenizers: encoding never fails on
/// valid UTF-8, and decoding what was encoded gives the text back — with
/// two exceptions the vocabularies impose (llama.cpp and the reference
/// tokenizers behave the same): SentencePiece writes a space as `▁`
/// (U+2581), so a `▁` in the text comes back as a space; and a byte-level
/// BPE vocabulary may lack some byte characters (SmolLM2's has no token for
/// the control bytes 0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, nor for bytes that
/// never occur in UTF-8), whose text is then not compared.
pub fn tokenizer_text(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    for tok in real_tokenizers() {
        let ids = tok.encode(text, false).expect("any UTF-8 text encodes");
        let back = tok.decode(&ids, false).expect("encoded ids decode");
        let sentencepiece = tok.hf_tokenizer().is_none();
        if !sentencepiece && text.bytes().any(|b| tok.token_to_id(&byte_level_char(b).to_string()).is_none()) {
            continue;
        }
        let expected = if sentencepiece { text.replace('\u{2581}', " ") } else { text.to_string() };
        let which = if sentencepiece { "SentencePiece" } else { "byte-level BPE" };
        assert_eq!(back, expected, "round trip through {} tokens of the {which} tokenizer", ids.len());
    }
}

/// A Hugging Face directory whose `model.safetensors` is `data` (next to a
/// valid `config.json`): the header parse, every tensor's view and bytes.
pub fn safetensors_file(data: &[u8]) {
    let dir = scratch_path().with_extension("st");
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let config = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2}"#;
    if std::fs::write(dir.join("config.json"), config).is_err() || std::fs::write(dir.join("model.safetensors"), data).is_err() {
        return;
    }
    if let Ok(w) = vellum_models::SafetensorsWeights::open(&dir) {
        for name in w.tensor_names() {
            if let Ok(view) = w.tensor(&name) {
                let _ = std::hint::black_box(view.data.iter().fold(0u8, |a, b| a ^ b));
                let _ = std::hint::black_box(view.shape.iter().product::<usize>());
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
