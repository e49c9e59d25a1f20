//! [`WeightSource`] over a Hugging Face model directory: `config.json` plus
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`.

use crate::gguf::GgmlType;
use crate::{Error, Result, WeightSource, WeightView};
use memmap2::Mmap;
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use vellum_base::ModelConfig;

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";
const SUPPORTED_DTYPES: &str = "F32, F16, BF16";

/// The weights of a Hugging Face checkpoint directory, memory-mapped.
pub struct SafetensorsWeights {
    dir: PathBuf,
    config: ModelConfig,
    shards: Vec<Shard>,
    /// Tensor name → index into `shards`.
    index: BTreeMap<String, usize>,
    /// The file names its tensors without the `model.` prefix (a base
    /// model saved on its own, as sentence-transformers embedding
    /// checkpoints are): they are indexed under `model.` names, which
    /// [`WeightSource::tensor`] strips again to read them.
    unprefixed: bool,
}

/// One memory-mapped `.safetensors` file with its parsed header.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Bytes before the data section: the 8-byte length plus the JSON header.
    data_start: usize,
    metadata: Metadata,
}

impl std::fmt::Debug for SafetensorsWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsWeights")
            .field("dir", &self.dir)
            .field("n_shards", &self.shards.len())
            .field("n_tensors", &self.index.len())
            .finish()
    }
}

impl SafetensorsWeights {
    /// Opens a directory holding `config.json` and the safetensors file(s).
    pub fn open(dir: &Path) -> Result<Self> {
        let config_path = dir.join("config.json");
        let config = ModelConfig::from_file(&config_path).map_err(|source| Error::ModelConfig { path: config_path.clone(), source })?;
        let files = shard_files(dir)?;
        let mut shards = Vec::with_capacity(files.len());
        let mut index = BTreeMap::new();
        for path in files {
            let shard = Shard::open(path)?;
            for name in shard.metadata.offset_keys() {
                if index.insert(name.clone(), shards.len()).is_some() {
                    return Err(Error::MalformedSafetensors {
                        path: shard.path.clone(),
                        what: format!("tensor `{name}` appears in more than one shard"),
                    });
                }
            }
            shards.push(shard);
        }
        let unprefixed = !index.keys().any(|k| k.starts_with("model.")) && index.contains_key("embed_tokens.weight");
        if unprefixed {
            // The body's tensors; an LM head saved beside them keeps its name.
            index = index.into_iter().map(|(k, v)| if k.starts_with("lm_head.") { (k, v) } else { (format!("model.{k}"), v) }).collect();
        }
        Ok(Self { dir: dir.to_path_buf(), config, shards, index, unprefixed })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl WeightSource for SafetensorsWeights {
    fn tensor(&self, name: &str) -> Result<WeightView<'_>> {
        let shard = self
            .index
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| Error::MissingTensor { path: self.dir.clone(), tensor: name.to_string() })?;
        let stored = if self.unprefixed && !name.starts_with("lm_head.") { name.strip_prefix("model.").unwrap_or(name) } else { name };
        shard.tensor(stored)
    }

    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn model_config(&self) -> Result<ModelConfig> {
        Ok(self.config.clone())
    }

    fn tensor_names(&self) -> Vec<String> {
        self.index.keys().cloned().collect()
    }
}

impl Shard {
    fn open(path: PathBuf) -> Result<Self> {
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let len = file.metadata().map_err(|e| Error::io(&path, e))?.len();
        if len == 0 {
            return Err(Error::MalformedSafetensors { path, what: "file is empty".into() });
        }
        // SAFETY: read-only map; the file is assumed not to change while open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| Error::MalformedSafetensors { path: path.clone(), what: e.to_string() })?;
        Ok(Self { path, mmap, data_start: 8 + header_len, metadata })
    }

    fn tensor(&self, name: &str) -> Result<WeightView<'_>> {
        let malformed = |what: String| Error::MalformedSafetensors { path: self.path.clone(), what };
        let info = self.metadata.info(name).ok_or_else(|| malformed(format!("no entry for `{name}`")))?;
        let (start, end) = info.data_offsets;
        let bytes = self
            .mmap
            .get(self.data_start + start..self.data_start + end)
            .ok_or_else(|| malformed(format!("tensor `{name}`: data offsets {start}..{end} out of bounds")))?;
        let dtype = match info.dtype {
            Dtype::F32 => GgmlType::F32,
            Dtype::F16 => GgmlType::F16,
            Dtype::BF16 => GgmlType::BF16,
            other => {
                return Err(Error::UnsupportedTensorType {
                    path: self.path.clone(),
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                    supported: SUPPORTED_DTYPES,
                })
            }
        };
        WeightView::new(name, info.shape.clone(), dtype, Cow::Borrowed(bytes))
            .map_err(|_| malformed(format!("tensor `{name}`: {} bytes for shape {:?} of {:?}", bytes.len(), info.shape, info.dtype)))
    }
}

#[derive(serde::Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

/// The safetensors files of a checkpoint directory.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index_path = dir.join(INDEX_FILE);
    if index_path.is_file() {
        let text = std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
        let index: ShardIndex =
            serde_json::from_str(&text).map_err(|e| Error::MalformedSafetensors { path: index_path.clone(), what: e.to_string() })?;
        let files: BTreeSet<&String> = index.weight_map.values().collect();
        return files
            .into_iter()
            .map(|f| {
                if Path::new(f).components().count() != 1 || f == ".." {
                    return Err(Error::MalformedSafetensors {
                        path: index_path.clone(),
                        what: format!("shard name {f:?} is not a plain file name"),
                    });
                }
                Ok(dir.join(f))
            })
            .collect();
    }
    let single = dir.join(SINGLE_FILE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(Error::io(dir, std::io::Error::new(std::io::ErrorKind::NotFound, format!("neither {SINGLE_FILE} nor {INDEX_FILE} is here"))))
}
