//! Gemma 3 270M (Q4_K_M), the second real model: fetched by its short name,
//! its SentencePiece tokenizer checked against llama.cpp's ids (the golden
//! file's prompts and strings tokenized by the reference's port of
//! llama.cpp's algorithm), its metadata read into a config.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use vellum_formats::gguf::GgufFile;
use vellum_formats::known_model;
use vellum_tokenizer::Tokenizer;

fn gemma_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let model = known_model("gemma3-270m").expect("gemma3-270m is a known model");
        model.fetch().unwrap_or_else(|e| panic!("fetching gemma3-270m: {e}"))
    })
}

fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let file = GgufFile::open(gemma_path()).expect("open gemma");
        Tokenizer::from_gguf(&file).expect("gemma's tokenizer")
    })
}

#[derive(serde::Deserialize)]
struct Case {
    prompt: String,
    prompt_ids: Vec<u32>,
}

fn cases(path: &str) -> Vec<Case> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/golden/gemma3-270m-q4_k_m.json");
/// Harder strings (whitespace runs, tags, byte fallback, mixed scripts),
/// tokenized by `../shared/golden/reference_gemma3.py`'s SPMTokenizer.
const EXTRA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/gemma3_tokenizer.json");

#[test]
fn golden_prompts_tokenize_like_llama_cpp_and_round_trip() {
    let t = tokenizer();
    assert_eq!(t.vocab_size(), 262_144);
    assert_eq!(t.bos_token_id(), Some(2));
    assert_eq!(t.eos_token_ids(), [1, 106], "<eos>, then <end_of_turn>");
    for case in cases(GOLDEN) {
        let ids = t.encode(&case.prompt, true).unwrap();
        assert_eq!(ids, case.prompt_ids, "{:?}", case.prompt);
        assert_eq!(t.decode(&ids[1..], false).unwrap(), case.prompt);
    }
}

#[test]
fn hard_strings_tokenize_like_the_reference() {
    let t = tokenizer();
    let cases = cases(EXTRA);
    assert!(cases.len() >= 20);
    for case in cases {
        assert_eq!(t.encode(&case.prompt, true).unwrap(), case.prompt_ids, "{:?}", case.prompt);
    }
}

#[test]
fn any_text_round_trips_and_special_tokens_can_be_skipped() {
    let t = tokenizer();
    // Not `▁` itself: SentencePiece reads it as a space (llama.cpp too).
    let alphabet: Vec<char> = " \n\t\u{a0}aé東🦫ℵ<>/_sbr0ßЖx\u{301}".chars().collect();
    let mut rng = vellum_base::SeededRng::new(13);
    for _ in 0..300 {
        let len = rng.below(24);
        let text: String = (0..len).map(|_| alphabet[rng.below(alphabet.len())]).collect();
        let ids = t.encode(&text, false).unwrap();
        assert_eq!(t.decode(&ids, false).unwrap(), text, "{ids:?}");
    }
    let ids = t.encode("<start_of_turn>user\nhi<end_of_turn>", true).unwrap();
    assert_eq!(ids[..2], [2, 105]);
    assert_eq!(t.decode(&ids, true).unwrap(), "user\nhi");
}

#[test]
fn long_whitespace_runs_are_cut_into_the_longest_pieces() {
    // Runs of newlines are user-defined pieces of 1–31 newlines (ids 107..=137);
    // a long run is the longest piece repeated (the reference cuts longest
    // first), and memory stays linear in the text.
    let t = tokenizer();
    let ids = t.encode(&"\n".repeat(1_000_000), false).unwrap();
    assert_eq!(ids.len(), 1_000_000 / 31 + 1);
    assert!(ids[..ids.len() - 1].iter().all(|&id| id == 137));
    assert_eq!(ids.last(), Some(&(107 + (1_000_000 % 31) - 1)));
}

/// The byte-level tokenizer `write_random_gguf` gives a benchmark model:
/// every text encodes, ids stay below the vocabulary, decoding gives it back.
#[test]
fn a_random_gguf_has_a_byte_level_tokenizer_over_its_whole_vocabulary() {
    use vellum_formats::{write_random_gguf, CheckpointShape, GgufWeightType};
    let shape = CheckpointShape {
        hidden: 64,
        intermediate: 96,
        layers: 1,
        heads: 4,
        kv_heads: 2,
        vocab: 300,
        max_positions: 128,
        rope_theta: 10_000.0,
    };
    let dir = std::env::temp_dir().join(format!("vellum-random-gguf-tok-{}", std::process::id()));
    let path = dir.join("m.gguf");
    write_random_gguf(&path, &shape, GgufWeightType::Q8_0, 1, |_, _| {}).expect("writes");
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).expect("opens")).expect("tokenizer");
    assert_eq!(tok.vocab_size(), 300);
    let ids = tok.encode("héllo, wörld", true).expect("encodes");
    assert_eq!(ids[0], 256, "<|begin_of_text|> first");
    assert!(ids.iter().all(|&i| i < 300));
    assert_eq!(tok.decode(&ids[1..], false).expect("decodes"), "héllo, wörld");
    let _ = std::fs::remove_dir_all(&dir);
}
