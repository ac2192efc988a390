//! The runtime's typed errors.
//!
//! Every error says what is wrong and, where there is one, how to fix it: a
//! mistake in user input must never surface as a panic.

use crate::tensor::{DType, Shape};

/// Errors of the Tessera runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Two operands (or an operand and a requested shape) do not fit together.
    #[error("{op}: shape mismatch: {detail}")]
    Shape {
        /// The operation that refused its input.
        op: &'static str,
        /// What is wrong and how to fix it.
        detail: String,
    },

    /// An operand has a dtype the operation does not take.
    #[error("{op}: expected dtype {expected}, got {got}{hint}")]
    DType {
        /// The operation that refused its input.
        op: &'static str,
        /// The dtype (or dtypes) the operation takes.
        expected: String,
        /// The dtype it was given.
        got: DType,
        /// Advice appended to the message (starting with `; `), or empty.
        hint: &'static str,
    },

    /// Operands live on different devices.
    #[error("{op}: operands are on different devices ({lhs} and {rhs}); move one with `to_device` first")]
    DeviceMismatch {
        /// The operation that refused its input.
        op: &'static str,
        /// The device of one operand.
        lhs: String,
        /// The device of the other operand.
        rhs: String,
    },

    /// A scalar argument is outside the range the operation accepts.
    #[error("{op}: invalid argument: {detail}")]
    InvalidArgument {
        /// The operation that refused its input.
        op: &'static str,
        /// What is wrong and how to fix it.
        detail: String,
    },

    /// An index (token id, target, position) is outside the table it indexes.
    #[error("{op}: index {index} at position {position} is out of range 0..{bound}{hint}")]
    IndexOutOfRange {
        /// The operation that refused its input.
        op: &'static str,
        /// The offending index.
        index: u64,
        /// Where the index is in its input.
        position: usize,
        /// The size of the table: indices must be below it.
        bound: u64,
        /// Advice appended to the message (starting with `; `), or empty.
        hint: &'static str,
    },

    /// The operation needs a contiguous tensor whose layout cannot be viewed that way.
    #[error("{op}: cannot view a tensor of shape {shape} with strides {strides:?} as {target}; call `contiguous()` first")]
    NotViewable {
        /// The operation that refused its input.
        op: &'static str,
        /// The tensor's shape.
        shape: Shape,
        /// The tensor's strides, in elements.
        strides: Vec<usize>,
        /// The shape it was to be viewed as.
        target: Shape,
    },

    /// A CUDA device was asked for but this build has no CUDA backend.
    #[error("this build of Tessera has no CUDA backend; rebuild with `--features cuda` (no CUDA toolkit is needed to build) or use `Device::cpu()`")]
    NotCompiledWithCuda,

    /// A CUDA device was asked for but cannot be used: the driver library
    /// cannot be loaded, no GPU is visible, or the ordinal is out of range.
    #[error("CUDA device {ordinal} is not available: {reason}; use `Device::cpu()`, or run on a machine with an NVIDIA GPU and driver")]
    CudaUnavailable {
        /// The CUDA ordinal asked for.
        ordinal: usize,
        /// Why the device cannot be used.
        reason: String,
    },

    /// A CUDA driver call failed on a device that was opened.
    #[error("cuda:{ordinal}: {op} failed: {detail}")]
    Cuda {
        /// The CUDA ordinal of the device.
        ordinal: usize,
        /// The operation that failed.
        op: &'static str,
        /// What the driver reported.
        detail: String,
    },

    /// A CUDA allocation failed even after the allocator released its cached blocks.
    #[error("cuda:{ordinal}: out of memory allocating {requested} bytes ({in_use} bytes in use by tensors); free tensors, use a smaller batch, or turn on recompute or ZeRO")]
    CudaOutOfMemory {
        /// The CUDA ordinal of the device.
        ordinal: usize,
        /// Bytes the failed allocation asked for.
        requested: usize,
        /// Bytes held by tensors when it failed.
        in_use: usize,
    },

    /// The CUDA backend does not implement this operation yet.
    #[error("{op} is not yet implemented on CUDA; run it on `Device::cpu()` for now")]
    NotImplementedOnCuda {
        /// The operation the CUDA backend lacks.
        op: &'static str,
    },

    /// The NCCL library, which CUDA ranks communicate through, cannot be
    /// loaded or lacks functions this build needs.
    #[error("NCCL is not available: {detail}; install NCCL 2.x (libnccl.so.2, e.g. from the `nvidia-nccl-cu12` wheel) and put its directory on LD_LIBRARY_PATH, or run the ranks on CPU devices with the in-process communicator")]
    NcclUnavailable {
        /// Why the library cannot be used.
        detail: String,
    },

    /// An NCCL call failed on a device whose communicator was created.
    #[error("cuda:{ordinal}: NCCL {op} failed: {detail}")]
    Nccl {
        /// The CUDA ordinal of the device.
        ordinal: usize,
        /// The operation that failed.
        op: &'static str,
        /// What NCCL reported.
        detail: String,
    },

    /// The NVRTC library, which compiles the CUDA kernels at run time, cannot be loaded.
    #[error("NVRTC is not available: {detail}; install the CUDA toolkit's NVRTC (or the `nvidia-cuda-nvrtc-cu12` wheel, see docs/cuda.md) and put the directory of libnvrtc.so.12 on LD_LIBRARY_PATH")]
    NvrtcUnavailable {
        /// Why the library cannot be used.
        detail: String,
    },

    /// NVRTC rejected a kernel source: `log` is its compiler output.
    #[error("compiling CUDA kernels `{kernel}` for {arch} failed: {detail}\n{log}")]
    KernelCompile {
        /// The name of the kernel source.
        kernel: String,
        /// The architecture compiled for (`compute_90`).
        arch: String,
        /// What NVRTC reported.
        detail: String,
        /// NVRTC's compiler output (may be empty).
        log: String,
    },

    /// A parallel run of a model (or its backward) does not compute what one
    /// rank (or finite differences) computes: every disagreement found by
    /// `tessera::testing::check_parallel`, one a line.
    #[error("the parallel runs disagree with the single-rank model:\n{0}")]
    ParallelMismatch(String),

    /// An in-place update was given the same tensor for two roles.
    #[error("{op}: `{a}` and `{b}` share storage; pass distinct tensors")]
    Aliased {
        /// The operation that refused its input.
        op: &'static str,
        /// The role of one operand.
        a: &'static str,
        /// The role of the operand that shares its storage.
        b: &'static str,
    },

    /// Another rank of a communicator's group failed (aborted, panicked,
    /// dropped its communicator or gave up waiting), so no collective
    /// involving it can complete. `rank` is the failed rank's world rank.
    #[error("rank {rank} failed: {reason}; this rank's collectives cannot complete. The failed rank's own error or panic message is the root cause, errors on the other ranks are consequences of it")]
    PeerFailed {
        /// The failed rank's world rank.
        rank: usize,
        /// Why it failed: its own error or panic message.
        reason: String,
    },

    /// A multi-rank run failed: rank `rank`'s failure, which stopped the
    /// others, is the root cause (what the trainer reports when that rank's
    /// own error reached the others only as its reason).
    #[error("rank {rank} failed: {reason}")]
    RankFailed {
        /// The world rank whose failure stopped the others.
        rank: usize,
        /// That rank's own error.
        reason: String,
    },

    /// A failure the run's `[faults]` section asked for struck rank `rank`.
    #[error("rank {rank}: {detail} (injected by the `[faults]` section of the configuration)")]
    FaultInjected {
        /// The rank the fault struck.
        rank: usize,
        /// What the fault did.
        detail: String,
    },

    /// A collective or receive waited longer than the communicator's timeout.
    #[error("{op} timed out after {waited:?}: {detail}; check that every rank of the group issues the same collectives in the same order (a rank that skips one leaves the others waiting), or raise the timeout if a rank is legitimately that slow")]
    Timeout {
        /// The collective or receive that timed out.
        op: &'static str,
        /// How long it waited.
        waited: std::time::Duration,
        /// Which rank it waited for, and for what.
        detail: String,
    },

    /// The ranks of a group called different collectives, or the same one
    /// with incompatible arguments.
    #[error("{op}: the ranks of the group disagree: {detail}; every rank must issue the same collectives in the same order, with matching dtypes, shapes and arguments")]
    CollectiveMismatch {
        /// The collective the ranks disagree on.
        op: &'static str,
        /// How the ranks' calls differ.
        detail: String,
    },

    /// A checkpoint could not be written or read: a file or directory is
    /// missing or unwritable, or a manifest is malformed. `path` names it.
    #[error("checkpoint `{path}`: {detail}")]
    Checkpoint {
        /// The file or directory concerned.
        path: String,
        /// What is wrong and how to fix it.
        detail: String,
    },

    /// A tensor stored in a checkpoint does not match the checksum recorded
    /// for it when it was written: the file was damaged after the write.
    #[error("checkpoint file `{file}`: tensor `{tensor}` is corrupt ({detail}); the file changed after it was written: restore it from a copy, or fall back to the previous checkpoint with `load_latest_valid`")]
    CheckpointCorrupt {
        /// The file holding the tensor.
        file: String,
        /// The name of the corrupt tensor.
        tensor: String,
        /// How the tensor fails its check.
        detail: String,
    },

    /// A checkpoint's manifest has a format version this build does not read.
    #[error("checkpoint `{path}`: {}", format_advice(*.found, *.supported))]
    CheckpointFormat {
        /// The file or directory concerned.
        path: String,
        /// The format version the manifest names, if any.
        found: Option<u32>,
        /// The newest format version this build reads.
        supported: u32,
    },

    /// A checkpoint does not fit the model (or optimizer, or mesh) it is loaded into.
    #[error("checkpoint `{path}` does not fit this model: {detail}")]
    CheckpointMismatch {
        /// The file or directory concerned.
        path: String,
        /// What is wrong and how to fix it.
        detail: String,
    },

    /// A file the run writes or reads (metrics, trace, plot, run directory)
    /// could not be written or read.
    #[error("`{path}`: {detail}")]
    Io {
        /// The file or directory concerned.
        path: String,
        /// The underlying error.
        detail: String,
    },

    /// A training configuration is malformed or inconsistent. `key` names
    /// the setting (as written in the TOML file) and `detail` the fix.
    #[error("config `{key}`: {detail}")]
    Config {
        /// The setting, as written in the TOML file.
        key: String,
        /// What is wrong and how to fix it.
        detail: String,
    },

    /// Training data cannot be used as asked: a text the tokenizer cannot
    /// encode, a token outside the vocabulary, a sampler whose batch does
    /// not fit the data, a cursor from another dataset.
    #[error("data: {0}")]
    Data(String),

    /// A data file (text, tokenizer, shard or index) is missing, unreadable,
    /// truncated or malformed. `path` names it.
    #[error("data file `{path}`: {detail}")]
    DataFile {
        /// The file or directory concerned.
        path: String,
        /// What is wrong and how to fix it.
        detail: String,
    },
}

/// What an unreadable manifest format version means and what to do.
fn format_advice(found: Option<u32>, supported: u32) -> String {
    match found {
        None => format!("the manifest names no format version (it is not a Tessera manifest); this build reads formats 2 to {supported}"),
        Some(f) if f < supported => {
            format!("manifest format {f} was written by an older Tessera; this build reads formats 2 to {supported} only: load it with the release that wrote it and save it again")
        }
        Some(f) => format!("manifest format {f} was written by a newer Tessera; this build reads formats 2 to {supported} only: upgrade Tessera to load it"),
    }
}

/// Result with the runtime's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::Io`] on `path`.
    pub fn io(path: &std::path::Path, e: impl std::fmt::Display) -> Self {
        Error::Io { path: path.display().to_string(), detail: e.to_string() }
    }

    /// An [`Error::Config`] for `key`.
    pub fn config(key: impl Into<String>, detail: impl Into<String>) -> Self {
        Error::Config { key: key.into(), detail: detail.into() }
    }

    /// An [`Error::Shape`] of operation `op`.
    pub fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Shape { op, detail: detail.into() }
    }

    /// An [`Error::DataFile`] for `path`.
    pub fn data_file(path: &std::path::Path, detail: impl Into<String>) -> Self {
        Error::DataFile { path: path.display().to_string(), detail: detail.into() }
    }

    /// An [`Error::InvalidArgument`] of operation `op`.
    pub fn invalid(op: &'static str, detail: impl Into<String>) -> Self {
        Error::InvalidArgument { op, detail: detail.into() }
    }
}
