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

#[test]
fn safetensors_file_inputs_are_handled() {
    replay("safetensors_file", harness::safetensors_file);
}

/// Fuzzing on stable between nightly runs: 4,000 deterministic mutations of
/// the safetensors seeds (byte flips, a rewritten header length, a cut
/// tail, bytes spliced into the JSON header) through the same harness.
#[test]
fn mutated_safetensors_files_are_typed_errors_never_panics() {
    let seeds = inputs("safetensors_file");
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for i in 0..4000 {
        let (path, seed) = &seeds[i % seeds.len()];
        let mut data = seed.clone();
        match next() % 4 {
            0 => {
                for _ in 0..1 + next() % 4 {
                    let at = (next() as usize) % data.len();
                    data[at] = next() as u8;
                }
            }
            1 => {
                let len = match next() % 4 {
                    0 => u64::MAX,
                    1 => (data.len() as u64).saturating_sub(8) + next() % 16,
                    2 => next() % 64,
                    _ => 1 << (next() % 63),
                };
                data[..8].copy_from_slice(&len.to_le_bytes());
            }
            2 => data.truncate((next() as usize) % data.len()),
            _ => {
                let at = 8 + (next() as usize) % (data.len() - 8);
                let junk: &[u8] =
                    [&b"\"data_offsets\":[0,99999999999]"[..], b"{", b"\"dtype\":\"F64\"", b"-1", b"]]]"][(next() % 5) as usize];
                data.splice(at..at, junk.iter().copied());
            }
        }
        let outcome = std::panic::catch_unwind(|| harness::safetensors_file(&data));
        assert!(outcome.is_ok(), "mutation {i} of {} panicked", path.display());
    }
}
