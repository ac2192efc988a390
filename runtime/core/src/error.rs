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

    /// A value (a size, rate, probability, count or option) is outside the
    /// range the operation accepts.
    #[error("{op}: invalid argument: {detail}")]
    InvalidArgument {
        /// The operation that refused its input.
        op: &'static str,
        /// What is wrong and how to fix it.
        detail: String,
    },

    /// A rank, root, peer or mesh coordinate names no member of the group
    /// or world it is used in (or names the calling rank where another
    /// rank is needed).
    #[error("{op}: {detail}")]
    NoSuchRank {
        /// The operation that refused its input.
        op: &'static str,
        /// Which rank, and the ranks there are.
        detail: String,
    },

    /// The ranks cannot be arranged as asked: a mesh that does not parse,
    /// degrees whose product is not the world, a group with no rank or a
    /// rank twice, a mesh, world and device list that do not fit together.
    #[error("{op}: {detail}")]
    Topology {
        /// The operation that refused its input.
        op: &'static str,
        /// What does not fit and how to fix it.
        detail: String,
    },

    /// A size cannot be split over the ranks of a parallel layout (a
    /// tensor-parallel degree that does not divide a dimension, an
    /// expert-parallel degree that does not divide the experts).
    #[error("{op}: {detail}")]
    Indivisible {
        /// The operation that refused its input.
        op: &'static str,
        /// Which sizes, over how many ranks, and how to fix it.
        detail: String,
    },

    /// A pipeline schedule is malformed (the checker found an action out of
    /// order, a missing computation, a send never received, a deadlock) or
    /// does not fit the model, ranks or inputs it is run with.
    #[error("{op}: {detail}")]
    Schedule {
        /// The operation that refused the schedule.
        op: &'static str,
        /// What is wrong and how to fix it.
        detail: String,
    },

    /// A parameter has no value on this rank: the model was not
    /// materialised, the parameter belongs to another pipeline stage, or a
    /// sharding engine holds it.
    #[error("{op}: {detail}")]
    ParamUnavailable {
        /// The operation that needed the value.
        op: &'static str,
        /// Which parameter, and why it has no value here.
        detail: String,
    },

    /// State handed to an object does not belong to it, or comes at a time
    /// it cannot take it: a backward given another forward's saved state, a
    /// restore with the wrong number of values, a parameter of another
    /// model, a restore while gradients are in flight.
    #[error("{op}: {detail}")]
    StateMismatch {
        /// The operation that refused the state.
        op: &'static str,
        /// What does not match and how to fix it.
        detail: String,
    },

    /// A tensor is not where, or not laid out how, the operation needs it:
    /// on the host where a device is needed (or on another device), or not
    /// contiguous.
    #[error("{op}: {detail}")]
    Placement {
        /// The operation that refused its input.
        op: &'static str,
        /// Where the tensor is, and where it must be.
        detail: String,
    },

    /// A valid request that this build, backend or engine does not carry
    /// out (a size beyond a kernel's index type, a big-endian host, a check
    /// that cannot compare what it was given).
    #[error("{op}: {detail}")]
    Unsupported {
        /// The operation that cannot do it.
        op: &'static str,
        /// What is not supported and what to do instead.
        detail: String,
    },

    /// A value that must be finite is NaN or infinite (a gradient norm, a
    /// loss): the step is unusable.
    #[error("{op}: {detail}")]
    NonFinite {
        /// The operation that found it.
        op: &'static str,
        /// Which value, and what to do.
        detail: String,
    },

    /// A rank's thread panicked: its panic message, printed above, is the
    /// cause.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The world rank whose thread panicked.
        rank: usize,
        /// The panic message, if it was a string.
        message: String,
    },

    /// A thread the runtime needs could not be started.
    #[error("cannot start the {what} thread: {source}")]
    Thread {
        /// What the thread is for.
        what: &'static str,
        /// Why the operating system refused.
        #[source]
        source: std::io::Error,
    },

    /// Training stopped improving in a way rollbacks could not cure.
    #[error("step {step}: {detail}")]
    Diverged {
        /// The step at which the run gave up.
        step: u64,
        /// What happened and what to change.
        detail: String,
    },

    /// The run would not fit in this machine's memory.
    #[error("{detail}")]
    InsufficientMemory {
        /// What the run needs, what there is, and what to change.
        detail: String,
    },

    /// The run directory is in use by another job.
    #[error("the run directory `{dir}` is in use by {holder}; wait for that job to finish or stop it, or give this run another `run.out`")]
    RunDirInUse {
        /// The run directory.
        dir: String,
        /// The job that holds it.
        holder: String,
    },

    /// An error with what the caller was doing when it struck; `source` is
    /// the error itself (match on [`Error::root`] to see through contexts).
    #[error("{context}: {source}")]
    Context {
        /// What was being done.
        context: String,
        /// The error that struck.
        #[source]
        source: Box<Error>,
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

    /// A launcher's environment variable (`RANK`, `WORLD_SIZE`,
    /// `SLURM_PROCID`, `OMPI_COMM_WORLD_RANK`, `MASTER_ADDR`, ...) is
    /// missing, malformed, or inconsistent with another: this process cannot
    /// tell its place among the ranks of the job.
    #[error("environment variable `{var}`: {detail}")]
    Environment {
        /// The variable (or variables) concerned, as the launcher names them.
        var: String,
        /// The value found, what is wrong with it, and how to fix it.
        detail: String,
    },

    /// The rendezvous through which the ranks of a multi-process job find
    /// each other failed: the store served by rank 0 could not be bound or
    /// reached, its connection was lost, or the ranks disagree (on the world
    /// size, or a rank started twice) or did not all arrive in time.
    #[error("rendezvous store at {addr}: {detail}")]
    Rendezvous {
        /// The store's address, `host:port`.
        addr: String,
        /// What went wrong, and how to fix it.
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

    /// A checkpoint file or directory could not be written or read: the
    /// operating system's error is the source (its message is repeated, so
    /// that it survives the trip to other ranks as text).
    #[error("checkpoint `{path}`: {doing}: {source}")]
    CheckpointIo {
        /// The file or directory concerned.
        path: String,
        /// What was being done, with a hint at the usual cause.
        doing: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
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
    /// could not be written or read. The message repeats the operating
    /// system's, so that it survives the trip to other ranks as text.
    #[error("`{path}`: {source}")]
    Io {
        /// The file or directory concerned.
        path: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
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

    /// A data file or directory (text, tokenizer, shard or index) could not
    /// be read or written: the operating system's error is the source.
    #[error("data file `{path}`: {doing} ({source}){hint}")]
    DataFileIo {
        /// The file or directory concerned.
        path: String,
        /// What was being done (`cannot be read`).
        doing: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
        /// Advice appended to the message (starting with `; `), or empty.
        hint: String,
    },

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

/// The message of a caught panic: its payload when that is a string (as
/// `panic!` makes it), else a placeholder.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "(a panic without a message; see the output above)".to_string(),
    }
}

/// Result with the runtime's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::Io`] on `path`.
    pub fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        Error::Io { path: path.display().to_string(), source }
    }

    /// An [`Error::CheckpointIo`] on `path`, struck while `doing`.
    pub fn checkpoint_io(path: &std::path::Path, doing: impl Into<String>, source: std::io::Error) -> Self {
        Error::CheckpointIo { path: path.display().to_string(), doing: doing.into(), source }
    }

    /// An [`Error::Checkpoint`] on `path`.
    pub fn checkpoint(path: &std::path::Path, detail: impl Into<String>) -> Self {
        Error::Checkpoint { path: path.display().to_string(), detail: detail.into() }
    }

    /// This error with what the caller was doing: an [`Error::Context`].
    pub fn context(self, context: impl Into<String>) -> Self {
        Error::Context { context: context.into(), source: Box::new(self) }
    }

    /// The error under any [`Error::Context`] layers: what to match on.
    pub fn root(&self) -> &Error {
        match self {
            Error::Context { source, .. } => source.root(),
            e => e,
        }
    }

    /// An [`Error::Config`] for `key`.
    pub fn config(key: impl Into<String>, detail: impl Into<String>) -> Self {
        Error::Config { key: key.into(), detail: detail.into() }
    }

    /// An [`Error::Environment`] for the launcher variable `var`.
    pub fn environment(var: impl Into<String>, detail: impl Into<String>) -> Self {
        Error::Environment { var: var.into(), detail: detail.into() }
    }

    /// An [`Error::Rendezvous`] with the store at `addr`.
    pub fn rendezvous(addr: impl Into<String>, detail: impl Into<String>) -> Self {
        Error::Rendezvous { addr: addr.into(), detail: detail.into() }
    }

    /// An [`Error::Shape`] of operation `op`.
    pub fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Shape { op, detail: detail.into() }
    }

    /// An [`Error::DataFile`] for `path`.
    pub fn data_file(path: &std::path::Path, detail: impl Into<String>) -> Self {
        Error::DataFile { path: path.display().to_string(), detail: detail.into() }
    }

    /// An [`Error::DataFileIo`] for `path`; `hint`, if not empty, starts with `; `.
    pub fn data_file_io(path: &std::path::Path, doing: &'static str, source: std::io::Error, hint: impl Into<String>) -> Self {
        Error::DataFileIo { path: path.display().to_string(), doing, source, hint: hint.into() }
    }

    /// An [`Error::InvalidArgument`] of operation `op`.
    pub fn invalid(op: &'static str, detail: impl Into<String>) -> Self {
        Error::InvalidArgument { op, detail: detail.into() }
    }

    /// An [`Error::NoSuchRank`] of operation `op`.
    pub fn no_such_rank(op: &'static str, detail: impl Into<String>) -> Self {
        Error::NoSuchRank { op, detail: detail.into() }
    }

    /// An [`Error::Topology`] of operation `op`.
    pub fn topology(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Topology { op, detail: detail.into() }
    }

    /// An [`Error::Indivisible`] of operation `op`.
    pub fn indivisible(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Indivisible { op, detail: detail.into() }
    }

    /// An [`Error::Schedule`] of operation `op`.
    pub fn schedule(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Schedule { op, detail: detail.into() }
    }

    /// An [`Error::ParamUnavailable`] of operation `op`.
    pub fn param_unavailable(op: &'static str, detail: impl Into<String>) -> Self {
        Error::ParamUnavailable { op, detail: detail.into() }
    }

    /// An [`Error::StateMismatch`] of operation `op`.
    pub fn state_mismatch(op: &'static str, detail: impl Into<String>) -> Self {
        Error::StateMismatch { op, detail: detail.into() }
    }

    /// An [`Error::Placement`] of operation `op`.
    pub fn placement(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Placement { op, detail: detail.into() }
    }

    /// An [`Error::Unsupported`] of operation `op`.
    pub fn unsupported(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Unsupported { op, detail: detail.into() }
    }

    /// An [`Error::NonFinite`] of operation `op`.
    pub fn non_finite(op: &'static str, detail: impl Into<String>) -> Self {
        Error::NonFinite { op, detail: detail.into() }
    }
}
