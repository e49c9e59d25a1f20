//! A GGUF file: header, metadata, tensor table and the memory-mapped data.
//!
//! ```text
//! "GGUF" | version u32 | n_tensors u64 | n_kv u64
//! n_kv × (key: string, type: u32, value)
//! n_tensors × (name: string, n_dims u32, ne[n_dims] u64, type u32, offset u64)
//! padding to `general.alignment` (default 32)
//! data section: tensor i at data_offset + offset_i
//! ```
//!
//! Every length and offset read from the file is checked against the file's
//! size when it is opened, so later accesses cannot read out of bounds.

mod cursor;
mod metadata_value;
mod tensor_info;

pub use metadata_value::MetadataValue;
pub use tensor_info::TensorInfo;
pub use vellum_ops::quant::{dequantize, dequantize_into, scale_min_k4, GgmlType, DEQUANTIZABLE};

use crate::{Error, Result};
use cursor::Cursor;
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// `"GGUF"` read as a little-endian u32.
const MAGIC: u32 = 0x4655_4747;
/// ggml's limit on tensor dimensions.
const MAX_DIMS: usize = 4;
const DEFAULT_ALIGNMENT: usize = 32;

/// An open, validated GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    metadata: BTreeMap<String, MetadataValue>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: usize,
    data_offset: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses `path`, checking every offset and size.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let malformed = |what: String| Error::MalformedGguf { path: path.to_path_buf(), what };
        if len == 0 {
            return Err(malformed("file is empty".into()));
        }
        // SAFETY: the map is read-only. Like every mmap-based loader we
        // assume the file is not truncated or rewritten while it is open.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let parsed = parse(&mmap).map_err(malformed)?;
        let tensor_index = parsed.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            version: parsed.version,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            tensor_index,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Offset of the data section from the start of the file.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetadataValue> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// One tensor's entry, by GGUF name.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's raw stored bytes (quantized blocks as in the file), by GGUF name.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self.require(name)?;
        Ok(self.bytes_of(info))
    }

    /// A tensor converted to f32, in file element order, by GGUF name.
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.require(name)?;
        if !info.ggml_type.is_dequantizable() {
            return Err(Error::UnsupportedTensorType {
                path: self.path.clone(),
                tensor: name.to_string(),
                dtype: info.ggml_type.to_string(),
                supported: DEQUANTIZABLE,
            });
        }
        dequantize(info.ggml_type, self.bytes_of(info), info.n_elements()).ok_or_else(|| Error::MalformedGguf {
            path: self.path.clone(),
            what: format!("tensor `{name}`: byte size does not match its shape"),
        })
    }

    /// A required string metadata value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require_key(key)?;
        v.as_str().ok_or_else(|| self.bad_type(key, "a string", v))
    }

    /// A required non-negative integer metadata value.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.require_key(key)?;
        v.as_u64().and_then(|x| usize::try_from(x).ok()).ok_or_else(|| self.bad_type(key, "a non-negative integer", v))
    }

    /// A required numeric metadata value.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.require_key(key)?;
        v.as_f64().ok_or_else(|| self.bad_type(key, "a number", v))
    }

    /// A required array metadata value.
    pub fn get_array(&self, key: &str) -> Result<&[MetadataValue]> {
        let v = self.require_key(key)?;
        v.as_array().ok_or_else(|| self.bad_type(key, "an array", v))
    }

    fn require_key(&self, key: &str) -> Result<&MetadataValue> {
        self.metadata.get(key).ok_or_else(|| Error::MissingMetadata { path: self.path.clone(), key: key.to_string() })
    }

    /// An [`Error::BadMetadata`] for `key`, whose value `found` is not
    /// `expected` (a description such as "an array of strings").
    pub fn bad_type(&self, key: &str, expected: &str, found: &MetadataValue) -> Error {
        Error::BadMetadata {
            path: self.path.clone(),
            key: key.to_string(),
            what: format!("expected {expected}, found {}", found.type_name()),
        }
    }

    fn require(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor_info(name).ok_or_else(|| Error::MissingTensor { path: self.path.clone(), tensor: name.to_string() })
    }

    fn bytes_of(&self, info: &TensorInfo) -> &[u8] {
        // In bounds: checked by `parse` against the same map.
        &self.mmap[info.file_offset..info.file_offset + info.n_bytes]
    }
}

struct Parsed {
    version: u32,
    metadata: BTreeMap<String, MetadataValue>,
    tensors: Vec<TensorInfo>,
    alignment: usize,
    data_offset: usize,
}

fn parse(bytes: &[u8]) -> std::result::Result<Parsed, String> {
    let mut c = Cursor::new(bytes);
    let magic = c.u32("magic")?;
    if magic != MAGIC {
        return Err(format!("bad magic {:?}, expected \"GGUF\"", magic.to_le_bytes().escape_ascii().to_string()));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(format!("unsupported GGUF version {version} (supported: 2, 3)"));
    }
    let n_tensors = c.len("tensor count")?;
    let n_kv = c.len("metadata count")?;
    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        let type_id = c.u32(&format!("type of `{key}`"))?;
        let value = MetadataValue::read(&mut c, type_id, &format!("value of `{key}`"))?;
        metadata.insert(key, value);
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64().and_then(|a| usize::try_from(a).ok()) {
            Some(a) if a.is_power_of_two() => a,
            _ => return Err(format!("general.alignment must be a power of two, got {v:?}")),
        },
    };
    // Each tensor entry takes at least 8 + 4 + 4 + 8 bytes.
    if n_tensors.checked_mul(24).is_none_or(|b| b > c.remaining()) {
        return Err(format!("tensor count {n_tensors} does not fit in the file"));
    }
    let mut raw = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = c.string(&format!("name of tensor #{i}"))?;
        let n_dims = c.u32(&format!("n_dims of `{name}`"))? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!("tensor `{name}` has {n_dims} dimensions (1..={MAX_DIMS} allowed)"));
        }
        let mut ne = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            ne.push(c.len(&format!("dimensions of `{name}`"))?);
        }
        let type_id = c.u32(&format!("type of `{name}`"))?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| format!("tensor `{name}` has unknown ggml type id {type_id}"))?;
        let offset = c.len(&format!("offset of `{name}`"))?;
        raw.push((name, ne, ggml_type, offset));
    }
    let data_offset = c.pos().next_multiple_of(alignment);
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, ne, ggml_type, offset) in raw {
        let n_elements = ne.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        let (block, block_bytes) = ggml_type.block_layout();
        let n_bytes = match n_elements {
            Some(n) if ne[0] % block == 0 => (n / block).checked_mul(block_bytes),
            Some(_) => return Err(format!("tensor `{name}`: row length {} is not a multiple of {ggml_type}'s block of {block}", ne[0])),
            None => None,
        }
        .ok_or_else(|| format!("tensor `{name}`: shape {ne:?} overflows"))?;
        if offset % alignment != 0 {
            return Err(format!("tensor `{name}`: offset {offset} is not a multiple of the alignment {alignment}"));
        }
        let file_offset = data_offset.checked_add(offset);
        match file_offset.and_then(|s| s.checked_add(n_bytes)) {
            Some(end) if end <= bytes.len() => {}
            _ => {
                return Err(format!(
                    "tensor `{name}` ({n_bytes} bytes at data offset {offset}) extends past the end of the file ({} bytes)",
                    bytes.len()
                ))
            }
        }
        let file_offset = data_offset + offset;
        tensors.push(TensorInfo { name, ne, ggml_type, file_offset, n_bytes });
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(t) = tensors.iter().find(|t| !seen.insert(t.name.as_str())) {
        return Err(format!("tensor `{}` appears twice", t.name));
    }
    Ok(Parsed { version, metadata, tensors, alignment, data_offset })
}
