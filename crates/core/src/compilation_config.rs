//! Which engine steps a GPU backend records as CUDA graphs, read from the
//! JSON of vLLM's `--compilation-config` flag.
//!
//! ```text
//! {"cudagraph_mode": "FULL"}                                    decode and mixed steps
//! {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4, 8]}
//! ```
//!
//! vLLM's other keys configure `torch.compile`, which Vellum does not use:
//! they are accepted and named back ([`CompilationConfig::ignored`]) so
//! that a configuration carried over from vLLM starts, with a warning.

use crate::{Error, Result};

/// The largest capture size by default (vLLM's).
pub const DEFAULT_MAX_CAPTURE_SIZE: usize = 512;

/// vLLM's default capture sizes up to `max`: 1, 2, 4, then every multiple
/// of 8.
pub fn default_capture_sizes(max: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> = [1, 2, 4].into_iter().filter(|&s| s <= max).collect();
    sizes.extend((8..=max).step_by(8));
    sizes
}

/// Which steps are recorded as CUDA graphs and replayed (vLLM's
/// `cudagraph_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CudaGraphMode {
    /// `NONE`: every op of every step is launched (`--enforce-eager`).
    None,
    /// `FULL_DECODE_ONLY`: uniform decode steps (one new token per
    /// sequence), recorded at start for every capture size up to
    /// `--max-num-seqs` (a longer context's bound on its second step).
    #[default]
    FullDecodeOnly,
    /// `FULL`: those, and mixed steps (prompt chunks beside decodes,
    /// speculative verifications) up to the largest capture size, each
    /// recorded whole once its shape has recurred.
    Full,
}

impl CudaGraphMode {
    /// vLLM's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "NONE",
            Self::FullDecodeOnly => "FULL_DECODE_ONLY",
            Self::Full => "FULL",
        }
    }

    /// Parses vLLM's name (any case). `FULL_AND_PIECEWISE` (vLLM's
    /// default) is taken as `FULL_DECODE_ONLY`, with the reason in
    /// `Ok((_, Some(reason)))`: piecewise graphs are not built, so its mixed
    /// steps run eagerly as they would there outside the pieces.
    pub fn parse(name: &str) -> std::result::Result<(Self, Option<String>), String> {
        match name.to_ascii_uppercase().as_str() {
            "NONE" => Ok((Self::None, None)),
            "FULL_DECODE_ONLY" => Ok((Self::FullDecodeOnly, None)),
            "FULL" => Ok((Self::Full, None)),
            "FULL_AND_PIECEWISE" => Ok((
                Self::FullDecodeOnly,
                Some("FULL_AND_PIECEWISE runs as FULL_DECODE_ONLY: piecewise graphs are not built (FULL records mixed steps whole)".into()),
            )),
            "PIECEWISE" => Err("PIECEWISE is not supported: Vellum records whole steps (FULL_DECODE_ONLY, FULL) or none (NONE)".into()),
            other => Err(format!("unknown cudagraph_mode {other:?} (supported: NONE, FULL_DECODE_ONLY, FULL, FULL_AND_PIECEWISE)")),
        }
    }
}

/// What `--compilation-config` sets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompilationConfig {
    /// `cudagraph_mode` (or the older `full_cuda_graph: true`, which is
    /// `FULL`); `None`: the default.
    pub cudagraph_mode: Option<CudaGraphMode>,
    /// `cudagraph_capture_sizes`: the token counts steps are padded to and
    /// recorded at, each at least 1; `None`: the default.
    pub cudagraph_capture_sizes: Option<Vec<usize>>,
    /// `max_cudagraph_capture_size`: the default sizes up to this one.
    pub max_cudagraph_capture_size: Option<usize>,
    /// Keys accepted without effect (`torch.compile`'s): what the caller
    /// should warn about.
    pub ignored: Vec<String>,
    /// How a mode was taken (`FULL_AND_PIECEWISE` as `FULL_DECODE_ONLY`):
    /// what the caller should say too.
    pub notes: Vec<String>,
}

/// The keys with an effect.
const KEYS: [&str; 4] = ["cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "full_cuda_graph"];

impl CompilationConfig {
    /// Parses vLLM's `--compilation-config` JSON (see the module docs).
    pub fn from_json(text: &str) -> Result<Self> {
        let bad = |message: String| Error::InvalidConfig { field: "compilation_config", message };
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let obj = value.as_object().ok_or_else(|| bad("must be a JSON object".into()))?;
        let ignored = obj.keys().filter(|k| !KEYS.contains(&k.as_str())).map(|k| format!("{k} (applies to torch.compile)")).collect();
        let mut config = Self { ignored, ..Self::default() };
        let size = |v: &serde_json::Value, what: &str| -> Result<usize> {
            match v.as_u64() {
                Some(n) if n >= 1 => Ok(n as usize),
                _ => Err(bad(format!("{what} takes token counts of at least 1, got {v}"))),
            }
        };
        match obj.get("cudagraph_mode") {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::String(name)) => {
                let (mode, note) = CudaGraphMode::parse(name).map_err(bad)?;
                config.cudagraph_mode = Some(mode);
                config.notes.extend(note);
            }
            Some(v) => return Err(bad(format!("cudagraph_mode must be a string, got {v}"))),
        }
        match obj.get("full_cuda_graph") {
            None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => {}
            Some(serde_json::Value::Bool(true)) => {
                if config.cudagraph_mode.is_some_and(|m| m != CudaGraphMode::Full) {
                    return Err(bad("full_cuda_graph: true contradicts the cudagraph_mode given".into()));
                }
                config.cudagraph_mode = Some(CudaGraphMode::Full);
            }
            Some(v) => return Err(bad(format!("full_cuda_graph must be true or false, got {v}"))),
        }
        match obj.get("cudagraph_capture_sizes") {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::Array(sizes)) if !sizes.is_empty() => {
                config.cudagraph_capture_sizes =
                    Some(sizes.iter().map(|v| size(v, "cudagraph_capture_sizes")).collect::<Result<Vec<_>>>()?);
            }
            Some(v) => return Err(bad(format!("cudagraph_capture_sizes must be a non-empty list of token counts, got {v}"))),
        }
        if let Some(v) = obj.get("max_cudagraph_capture_size").filter(|v| !v.is_null()) {
            config.max_cudagraph_capture_size = Some(size(v, "max_cudagraph_capture_size")?);
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_sizes_are_vllms() {
        assert_eq!(default_capture_sizes(24), [1, 2, 4, 8, 16, 24]);
        assert_eq!(default_capture_sizes(3), [1, 2]);
        assert_eq!(default_capture_sizes(DEFAULT_MAX_CAPTURE_SIZE).len(), 67);
    }

    #[test]
    fn modes_parse_by_vllms_names() {
        let mode = |json: &str| CompilationConfig::from_json(json).map(|c| c.cudagraph_mode);
        assert_eq!(mode(r#"{"cudagraph_mode": "FULL"}"#).unwrap(), Some(CudaGraphMode::Full));
        assert_eq!(mode(r#"{"cudagraph_mode": "full_decode_only"}"#).unwrap(), Some(CudaGraphMode::FullDecodeOnly));
        assert_eq!(mode(r#"{"cudagraph_mode": "NONE"}"#).unwrap(), Some(CudaGraphMode::None));
        assert_eq!(mode(r#"{"full_cuda_graph": true}"#).unwrap(), Some(CudaGraphMode::Full));
        assert_eq!(mode("{}").unwrap(), None);
        for m in [CudaGraphMode::None, CudaGraphMode::FullDecodeOnly, CudaGraphMode::Full] {
            assert_eq!(CudaGraphMode::parse(m.name()), Ok((m, None)));
        }
    }

    #[test]
    fn vllms_default_runs_as_decode_only_and_says_so() {
        let c = CompilationConfig::from_json(r#"{"cudagraph_mode": "FULL_AND_PIECEWISE", "level": 3}"#).unwrap();
        assert_eq!(c.cudagraph_mode, Some(CudaGraphMode::FullDecodeOnly));
        assert_eq!(c.ignored.len(), 1, "{:?}", c.ignored);
        assert!(c.ignored[0].starts_with("level"), "{:?}", c.ignored);
        assert!(c.notes.len() == 1 && c.notes[0].contains("FULL_AND_PIECEWISE"), "{:?}", c.notes);
    }

    #[test]
    fn sizes_are_token_counts_of_at_least_one() {
        let c = CompilationConfig::from_json(r#"{"cudagraph_capture_sizes": [1, 2, 8], "max_cudagraph_capture_size": 64}"#).unwrap();
        assert_eq!((c.cudagraph_capture_sizes, c.max_cudagraph_capture_size), (Some(vec![1, 2, 8]), Some(64)));
        assert!(c.ignored.is_empty());
        for bad in [
            r#"{"cudagraph_capture_sizes": [0, 4]}"#,
            r#"{"cudagraph_capture_sizes": []}"#,
            r#"{"cudagraph_capture_sizes": [-1]}"#,
            r#"{"max_cudagraph_capture_size": 0}"#,
        ] {
            let e = CompilationConfig::from_json(bad).expect_err(bad).to_string();
            assert!(e.contains("compilation_config") && e.contains("capture_size"), "{bad}: {e}");
        }
    }

    #[test]
    fn bad_input_is_a_typed_error_that_names_the_choice() {
        for (json, says) in [
            (r#"{"cudagraph_mode": "PIECEWISE"}"#, "PIECEWISE is not supported"),
            (r#"{"cudagraph_mode": "FAST"}"#, "unknown cudagraph_mode \"FAST\""),
            (r#"{"cudagraph_mode": 2}"#, "must be a string"),
            (r#"{"cudagraph_mode": "NONE", "full_cuda_graph": true}"#, "contradicts"),
            (r#"[1]"#, "JSON object"),
            (r#"{"#, "not JSON"),
        ] {
            let e = CompilationConfig::from_json(json).expect_err(json);
            assert!(matches!(e, Error::InvalidConfig { field: "compilation_config", .. }), "{e:?}");
            assert!(e.to_string().contains(says), "{json}: {e}");
        }
    }
}
