//! Bytes, checksums and durable file operations for checkpoints.

use std::fs::{self, File};
use std::hash::Hasher;
use std::io::Write;
use std::path::Path;
use tessera_core::file::{map_read_only, write_atomic, MappedSafetensors};
use tessera_core::tensor::{with_elem, DType, Tensor};
use tessera_core::Device;
use tessera_core::{Error, Result};

/// FNV-1a, 64 bit, of `bytes`, as 16 hex digits (the format of every
/// checksum a manifest records).
pub(crate) fn checksum(bytes: &[u8]) -> String {
    let mut h = fnv::FnvHasher::default();
    h.write(bytes);
    format!("{:016x}", h.finish())
}

/// The tensor's elements as little-endian bytes.
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    fn le<T: tessera_core::Element>(t: &Tensor) -> Result<Vec<u8>> {
        // Host byte order is little-endian on every platform Tessera runs on;
        // refuse to write anything else rather than produce unreadable files.
        if cfg!(target_endian = "big") {
            return Err(Error::unsupported("checkpoint", "big-endian hosts cannot write checkpoints; save on a little-endian machine"));
        }
        Ok(bytemuck::cast_slice(&t.to_vec::<T>()?).to_vec())
    }
    with_elem!(t.dtype(), T => le::<T>(t))
}

/// A tensor of `dtype` and `shape` on `device` from little-endian bytes.
pub(crate) fn tensor_from_bytes(bytes: &[u8], dtype: DType, shape: &[usize], device: &Device) -> Result<Tensor> {
    fn build<T: tessera_core::Element>(bytes: &[u8], shape: &[usize], device: &Device) -> Result<Tensor> {
        let data: Vec<T> = bytes.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect();
        Tensor::from_vec(data, shape.to_vec(), device)
    }
    with_elem!(dtype, T => build::<T>(bytes, shape, device))
}

/// The safetensors dtype of `d`.
pub(crate) fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F64 => safetensors::Dtype::F64,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
        DType::I32 => safetensors::Dtype::I32,
        DType::U32 => safetensors::Dtype::U32,
    }
}

/// The dtype named `name` in a manifest.
pub(crate) fn dtype_named(name: &str) -> Option<DType> {
    [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::U32].into_iter().find(|d| d.name() == name)
}

/// A checkpoint problem on `path` that is not the operating system's: what
/// was being done, and what went wrong or how to fix it.
pub(crate) fn ckpt_err(path: &Path, doing: &str, detail: impl std::fmt::Display) -> Error {
    Error::checkpoint(path, format!("{doing}: {detail}"))
}

/// An I/O error on `path`, with what was being done.
pub(crate) fn io_err(path: &Path, doing: &str, e: std::io::Error) -> Error {
    Error::checkpoint_io(path, doing, e)
}

/// Writes `bytes` to `path` and flushes them to the disk.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| io_err(path, "cannot create the file (is the directory writable?)", e))?;
    f.write_all(bytes).map_err(|e| io_err(path, "cannot write (is the disk full?)", e))?;
    f.sync_all().map_err(|e| io_err(path, "cannot flush to disk", e))
}

/// Replaces `path` with `bytes` atomically and durably (see [`write_atomic`]).
pub(crate) fn replace_file(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic(path, bytes).map_err(|e| io_err(path, "cannot replace the file (is the disk full?)", e))
}

/// Reads a whole file, naming it when it is missing.
pub(crate) fn read(path: &Path) -> Result<Vec<u8>> {
    fs::read(path).map_err(|e| io_err(path, "cannot read (missing or unreadable; the checkpoint is incomplete)", e))
}

/// Writes a safetensors file of `tensors` (key, dtype, shape, bytes), flushed to the disk.
pub(crate) fn write_safetensors(path: &Path, tensors: &[(String, DType, Vec<usize>, &[u8])]) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(key, dtype, shape, bytes)| {
            let view =
                safetensors::tensor::TensorView::new(st_dtype(*dtype), shape.clone(), bytes).map_err(|e| ckpt_err(path, &format!("tensor `{key}`"), e))?;
            Ok((key.as_str(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::tensor::serialize(views, None).map_err(|e| ckpt_err(path, "cannot serialise the tensors", e))?;
    write_synced(path, &bytes)
}

/// One rank file, memory-mapped, its header parsed once by the safetensors
/// reader: a tensor's bytes are read (and checksummed) when it is restored,
/// and the file is never copied into memory whole.
pub(crate) struct RankFile(MappedSafetensors);

impl RankFile {
    /// Maps and parses `path`; the tensors' bytes are not looked at.
    pub fn open(path: &Path) -> Result<RankFile> {
        let file = File::open(path).map_err(|e| io_err(path, "cannot read (missing or unreadable; the checkpoint is incomplete)", e))?;
        let map = map_read_only(&file).map_err(|e| io_err(path, "cannot memory-map the file", e))?;
        let tensors = MappedSafetensors::parse(map).map_err(|e| Error::CheckpointCorrupt {
            file: path.display().to_string(),
            tensor: "(header)".into(),
            detail: format!("the file's header is unreadable: {e}"),
        })?;
        Ok(RankFile(tensors))
    }

    /// The bytes of the tensor `r` describes, checked against its record
    /// (key, dtype, shape, checksum) without decoding them.
    pub fn tensor(&self, r: &super::TensorRecord, path: &Path) -> Result<&[u8]> {
        let corrupt = |detail: String| Error::CheckpointCorrupt { file: path.display().to_string(), tensor: r.name.clone(), detail };
        // The reader's only error here is a name the header lacks.
        let view = self.0.reader().tensor(&r.name).map_err(|_| corrupt("not found in the file".into()))?;
        let dtype = dtype_named(&r.dtype).ok_or_else(|| corrupt(format!("the manifest names an unknown dtype `{}`", r.dtype)))?;
        let shape = r.region.stored_shape();
        if view.shape() != shape || view.dtype() != st_dtype(dtype) {
            return Err(corrupt(format!("stored as {:?} {:?}, the manifest says {} {:?}", view.dtype(), view.shape(), r.dtype, shape)));
        }
        let data = view.data();
        let sum = checksum(data);
        if sum != r.checksum {
            return Err(corrupt(format!("checksum {sum}, the manifest recorded {}", r.checksum)));
        }
        Ok(data)
    }
}

#[cfg(test)]
mod tests {
    use super::{checksum, write_safetensors, RankFile};
    use crate::ckpt::Region;
    use crate::ckpt::TensorRecord;
    use tessera_core::tensor::DType;
    use tessera_core::Error;
    use tessera_optim::TensorKind;

    /// The record a manifest would hold of an f32 tensor `name` of `shape` holding `bytes`.
    fn record(name: &str, shape: &[usize], bytes: &[u8]) -> TensorRecord {
        TensorRecord {
            name: name.into(),
            param: name.into(),
            kind: TensorKind::Param,
            region: Region::whole(shape),
            dtype: DType::F32.name().into(),
            file: "rank.safetensors".into(),
            checksum: checksum(bytes),
            steps: None,
        }
    }

    /// The problem an error reports about which tensor, for a corrupt file.
    fn corrupt(e: Error) -> (String, String) {
        match e {
            Error::CheckpointCorrupt { tensor, detail, .. } => (tensor, detail),
            other => panic!("expected a corrupt-file error, got {other}"),
        }
    }

    /// The reader keeps pointing into the mapping when the `RankFile` that
    /// owns both moves (into a collection, as restoring does), and reports
    /// each kind of damage naming the tensor.
    #[test]
    fn rank_files_read_tensors_and_name_damage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rank.safetensors");
        let a: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let b: Vec<u8> = [7.0f32].iter().flat_map(|v| v.to_le_bytes()).collect();
        write_safetensors(&path, &[("a".into(), DType::F32, vec![2, 3], &a), ("b".into(), DType::F32, vec![1], &b)]).unwrap();

        let files = vec![RankFile::open(&path).unwrap()];
        let file = &files[0];
        assert_eq!(file.tensor(&record("a", &[2, 3], &a), &path).unwrap(), &a[..]);
        assert_eq!(file.tensor(&record("b", &[1], &b), &path).unwrap(), &b[..]);

        let (tensor, detail) = corrupt(file.tensor(&record("c", &[1], &b), &path).unwrap_err());
        assert_eq!((tensor.as_str(), detail.as_str()), ("c", "not found in the file"));
        let (_, detail) = corrupt(file.tensor(&record("a", &[3, 2], &a), &path).unwrap_err());
        assert!(detail.contains("stored as F32 [2, 3]"), "{detail}");
        let mut bf16 = record("a", &[2, 3], &a);
        bf16.dtype = DType::BF16.name().into();
        let (_, detail) = corrupt(file.tensor(&bf16, &path).unwrap_err());
        assert!(detail.contains("the manifest says bf16"), "{detail}");
        let (_, detail) = corrupt(file.tensor(&record("a", &[2, 3], &b), &path).unwrap_err());
        assert!(detail.contains("checksum"), "{detail}");
        drop(files);

        let whole = std::fs::read(&path).unwrap();
        for cut in [0, 4, 8, 20, whole.len() - 1] {
            std::fs::write(&path, &whole[..cut]).unwrap();
            let (tensor, detail) = corrupt(RankFile::open(&path).err().expect("a truncated file is refused"));
            assert_eq!(tensor, "(header)");
            assert!(detail.contains("header is unreadable"), "{detail}");
        }
    }

    /// Manifests already written hold these values: the checksum is part of
    /// the on-disk format (FNV-1a 64; reference values of the algorithm).
    #[test]
    fn checksums_are_fnv1a_64_as_written_in_manifests() {
        assert_eq!(checksum(b""), "cbf29ce484222325");
        assert_eq!(checksum(b"a"), "af63dc4c8601ec8c");
        assert_eq!(checksum(b"foobar"), "85944171f73967e8");
    }
}
