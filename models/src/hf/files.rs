//! The safetensors files of a Hugging Face checkpoint: reading tensors
//! (one `model.safetensors`, or the shards a `model.safetensors.index.json`
//! lists) and writing one file.

use crate::error::{Error, Result};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use tessera::file::{MappedSafetensors, Mmap};
use tessera::{bf16, f16, DType, Device, Tensor};

/// The single weights file Hugging Face writes for small models.
pub(crate) const WEIGHTS: &str = "model.safetensors";
/// The index of a checkpoint sharded over several files.
const INDEX: &str = "model.safetensors.index.json";

/// One weights file, memory-mapped, its header parsed once by the
/// safetensors reader (which checks it against the file: offsets in range,
/// shapes matching sizes).
fn open_mapped(path: &Path) -> Result<MappedSafetensors> {
    MappedSafetensors::parse(map(path)?).map_err(|e| file_err(path, format!("not a safetensors file: {e}")))
}

/// Every tensor of a checkpoint, its files memory-mapped: a tensor's bytes
/// are read from the page cache when it is loaded, and the checkpoint is
/// never copied into memory whole.
pub(crate) struct Weights {
    /// The weights file or the index, for messages.
    path: PathBuf,
    files: Vec<MappedSafetensors>,
    /// Each tensor's file (an index into `files`).
    entries: BTreeMap<String, usize>,
}

/// An I/O error on `path`, struck while `doing`.
pub(crate) fn io_err(path: &Path, doing: &'static str, source: std::io::Error) -> Error {
    Error::Io { path: path.display().to_string(), doing, source }
}

fn file_err(path: &Path, detail: impl Into<String>) -> Error {
    Error::File { path: path.display().to_string(), detail: detail.into() }
}

/// Reads a whole file, naming it when it is missing.
pub(crate) fn read(path: &Path) -> Result<Vec<u8>> {
    fs::read(path).map_err(|e| io_err(path, "cannot read it", e))
}

/// Maps a weights file into memory, read-only, naming it when it is missing.
fn map(path: &Path) -> Result<Mmap> {
    let file = fs::File::open(path).map_err(|e| io_err(path, "cannot read it", e))?;
    tessera::file::map_read_only(&file).map_err(|e| io_err(path, "cannot memory-map it", e))
}

impl Weights {
    /// The weights of the checkpoint in `dir`.
    pub fn open(dir: &Path) -> Result<Weights> {
        let single = dir.join(WEIGHTS);
        let index = dir.join(INDEX);
        if single.exists() || !index.exists() {
            let mut w = Weights { path: single.clone(), files: Vec::new(), entries: BTreeMap::new() };
            w.add_file(&single, None)?;
            return Ok(w);
        }
        let json: serde_json::Value = serde_json::from_slice(&read(&index)?).map_err(|e| file_err(&index, format!("not a JSON index: {e}")))?;
        let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| file_err(&index, "has no `weight_map` object (tensor name → file)"))?;
        let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| file_err(&index, format!("`weight_map` entry `{tensor}` is not a file name")))?;
            by_file.entry(file.to_string()).or_default().push(tensor.clone());
        }
        let mut w = Weights { path: index, files: Vec::new(), entries: BTreeMap::new() };
        for (file, tensors) in by_file {
            w.add_file(&dir.join(file), Some(&tensors))?;
        }
        Ok(w)
    }

    /// Maps `path` and records its tensors (only `listed` ones, for a shard of an index).
    fn add_file(&mut self, path: &Path, listed: Option<&[String]>) -> Result<()> {
        let mapped = open_mapped(path)?;
        let file = self.files.len();
        for name in mapped.reader().names() {
            if listed.is_some_and(|l| !l.iter().any(|t| t == name)) {
                continue;
            }
            self.entries.insert(name.to_string(), file);
        }
        if let Some(missing) = listed.and_then(|l| l.iter().find(|t| !self.entries.contains_key(*t))) {
            return Err(file_err(path, format!("the index places tensor `{missing}` in this file, which lacks it")));
        }
        self.files.push(mapped);
        Ok(())
    }

    /// The weights file (or index), for messages.
    pub fn path(&self) -> String {
        self.path.display().to_string()
    }

    /// The names of every tensor.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Checks that tensor `name` has `shape` and a dtype [`read`](Self::read) converts.
    pub fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.checked(name, shape).map(drop)
    }

    /// Tensor `name` as its file holds it, checked as [`check`](Self::check) does.
    fn checked(&self, name: &str, shape: &[usize]) -> Result<TensorView<'_>> {
        let missing = || file_err(&self.path, format!("has no tensor `{name}`"));
        let file = self.entries.get(name).and_then(|&f| self.files.get(f)).ok_or_else(missing)?;
        let view = file.reader().tensor(name).map_err(|_| missing())?;
        if view.shape() != shape {
            return Err(Error::TensorShape { path: self.path(), tensor: name.into(), expected: shape.to_vec(), got: view.shape().to_vec() });
        }
        match view.dtype() {
            Dtype::F32 | Dtype::F16 | Dtype::BF16 => Ok(view),
            other => Err(Error::TensorDtype { path: self.path(), tensor: name.into(), dtype: format!("{other:?}") }),
        }
    }

    /// Tensor `name`, checked to have `shape`, converted to `dtype` on `device`.
    pub fn read(&self, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        let view = self.checked(name, shape)?;
        let bytes = view.data();
        let stored = match view.dtype() {
            Dtype::F32 => Tensor::from_vec(decode(bytes, f32::from_le_bytes), shape, device)?,
            Dtype::F16 => Tensor::from_vec(decode(bytes, |b| f16::from_bits(u16::from_le_bytes(b))), shape, device)?,
            Dtype::BF16 => Tensor::from_vec(decode(bytes, |b| bf16::from_bits(u16::from_le_bytes(b))), shape, device)?,
            other => return Err(Error::TensorDtype { path: self.path(), tensor: name.into(), dtype: format!("{other:?}") }),
        };
        Ok(if stored.dtype() == dtype { stored } else { stored.to_dtype(dtype)? })
    }
}

/// Little-endian elements of `N` bytes each.
fn decode<T, const N: usize>(bytes: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    bytes.chunks_exact(N).map(|c| f(c.try_into().expect("chunks of N bytes"))).collect()
}

/// Writes `tensors` (name, f32 tensor) to `path` as a safetensors file with
/// the metadata Hugging Face expects of a PyTorch checkpoint.
pub(crate) fn write(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let bytes = t.to_f32_vec()?.iter().flat_map(|v| v.to_le_bytes()).collect();
        data.push((name.clone(), t.dims().to_vec(), bytes));
    }
    let views = data
        .iter()
        .map(|(n, shape, bytes)| TensorView::new(Dtype::F32, shape.clone(), bytes).map(|v| (n.as_str(), v)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_err(path, format!("cannot describe the tensors: {e}")))?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::tensor::serialize(views, Some(metadata)).map_err(|e| file_err(path, format!("cannot serialise the tensors: {e}")))?;
    replace_file(path, &bytes)
}

/// Replaces `path` with `bytes` atomically and durably, so a failed write
/// or a crash never leaves a truncated file behind (see
/// [`write_atomic`](tessera::file::write_atomic)).
pub(crate) fn replace_file(path: &Path, bytes: &[u8]) -> Result<()> {
    tessera::file::write_atomic(path, bytes).map_err(|e| io_err(path, "cannot write it (check free space and permissions)", e))
}
