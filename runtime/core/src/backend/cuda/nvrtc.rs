//! CUDA C kernel sources compiled to PTX at run time by NVRTC.
//!
//! Each source is compiled once per process (kept in memory) and once per
//! machine (kept on disk), keyed by a hash of the source, the compile
//! options, the target architecture and the NVRTC version, so an edited
//! kernel, another GPU or another NVRTC never gets a stale PTX. The disk
//! cache lives in `$TESSERA_KERNEL_CACHE` if set (`off` turns it off), else
//! in `$XDG_CACHE_HOME/tessera/kernels` or `~/.cache/tessera/kernels`. It is
//! only an accelerator: a cache that cannot be read or written costs a
//! compile, never an error.
//!
//! The kernel gate (`tests/cuda_kernels.rs`) compiles every kernel through
//! [`compile_ptx_uncached`], the function the runtime itself uses on a miss.

use super::device::ComputeCapability;
use crate::error::{Error, Result};
use cudarc::nvrtc::{CompileError, CompileOptions};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// The options every kernel is compiled with (besides the architecture).
/// Exact IEEE division and square root: the CPU backend is the reference the
/// GPU results are compared against.
const OPTIONS: &[&str] = &["--std=c++17", "--prec-div=true", "--prec-sqrt=true", "--fmad=true"];

/// The NVRTC library's version, `(major, minor)`; an error when it cannot be loaded.
pub fn version() -> Result<(i32, i32)> {
    static VERSION: OnceLock<std::result::Result<(i32, i32), String>> = OnceLock::new();
    VERSION
        .get_or_init(|| {
            // SAFETY: only opens and closes the library to see whether it loads.
            if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Err("libnvrtc.so.12 cannot be loaded".into());
            }
            let (mut major, mut minor) = (0, 0);
            // SAFETY: nvrtcVersion writes two ints through the pointers, which
            // point to live locals. cudarc panics if the symbol is missing.
            let status = catch_unwind(AssertUnwindSafe(|| unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }))
                .map_err(|_| "the NVRTC library lacks nvrtcVersion".to_string())?;
            status.result().map_err(|e| format!("nvrtcVersion failed: {e:?}"))?;
            Ok((major, minor))
        })
        .clone()
        .map_err(|detail| Error::NvrtcUnavailable { detail })
}

/// The PTX of `source` for `capability`, compiled at most once per process
/// and, with the disk cache on, once per machine. `name` names the source in
/// errors and cache files.
pub fn compile_ptx(name: &str, source: &str, capability: ComputeCapability) -> Result<Arc<str>> {
    compile_cached(name, source, capability, disk_cache_dir().as_deref())
}

fn compile_cached(name: &str, source: &str, capability: ComputeCapability, disk: Option<&Path>) -> Result<Arc<str>> {
    static MEMORY: OnceLock<Mutex<HashMap<u64, Arc<str>>>> = OnceLock::new();
    let key = cache_key(source, capability, version()?);
    let memory = MEMORY.get_or_init(Mutex::default);
    if let Some(ptx) = memory.lock().get(&key) {
        return Ok(ptx.clone());
    }
    let file = disk.map(|dir| dir.join(format!("{name}-{}-{key:016x}.ptx", capability.real_arch())));
    let ptx: Arc<str> = match file.as_deref().and_then(|f| std::fs::read_to_string(f).ok()) {
        Some(ptx) => ptx.into(),
        None => {
            let ptx = compile_ptx_uncached(name, source, capability)?;
            if let Some(f) = &file {
                write_atomically(f, &ptx);
            }
            ptx.into()
        }
    };
    // Two threads may both compile on a first miss; either result is the same PTX.
    memory.lock().insert(key, ptx.clone());
    Ok(ptx)
}

/// Compiles `source` to PTX for `capability` with NVRTC, every time.
pub fn compile_ptx_uncached(name: &str, source: &str, capability: ComputeCapability) -> Result<String> {
    version()?;
    let arch = capability.virtual_arch();
    let failed = |detail: String, log: String| Error::KernelCompile { kernel: name.to_string(), arch: arch.clone(), detail, log };
    if source.contains('\0') {
        return Err(failed("the source contains a NUL byte".into(), String::new()));
    }
    let options = CompileOptions {
        name: Some(format!("{name}.cu")),
        options: OPTIONS.iter().map(|o| o.to_string()).chain([format!("--gpu-architecture={arch}")]).collect(),
        ..Default::default()
    };
    let compiled = catch_unwind(AssertUnwindSafe(|| cudarc::nvrtc::compile_ptx_with_opts(source, options)))
        .map_err(|_| Error::NvrtcUnavailable { detail: "the NVRTC library lacks a function this build needs".into() })?;
    match compiled {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(CompileError::CompileError { nvrtc, log, .. }) => Err(failed(format!("{nvrtc:?}"), log.to_string_lossy().into_owned())),
        Err(e) => Err(failed(format!("{e:?}"), String::new())),
    }
}

/// Where compiled PTX is kept between processes, if anywhere.
pub fn disk_cache_dir() -> Option<PathBuf> {
    match std::env::var_os("TESSERA_KERNEL_CACHE") {
        Some(v) if v == "off" => None,
        Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => {
            let base = std::env::var_os("XDG_CACHE_HOME")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
            Some(base.join("tessera").join("kernels"))
        }
    }
}

/// A stable 64-bit FNV-1a hash of everything the PTX depends on. (The
/// standard library's hasher may change between Rust releases, and the disk
/// cache outlives a toolchain.)
fn cache_key(source: &str, capability: ComputeCapability, nvrtc: (i32, i32)) -> u64 {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    // Each part ends in 0xff (a byte no UTF-8 text holds), so parts cannot run together.
    let mut feed = |bytes: &[u8]| {
        h.write(bytes);
        h.write(&[0xff]);
    };
    feed(source.as_bytes());
    for o in OPTIONS {
        feed(o.as_bytes());
    }
    feed(capability.virtual_arch().as_bytes());
    feed(format!("nvrtc {}.{}", nvrtc.0, nvrtc.1).as_bytes());
    h.finish()
}

/// Writes `text` to `path` atomically, so a concurrent reader sees the whole
/// file or none. Failures are ignored: the cache only saves compiles.
fn write_atomically(path: &Path, text: &str) {
    let Some(dir) = path.parent() else { return };
    let _ = std::fs::create_dir_all(dir).and_then(|_| crate::file::write_atomic(path, text.as_bytes()));
}

#[cfg(test)]
mod tests {
    use super::*;

    const SM90: ComputeCapability = ComputeCapability { major: 9, minor: 0 };
    const KERNEL: &str = "extern \"C\" __global__ void twice(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= 2.0f; }";

    #[test]
    fn the_key_changes_with_source_arch_and_nvrtc() {
        let k = cache_key(KERNEL, SM90, (12, 8));
        assert_eq!(k, cache_key(KERNEL, SM90, (12, 8)));
        assert_ne!(k, cache_key(&format!("{KERNEL} "), SM90, (12, 8)));
        assert_ne!(k, cache_key(KERNEL, ComputeCapability { major: 8, minor: 0 }, (12, 8)));
        assert_ne!(k, cache_key(KERNEL, SM90, (12, 9)));
    }

    /// Compiles once, then finds the PTX in memory and on disk.
    #[test]
    fn compiled_ptx_is_cached_in_memory_and_on_disk() {
        if version().is_err() {
            crate::backend::cuda::report_skip("compiled_ptx_is_cached_in_memory_and_on_disk", "NVRTC not found (run scripts/cuda-toolchain.sh)");
            return;
        }
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("cache");
        let first = compile_cached("twice", KERNEL, SM90, Some(&dir)).unwrap();
        assert!(first.contains(".entry twice"), "{first}");
        let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(files.len(), 1, "{files:?}");
        assert_eq!(std::fs::read_to_string(&files[0]).unwrap(), *first);
        let again = compile_cached("twice", KERNEL, SM90, Some(&dir)).unwrap();
        assert!(Arc::ptr_eq(&first, &again), "the second request is served from memory");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_broken_kernel_is_a_typed_error_with_the_compiler_log() {
        if version().is_err() {
            crate::backend::cuda::report_skip("a_broken_kernel_is_a_typed_error_with_the_compiler_log", "NVRTC not found (run scripts/cuda-toolchain.sh)");
            return;
        }
        let e = compile_ptx_uncached("broken", "extern \"C\" __global__ void f(float* x) { x[0] = undefined_name; }", SM90).unwrap_err();
        match &e {
            Error::KernelCompile { kernel, arch, log, .. } => {
                assert_eq!((kernel.as_str(), arch.as_str()), ("broken", "compute_90"));
                assert!(log.contains("undefined_name"), "{log}");
            }
            other => panic!("expected KernelCompile, got {other}"),
        }
    }
}
