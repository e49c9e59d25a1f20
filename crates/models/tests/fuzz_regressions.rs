//! The fuzz targets' inputs replayed on stable: every committed seed
//! (`fuzz/corpus/<target>/`) and every input a fuzzing run found to crash,
//! hang or blow up memory before it was fixed (`fuzz/regressions/<target>/`)
//! goes through the same harness the libFuzzer targets call
//! (`fuzz/harness.rs`). See docs/fuzzing.md.

#[path = "../../../fuzz/harness.rs"]
mod harness;

use std::path::PathBuf;

/// Every file under `fuzz/{corpus,regressions}/<target>/`.
fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let mut out = Vec::new();
    for kind in ["corpus", "regressions"] {
        let Ok(dir) = std::fs::read_dir(root.join(kind).join(target)) else { continue };
        for entry in dir.flatten() {
            let path = entry.path();
            if path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
                continue;
            }
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            out.push((path, bytes));
        }
    }
    out.sort();
    out
}

fn replay(target: &str, run: fn(&[u8])) {
    let inputs = inputs(target);
    assert!(!inputs.is_empty(), "no seeds for {target}");
    for (path, bytes) in &inputs {
        let outcome = std::panic::catch_unwind(|| run(bytes));
        assert!(outcome.is_ok(), "{target}: {} panicked", path.display());
    }
    eprintln!("{target}: {} inputs replayed", inputs.len());
}

#[test]
fn gguf_file_inputs_are_handled() {
    replay("gguf_file", harness::gguf_file);
}

#[test]
fn model_config_inputs_are_handled() {
    replay("model_config", harness::model_config);
}

#[test]
fn chat_template_inputs_are_handled() {
    replay("chat_template", harness::chat_template);
}

/// Needs the two real tokenizers: fetched like the golden tests fetch them.
#[test]
fn tokenizer_text_inputs_round_trip_through_both_real_tokenizers() {
    for model in ["smollm2-135m", "gemma3-270m"] {
        vellum_models::resolve_model(Some(model)).unwrap_or_else(|e| panic!("fetching {model}: {e}"));
    }
    replay("tokenizer_text", harness::tokenizer_text);
}
