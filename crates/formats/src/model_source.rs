//! Turning a user's model specification into files on disk.

use crate::default_model::{fetch_default_model, known_model, KNOWN_MODELS};
use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// Where a model's files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A single GGUF file.
    Gguf(PathBuf),
    /// A Hugging Face directory with `config.json`, safetensors and `tokenizer.json`.
    HfDir(PathBuf),
}

impl ModelSource {
    /// The file or directory.
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Gguf(p) | ModelSource::HfDir(p) => p,
        }
    }
}

/// Finds a model. `spec` may be:
///
/// - `None`: the default model, fetched into the cache if needed;
/// - a short name such as `gemma3-270m` ([`KNOWN_MODELS`]), fetched likewise
///   (a file or directory of that name wins);
/// - a path to a `.gguf` file;
/// - a Hugging Face directory (one holding `config.json`);
/// - a Hugging Face repo id `org/name`, looked up in the local hub cache
///   (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`);
///   nothing is downloaded.
pub fn resolve_model(spec: Option<&str>) -> Result<ModelSource> {
    let Some(spec) = spec else {
        return fetch_default_model().map(ModelSource::Gguf);
    };
    let mut tried = Vec::new();
    let path = Path::new(spec);
    if path.is_file() {
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            return Ok(ModelSource::Gguf(path.to_path_buf()));
        }
        tried.push(format!("{spec}: a file, but not a .gguf file"));
    } else if path.is_dir() {
        if path.join("config.json").is_file() {
            return Ok(ModelSource::HfDir(path.to_path_buf()));
        }
        tried.push(format!("{spec}: a directory without config.json"));
    } else if let Some(model) = known_model(spec) {
        return model.fetch().map(ModelSource::Gguf);
    } else {
        tried.push(format!("{spec}: no such file or directory"));
        let names: Vec<&str> = KNOWN_MODELS.iter().map(|m| m.name).collect();
        tried.push(format!("{spec}: not a known model name ({})", names.join(", ")));
    }
    if let Some((org, name)) = repo_id(spec) {
        match hub_cache_dir() {
            Some(hub) => {
                if let Some(dir) = hub_snapshot(&hub, org, name, &mut tried) {
                    return Ok(ModelSource::HfDir(dir));
                }
            }
            None => tried.push("the Hugging Face hub cache: none of HF_HUB_CACHE, HF_HOME or HOME is set".into()),
        }
    }
    Err(Error::ModelNotFound { spec: spec.to_string(), tried })
}

/// `org/name` if `spec` has that form.
fn repo_id(spec: &str) -> Option<(&str, &str)> {
    let (org, name) = spec.split_once('/')?;
    let plain = |s: &str| !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\\']);
    (plain(org) && plain(name)).then_some((org, name))
}

fn hub_cache_dir() -> Option<PathBuf> {
    let non_empty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    non_empty("HF_HUB_CACHE")
        .or_else(|| non_empty("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| non_empty("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// The snapshot directory of `org/name` in the hub cache: the revision
/// `refs/main` names, else the newest snapshot that has `config.json`.
fn hub_snapshot(hub: &Path, org: &str, name: &str, tried: &mut Vec<String>) -> Option<PathBuf> {
    let repo = hub.join(format!("models--{org}--{name}"));
    let snapshots = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs").join("main")) {
        let dir = snapshots.join(rev.trim());
        if dir.join("config.json").is_file() {
            return Some(dir);
        }
        tried.push(format!("{}: refs/main names a snapshot without config.json", dir.display()));
    }
    let mut candidates: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&snapshots)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("config.json").is_file())
        .map(|p| (std::fs::metadata(&p).and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH), p))
        .collect();
    candidates.sort();
    match candidates.pop() {
        Some((_, dir)) => Some(dir),
        None => {
            tried.push(format!("{}: no snapshot with config.json in the Hugging Face hub cache", snapshots.display()));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids() {
        assert_eq!(repo_id("HuggingFaceTB/SmolLM2-135M"), Some(("HuggingFaceTB", "SmolLM2-135M")));
        assert_eq!(repo_id("a/b/c"), None);
        assert_eq!(repo_id("../x"), None);
        assert_eq!(repo_id("model.gguf"), None);
    }

    #[test]
    fn finds_hub_cache_snapshots() {
        let hub = std::env::temp_dir().join(format!("vellum-models-hub-{}", std::process::id()));
        let repo = hub.join("models--org--tiny");
        let snapshot = repo.join("snapshots").join("abc123");
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        let mut tried = Vec::new();
        assert_eq!(hub_snapshot(&hub, "org", "tiny", &mut tried), None);
        assert_eq!(tried.len(), 1, "{tried:?}");
        std::fs::write(snapshot.join("config.json"), "{}").unwrap();
        assert_eq!(hub_snapshot(&hub, "org", "tiny", &mut tried), Some(snapshot.clone()));
        std::fs::write(repo.join("refs").join("main"), "abc123\n").unwrap();
        assert_eq!(hub_snapshot(&hub, "org", "tiny", &mut tried), Some(snapshot));
        assert_eq!(hub_snapshot(&hub, "org", "other", &mut tried), None);
        let _ = std::fs::remove_dir_all(&hub);
    }

    #[test]
    fn unknown_spec_lists_what_was_tried() {
        let err = resolve_model(Some("/nonexistent/vellum-model.gguf")).unwrap_err();
        assert!(matches!(&err, Error::ModelNotFound { tried, .. } if !tried.is_empty()), "{err}");
    }
}
