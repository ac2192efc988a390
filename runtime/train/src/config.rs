//! The TOML configuration of a training run.
//!
//! Every section has defaults, so an empty file is a valid (small) run;
//! unknown keys are errors (a misspelt setting must not be silently
//! ignored). Settings can be overridden from the command line as dotted
//! `key=value` pairs (`mesh.dp=4`, `optim.lr=1e-3`), applied to the TOML
//! document before it is read, so an override is checked like the file.
//!
//! ```
//! use tessera::train::TrainConfig;
//!
//! let cfg = TrainConfig::parse("[mesh]\ndp = 2\npp = 2\n[batch]\ngrad_accum = 4\n", &["optim.lr=1e-3"])?;
//! assert_eq!((cfg.mesh.dp, cfg.mesh.pp, cfg.batch.grad_accum), (2, 2, 4));
//! assert_eq!(cfg.optim.lr, 1e-3);
//! assert!(TrainConfig::parse("[mesh]\ndp = 0\n", &[]).is_err());
//! # Ok::<(), tessera::Error>(())
//! ```
//!
//! The `[model]` table is free-form: the program that builds the model
//! reads it (see the `train` example), so the runtime stays model-agnostic.

use super::FaultConfig;
use serde::{Deserialize, Serialize};
use std::path::Path;
use tessera_core::DType;
use tessera_core::{Error, Result};
use tessera_nn::module::{Fp8Recipe, RecomputeOverride};
use tessera_optim::AdamWConfig;
use tessera_parallel::data::Compression;
use tessera_parallel::local_sgd::OuterConfig;
use tessera_parallel::pipeline::ScheduleKind;
use tessera_parallel::zero::Stage;

/// A whole training run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Run length, output directory, seed, logging.
    pub run: RunConfig,
    /// The model, read by the program that builds it.
    pub model: toml::Table,
    /// The device mesh.
    pub mesh: MeshConfig,
    /// Batch shape and gradient accumulation.
    pub batch: BatchConfig,
    /// AdamW, learning-rate schedule and clipping.
    pub optim: OptimConfig,
    /// Mixed precision and loss scaling.
    pub precision: PrecisionConfig,
    /// Activation recompute.
    pub recompute: RecomputeConfig,
    /// ZeRO sharding of optimizer state, gradients and parameters.
    pub zero: ZeroSection,
    /// Local SGD / DiLoCo: replicas that meet every few steps.
    pub local_sgd: LocalSgdConfig,
    /// Checkpoints.
    pub checkpoint: CheckpointConfig,
    /// Training data.
    pub data: DataConfig,
    /// Spike and NaN detection, rollback.
    pub stability: StabilityConfig,
    /// Failures to inject on purpose (none by default; see [`FaultConfig`]).
    #[serde(skip_serializing_if = "FaultConfig::is_empty")]
    pub faults: FaultConfig,
}

/// `[run]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunConfig {
    /// Optimizer steps (the learning-rate schedule spans them).
    pub steps: u64,
    /// Stop (with a checkpoint) after this many steps, for a run split over
    /// several jobs; a later job with `checkpoint.resume` continues it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_after: Option<u64>,
    /// Run directory: config, metrics, trace, plot and checkpoints go there.
    pub out: String,
    /// Seed of parameter initialisation, dropout and data order.
    pub seed: u64,
    /// Show a progress bar.
    pub progress: bool,
    /// Record a Chrome/Perfetto trace of the first `trace_steps` steps (0: none).
    pub trace_steps: u64,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig { steps: 100, stop_after: None, out: "runs/latest".into(), seed: 1, progress: true, trace_steps: 3 }
    }
}

/// `[mesh]`: degrees of each parallelism; their product is the number of ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MeshConfig {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Expert-parallel degree (MoE models).
    pub ep: usize,
    /// Context-parallel degree: every sequence split over `cp` ranks, which
    /// pass keys and values around a ring in each attention layer (ring
    /// attention, load-balanced over causal work). `batch.seq_len` must
    /// divide by `2 · cp`.
    pub cp: usize,
    /// Sequence parallelism over the tensor-parallel group.
    pub sp: bool,
    /// With `sp`, 2 or more overlaps the tensor-parallel collectives with
    /// the products beside them: each all-gather runs while the product of
    /// the rank's own slice does, each reduce-scatter is cut into this many
    /// pieces, one travelling while the next piece's product runs (1: whole
    /// collectives, no overlap).
    pub tp_overlap: usize,
    /// Pipeline schedule: `gpipe`, `1f1b`, `interleaved` (with `chunks`) or
    /// `zb-h1` (1F1B with the backward split and the weight halves filling
    /// the bubble).
    pub schedule: String,
    /// Model chunks per stage for the interleaved schedule.
    pub chunks: usize,
    /// Data-parallel gradient bucket size in bytes.
    pub bucket_bytes: usize,
    /// How data-parallel gradients travel: `none` (their own dtype),
    /// `bf16` (half the bytes of f32), or `powersgd` (each weight matrix as
    /// two rank-`powersgd_rank` factors with error feedback, sent after the
    /// backward). Not with ZeRO, which reduce-scatters gradients itself.
    pub grad_compression: String,
    /// The rank of PowerSGD's factors.
    pub powersgd_rank: usize,
    /// Steps PowerSGD sends whole before it compresses (the start of
    /// training, when gradients change fastest).
    pub powersgd_warmup: u64,
    /// Where the ranks run: `cpu` (a thread per rank, the in-process
    /// communicator) or `cuda` (rank `r` on GPU `r`, a thread per GPU,
    /// NCCL between them).
    pub device: String,
    /// Seconds a rank waits for another (at a collective, or for its part
    /// of a checkpoint) before declaring it hung and stopping the run.
    pub timeout_s: f64,
    /// How the ranks are started: `auto` (processes when a launcher's
    /// environment is present, `tessera launch`, torchrun, Slurm or
    /// mpirun; threads otherwise), `threads` (one process, a thread per
    /// rank) or `processes` (this process is one rank of a launched job).
    pub launch: String,
    /// Whether a job of processes may run on another number of ranks than
    /// the mesh has (an elastic restart after a node was lost): the
    /// data-parallel degree follows the number of processes, and the
    /// gradient accumulation keeps the global batch.
    pub elastic: bool,
    /// How the processes of a launched job communicate: `tcp` (Tessera's
    /// own connections, found through the rendezvous store) or `mpi` (the
    /// job's MPI library, for jobs started by `mpirun` or `srun`; needs a
    /// build with the `mpi` feature). Threads ignore it.
    pub comm: String,
}

impl Default for MeshConfig {
    fn default() -> Self {
        MeshConfig {
            dp: 1,
            tp: 1,
            pp: 1,
            ep: 1,
            cp: 1,
            sp: false,
            tp_overlap: 1,
            schedule: "1f1b".into(),
            chunks: 2,
            bucket_bytes: 1 << 20,
            grad_compression: "none".into(),
            powersgd_rank: 4,
            powersgd_warmup: 0,
            device: "cpu".into(),
            timeout_s: 600.0,
            launch: "auto".into(),
            elastic: false,
            comm: "tcp".into(),
        }
    }
}

/// How a run's ranks are started ([`MeshConfig::launch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchMode {
    /// Processes when a launcher's environment is present, threads otherwise.
    Auto,
    /// A thread per rank in this process.
    Threads,
    /// This process is one rank of a job a launcher started.
    Processes,
}

/// How the processes of a job communicate ([`MeshConfig::comm`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessComms {
    /// Tessera's TCP connections.
    Tcp,
    /// The job's MPI library.
    Mpi,
}

/// Where a run's ranks execute ([`MeshConfig::device`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankDevice {
    /// One CPU thread per rank.
    Cpu,
    /// Rank `r` on CUDA device `r`.
    Cuda,
}

impl MeshConfig {
    /// Ranks in all.
    pub fn world_size(&self) -> usize {
        self.dp * self.cp * self.tp * self.pp * self.ep
    }

    /// The mesh as [`Mesh::parse`](tessera_dist::mesh::Mesh::parse) reads it.
    pub fn spec(&self) -> String {
        format!("dp{},cp{},ep{},pp{},tp{}", self.dp, self.cp, self.ep, self.pp, self.tp)
    }

    /// [`timeout_s`](Self::timeout_s) as a duration.
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.timeout_s)
    }

    /// Where the ranks run.
    pub fn rank_device(&self) -> Result<RankDevice> {
        match self.device.as_str() {
            "cpu" => Ok(RankDevice::Cpu),
            "cuda" => Ok(RankDevice::Cuda),
            other => Err(Error::config("mesh.device", format!("unknown device `{other}`; use `cpu` (a thread per rank) or `cuda` (rank r on GPU r)"))),
        }
    }

    /// The data-parallel degree and gradient accumulation that run this
    /// mesh on `world` ranks with the same global batch ([`elastic`](Self::elastic)),
    /// given `grad_accum` microbatches per step now; an error naming what
    /// does not divide.
    pub fn resized(&self, world: usize, grad_accum: usize) -> Result<(usize, usize)> {
        let model = self.tp * self.pp * self.ep * self.cp;
        let fix = "start a number of processes that is a multiple of tp × pp × ep × cp, such that the data-parallel degree divides dp × batch.grad_accum";
        if world == 0 || !world.is_multiple_of(model) {
            return Err(Error::config(
                "mesh.elastic",
                format!(
                    "{world} processes cannot hold whole model replicas of tp{} × pp{} × ep{} × cp{} = {model} ranks; {fix}",
                    self.tp, self.pp, self.ep, self.cp
                ),
            ));
        }
        let dp = world / model;
        let microbatches = self.dp * grad_accum;
        if !microbatches.is_multiple_of(dp) {
            return Err(Error::config(
                "mesh.elastic",
                format!("the global batch of dp{} × {grad_accum} microbatches cannot be split over {dp} data-parallel replicas; {fix}", self.dp),
            ));
        }
        Ok((dp, microbatches / dp))
    }

    /// How the ranks are started ([`launch`](Self::launch)).
    pub fn launch_mode(&self) -> Result<LaunchMode> {
        match self.launch.as_str() {
            "auto" => Ok(LaunchMode::Auto),
            "threads" => Ok(LaunchMode::Threads),
            "processes" => Ok(LaunchMode::Processes),
            other => Err(Error::config(
                "mesh.launch",
                format!("unknown launch `{other}`; use `auto` (processes under a launcher, threads otherwise), `threads` or `processes`"),
            )),
        }
    }

    /// How the processes of a job communicate ([`comm`](Self::comm)).
    pub fn process_comms(&self) -> Result<ProcessComms> {
        match self.comm.as_str() {
            "tcp" => Ok(ProcessComms::Tcp),
            "mpi" if cfg!(feature = "mpi") => Ok(ProcessComms::Mpi),
            "mpi" => Err(Error::config(
                "mesh.comm",
                "`mpi` needs a build with the `mpi` feature (`--features mpi`, and MPI installed; see docs/launch.md), or use `tcp`",
            )),
            other => Err(Error::config("mesh.comm", format!("unknown comm `{other}`; use `tcp` (Tessera's connections) or `mpi` (the job's MPI library)"))),
        }
    }

    /// How data-parallel gradients travel ([`grad_compression`](Self::grad_compression)).
    pub fn compression(&self) -> Result<Compression> {
        match self.grad_compression.as_str() {
            "none" => Ok(Compression::None),
            "bf16" => Ok(Compression::Bf16),
            "powersgd" if self.powersgd_rank == 0 => Err(Error::config("mesh.powersgd_rank", "must be at least 1 (1 to 4 is the usual range)")),
            "powersgd" => Ok(Compression::PowerSgd { rank: self.powersgd_rank, warmup: self.powersgd_warmup }),
            other => Err(Error::config("mesh.grad_compression", format!("unknown compression `{other}`; use `none`, `bf16` or `powersgd`"))),
        }
    }

    /// The pipeline schedule family.
    pub fn schedule_kind(&self) -> Result<ScheduleKind> {
        match self.schedule.as_str() {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "interleaved" => Ok(ScheduleKind::Interleaved { chunks: self.chunks }),
            "zb-h1" => Ok(ScheduleKind::ZeroBubbleH1),
            other => Err(Error::config("mesh.schedule", format!("unknown schedule `{other}`; use `gpipe`, `1f1b`, `interleaved` or `zb-h1`"))),
        }
    }
}

/// `[batch]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BatchConfig {
    /// Sequences per microbatch.
    pub micro_batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Microbatches per replica and optimizer step (gradient accumulation;
    /// also the pipeline's microbatches).
    pub grad_accum: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig { micro_batch: 8, seq_len: 64, grad_accum: 2 }
    }
}

/// `[optim]`: AdamW with linear warmup and cosine decay, and clipping.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Warmup steps (a run shorter than that warms up over all its steps).
    pub warmup: u64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Global gradient-norm clipping threshold (0: off).
    pub clip: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig { lr: 1e-3, min_lr: 1e-4, warmup: 10, weight_decay: 0.1, beta1: 0.9, beta2: 0.95, eps: 1e-8, clip: 1.0 }
    }
}

impl OptimConfig {
    /// The AdamW hyper-parameters.
    pub fn adamw(&self) -> AdamWConfig {
        AdamWConfig { beta1: self.beta1, beta2: self.beta2, eps: self.eps, weight_decay: self.weight_decay }
    }
}

/// `[precision]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrecisionConfig {
    /// Compute dtype: `f32`, `bf16` or `fp16` (master weights stay f32).
    pub compute: String,
    /// What the parameters and their gradients are held in under `bf16` or
    /// `fp16`: `compute` (the compute dtype, with f32 master weights and
    /// moments in the optimizer: 16 bytes per parameter, the memory mixed
    /// precision is for) or `f32` (the parameters are the master weights,
    /// cast for each use: 16 bytes per parameter plus a gradient of 4
    /// instead of 2, no rounding of the weights between steps).
    pub params: String,
    /// Dynamic loss scaling (on by default for fp16; ignored otherwise).
    pub loss_scaling: bool,
    /// Initial loss scale.
    pub initial_scale: f64,
    /// Overflows in a row before the scale backs off.
    pub hysteresis: u32,
    /// Every linear layer's products but the output head's in FP8: E4M3 inputs and weights, E5M2
    /// output gradients, delayed scaling per operand (see
    /// [`Cx::with_fp8`](tessera_nn::module::Cx::with_fp8)).
    pub fp8: bool,
    /// Steps of amax history an FP8 scale is taken over.
    pub fp8_history: usize,
    /// Binades below the format's largest value an FP8 operand's recent amax lands.
    pub fp8_margin: i32,
}

impl Default for PrecisionConfig {
    fn default() -> Self {
        PrecisionConfig {
            compute: "f32".into(),
            params: "compute".into(),
            loss_scaling: true,
            initial_scale: 65536.0,
            hysteresis: 1,
            fp8: false,
            fp8_history: 16,
            fp8_margin: 0,
        }
    }
}

impl PrecisionConfig {
    /// The FP8 recipe, or `None` without FP8.
    pub fn fp8_recipe(&self) -> Result<Option<Fp8Recipe>> {
        if !self.fp8 {
            return Ok(None);
        }
        if self.fp8_history == 0 {
            return Err(Error::config("precision.fp8_history", "must be at least 1 (16 is common)"));
        }
        if !(0..=16).contains(&self.fp8_margin) {
            return Err(Error::config("precision.fp8_margin", format!("{} is outside 0 to 16 (0 is usual)", self.fp8_margin)));
        }
        Ok(Some(Fp8Recipe { history: self.fp8_history, margin: self.fp8_margin }))
    }

    /// The compute dtype.
    pub fn dtype(&self) -> Result<DType> {
        match self.compute.as_str() {
            "f32" => Ok(DType::F32),
            "bf16" => Ok(DType::BF16),
            "fp16" | "f16" => Ok(DType::F16),
            other => Err(Error::config("precision.compute", format!("unknown dtype `{other}`; use `f32`, `bf16` or `fp16`"))),
        }
    }

    /// Whether the parameters are held in the compute dtype (half precision
    /// with `params = "compute"`) rather than in f32.
    pub fn half_params(&self) -> Result<bool> {
        match self.params.as_str() {
            "compute" => Ok(self.dtype()?.is_half()),
            "f32" => Ok(false),
            other => Err(Error::config("precision.params", format!("unknown choice `{other}`; use `compute` (held in the compute dtype) or `f32`"))),
        }
    }

    /// Whether the loss is scaled (fp16 with `loss_scaling`).
    pub fn scales_loss(&self) -> Result<bool> {
        Ok(self.dtype()? == DType::F16 && self.loss_scaling)
    }
}

/// `[recompute]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RecomputeConfig {
    /// `declared` (the model's attributes), `none` or `full`.
    pub mode: String,
    /// Activation offload: keep the inputs of fully recomputed layers in
    /// host memory until their backward (see `Cx::with_activation_offload`).
    pub offload: bool,
}

impl Default for RecomputeConfig {
    fn default() -> Self {
        RecomputeConfig { mode: "declared".into(), offload: false }
    }
}

impl RecomputeConfig {
    /// The run-time override of the model's recompute attributes.
    pub fn to_override(&self) -> Result<RecomputeOverride> {
        match self.mode.as_str() {
            "declared" => Ok(RecomputeOverride::AsDeclared),
            "none" | "off" => Ok(RecomputeOverride::Off),
            "full" => Ok(RecomputeOverride::Full),
            other => Err(Error::config("recompute.mode", format!("unknown mode `{other}`; use `declared`, `none` or `full`"))),
        }
    }
}

/// `[zero]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ZeroSection {
    /// 0 (off), 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters).
    pub stage: u8,
    /// ZeRO-Offload: master weights and AdamW moments (at stage 3 the
    /// parameter shards too) in host memory, updated there while the next
    /// forward runs (see `ZeroConfig::with_offload`).
    pub offload: bool,
}

impl ZeroSection {
    /// The ZeRO stage, if on.
    pub fn to_stage(&self) -> Result<Option<Stage>> {
        match self.stage {
            0 => Ok(None),
            1 => Ok(Some(Stage::One)),
            2 => Ok(Some(Stage::Two)),
            3 => Ok(Some(Stage::Three)),
            s => Err(Error::config("zero.stage", format!("stage {s} does not exist; use 0 (off), 1, 2 or 3"))),
        }
    }
}

/// `[checkpoint]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Save every this many steps (0: only at the end).
    pub every: u64,
    /// Checkpoints kept.
    pub keep: usize,
    /// Directory, relative to the run directory unless absolute.
    pub dir: String,
    /// Resume from the newest valid checkpoint in `dir` if there is one.
    pub resume: bool,
    /// Write periodic checkpoints on a background thread from a snapshot
    /// (the final one is always written before the run returns).
    pub background: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        CheckpointConfig { every: 50, keep: 2, dir: "checkpoints".into(), resume: true, background: true }
    }
}

/// `[local_sgd]`: data replicas that train apart and meet every `every`
/// steps (Local SGD, DiLoCo; see
/// [`LocalSgd`](tessera_parallel::local_sgd::LocalSgd)). Off by default.
///
/// ```toml
/// [local_sgd]
/// every = 10           # meet every 10 steps (0: gradients all-reduced every step)
/// outer_lr = 0.7       # DiLoCo's; 1 with outer_momentum = 0 averages the replicas
/// outer_momentum = 0.9 # Nesterov
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LocalSgdConfig {
    /// Inner steps between meetings (`H`); 0 turns Local SGD off.
    pub every: u64,
    /// The outer learning rate, in (0, 2).
    pub outer_lr: f64,
    /// The outer Nesterov momentum, in [0, 1).
    pub outer_momentum: f64,
}

impl Default for LocalSgdConfig {
    fn default() -> Self {
        LocalSgdConfig { every: 0, outer_lr: 0.7, outer_momentum: 0.9 }
    }
}

impl LocalSgdConfig {
    /// The outer optimizer, or `None` when the replicas all-reduce their
    /// gradients every step.
    pub fn outer(&self) -> Result<Option<OuterConfig>> {
        if self.every == 0 {
            return Ok(None);
        }
        let c = OuterConfig { every: self.every, lr: self.outer_lr, momentum: self.outer_momentum };
        if !(c.lr > 0.0 && c.lr < 2.0) {
            return Err(Error::config(
                "local_sgd.outer_lr",
                format!("{} is outside (0, 2); 0.7 is DiLoCo's, 1 (with outer_momentum = 0) averages the replicas", c.lr),
            ));
        }
        if !(0.0..1.0).contains(&c.momentum) {
            return Err(Error::config("local_sgd.outer_momentum", format!("{} is outside [0, 1); 0.9 is DiLoCo's, 0 is none", c.momentum)));
        }
        Ok(Some(c))
    }
}

/// `[data]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// `bundled` (the self-generated task) or a directory of prepared token shards.
    pub source: String,
    /// Seed of the data order (and of the bundled task's problems).
    pub seed: u64,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig { source: "bundled".into(), seed: 7 }
    }
}

/// `[stability]`: what counts as an anomaly, and what is done about it
/// (see [`StabilityMonitor`](super::StabilityMonitor) for the rule).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StabilityConfig {
    /// A loss or gradient norm above `spike_factor` × its recent median is a spike.
    pub spike_factor: f64,
    /// A loss spike must also rise at least this much above the median, in
    /// the loss's own units (nats per token): near the end of a run whose
    /// loss is a few hundredths, batches differ by several times that
    /// without anything being wrong.
    pub min_rise: f64,
    /// How many recent healthy steps the median is taken over.
    pub window: usize,
    /// Healthy steps before spikes are judged.
    pub warmup: u64,
    /// On an anomaly, roll back to the last checkpoint and pass over the
    /// data seen since, for good (otherwise only the step is skipped).
    pub rollback: bool,
}

impl Default for StabilityConfig {
    fn default() -> Self {
        StabilityConfig { spike_factor: 3.0, min_rise: 0.1, window: 20, warmup: 20, rollback: true }
    }
}

/// Sets `key` (dotted path) to `value` in a TOML document. The value is read
/// as TOML (`4`, `1e-3`, `true`, `"text"`); anything that does not parse as
/// a TOML value is taken as a bare string (`mesh.schedule=gpipe`).
fn set_dotted(doc: &mut toml::Table, key: &str, value: &str) -> Result<()> {
    let parsed: toml::Value = match format!("v = {value}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(value.into())),
        Err(_) => toml::Value::String(value.into()),
    };
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts.pop().filter(|s| !s.is_empty()).ok_or_else(|| Error::config(key, "an override is `section.key=value`, e.g. `mesh.dp=2`"))?;
    let mut table = doc;
    for p in parts {
        let entry = table.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        table = entry.as_table_mut().ok_or_else(|| Error::config(key, format!("`{p}` is a value, not a section")))?;
    }
    table.insert(last.to_string(), parsed);
    Ok(())
}

/// A reader's message about an unknown key, with the closest known key
/// ("unknown field `dpp`, expected one of `dp`, `tp`, ..." gains "; did you
/// mean `dp`?").
fn with_suggestion(message: &str) -> String {
    let quoted = |s: &str| -> Vec<String> { s.split('`').skip(1).step_by(2).map(str::to_string).collect() };
    message
        .lines()
        .map(|line| {
            let hint = line.split_once("unknown field ").and_then(|(_, rest)| {
                let (field, known) = rest.split_once(", expected")?;
                let field = quoted(field).into_iter().next()?;
                let known = quoted(known);
                Some(super::suggest::hint(&field, &known.iter().map(String::as_str).collect::<Vec<_>>()))
            });
            format!("{line}{}", hint.unwrap_or_default())
        })
        .collect::<Vec<_>>()
        .join("\n")
}

impl TrainConfig {
    /// Reads a TOML document, applies `key=value` overrides, and validates.
    pub fn parse(text: &str, overrides: &[&str]) -> Result<TrainConfig> {
        let mut doc: toml::Table = text.parse().map_err(|e: toml::de::Error| Error::config("<file>", format!("not valid TOML: {e}")))?;
        for o in overrides {
            let (k, v) = o.split_once('=').ok_or_else(|| Error::config(*o, "an override is `section.key=value`, e.g. `mesh.dp=2`"))?;
            set_dotted(&mut doc, k.trim(), v.trim())?;
        }
        // Read through the text form so an error shows the offending line.
        let text = toml::to_string(&doc).map_err(|e| Error::config("<file>", e.to_string()))?;
        let cfg: TrainConfig = toml::from_str(&text).map_err(|e: toml::de::Error| Error::config("<file>", with_suggestion(e.to_string().trim_end())))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a TOML file (see [`parse`](Self::parse)).
    pub fn load(path: impl AsRef<Path>, overrides: &[&str]) -> Result<TrainConfig> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::parse(&text, overrides)
    }

    /// The configuration as TOML (what a run directory's `config.toml` holds).
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string_pretty(self).map_err(|e| Error::config("<file>", e.to_string()))
    }

    /// Checks every setting and their combinations.
    pub fn validate(&self) -> Result<()> {
        let positive = |key: &str, v: usize| if v == 0 { Err(Error::config(key, "must be at least 1")) } else { Ok(()) };
        positive("mesh.dp", self.mesh.dp)?;
        positive("mesh.tp", self.mesh.tp)?;
        positive("mesh.pp", self.mesh.pp)?;
        positive("mesh.ep", self.mesh.ep)?;
        positive("mesh.cp", self.mesh.cp)?;
        positive("mesh.chunks", self.mesh.chunks)?;
        positive("mesh.tp_overlap", self.mesh.tp_overlap)?;
        if self.mesh.tp_overlap > 1 && !(self.mesh.sp && self.mesh.tp > 1) {
            return Err(Error::config(
                "mesh.tp_overlap",
                "overlaps the collectives of sequence parallelism with the products, and this run has none; set mesh.sp = true with mesh.tp > 1, or leave tp_overlap at 1",
            ));
        }
        positive("mesh.bucket_bytes", self.mesh.bucket_bytes)?;
        positive("batch.micro_batch", self.batch.micro_batch)?;
        positive("batch.seq_len", self.batch.seq_len)?;
        positive("batch.grad_accum", self.batch.grad_accum)?;
        if self.mesh.cp > 1 && !self.batch.seq_len.is_multiple_of(2 * self.mesh.cp) {
            return Err(Error::config(
                "mesh.cp",
                format!(
                    "splits each sequence into 2 · cp = {} equal chunks, and batch.seq_len = {} does not divide by {}; choose a sequence length that does",
                    2 * self.mesh.cp,
                    self.batch.seq_len,
                    2 * self.mesh.cp
                ),
            ));
        }
        if self.run.steps == 0 {
            return Err(Error::config("run.steps", "must be at least 1"));
        }
        if self.run.out.trim().is_empty() {
            return Err(Error::config("run.out", "the run directory is empty; give a path such as \"runs/my-run\""));
        }
        if self.run.stop_after == Some(0) {
            return Err(Error::config(
                "run.stop_after",
                "0 would stop before the first step; leave it out to run all `run.steps`, or give the step to stop after (a later job resumes from there)",
            ));
        }
        let kind = self.mesh.schedule_kind()?;
        if self.mesh.compression()? != Compression::None {
            if self.zero.stage != 0 {
                return Err(Error::config(
                    "mesh.grad_compression",
                    format!(
                        "ZeRO (stage {}) reduce-scatters the gradients itself; use grad_compression = \"none\" with ZeRO, or turn ZeRO off",
                        self.zero.stage
                    ),
                ));
            }
            if self.mesh.dp * self.mesh.ep == 1 {
                return Err(Error::config(
                    "mesh.grad_compression",
                    "compresses data-parallel gradients, and this run has one replica; set mesh.dp > 1, or leave it at \"none\"",
                ));
            }
        }
        self.precision.fp8_recipe()?;
        if let Some(outer) = self.local_sgd.outer()? {
            self.check_local_sgd(outer)?;
        }
        self.mesh.rank_device()?;
        self.mesh.launch_mode()?;
        self.mesh.process_comms()?;
        if self.mesh.pp > 1 && self.batch.grad_accum < self.mesh.pp && !matches!(kind, ScheduleKind::GPipe) {
            return Err(Error::config(
                "batch.grad_accum",
                format!(
                    "{} microbatches cannot fill {} pipeline stages with {}; use grad_accum >= mesh.pp",
                    self.batch.grad_accum, self.mesh.pp, self.mesh.schedule
                ),
            ));
        }
        self.precision.dtype()?;
        self.precision.half_params()?;
        if !(self.precision.initial_scale.is_finite() && self.precision.initial_scale > 0.0) {
            return Err(Error::config("precision.initial_scale", "must be a positive number (e.g. 65536)"));
        }
        if self.precision.hysteresis == 0 {
            return Err(Error::config("precision.hysteresis", "counts overflows: at least 1"));
        }
        if self.recompute.offload && self.recompute.to_override()? == RecomputeOverride::Off {
            return Err(Error::config(
                "recompute.offload",
                "moves the inputs that recomputed layers keep to the host, and recompute.mode = \"none\" keeps none; set recompute.mode to \"full\" (or \"declared\"), or turn recompute.offload off",
            ));
        }
        if self.zero.to_stage()?.is_none() && self.zero.offload {
            return Err(Error::config(
                "zero.offload",
                "moves ZeRO's optimizer state to the host and runs its update there; set zero.stage to 1, 2 or 3 (stage 1 with one data-parallel rank offloads a single replica's AdamW)",
            ));
        }
        let o = &self.optim;
        if !(o.lr.is_finite() && o.lr > 0.0 && o.min_lr.is_finite() && o.min_lr >= 0.0 && o.min_lr <= o.lr) {
            return Err(Error::config("optim.lr", format!("need 0 <= min_lr <= lr and lr > 0; got lr {} and min_lr {}", o.lr, o.min_lr)));
        }
        if !(o.clip.is_finite() && o.clip >= 0.0) {
            return Err(Error::config("optim.clip", "a threshold >= 0 (0 turns clipping off)"));
        }
        o.adamw().validate().map_err(|e| Error::config("optim", e.to_string()))?;
        if self.checkpoint.keep == 0 {
            return Err(Error::config("checkpoint.keep", "keep at least 1 checkpoint"));
        }
        let s = &self.stability;
        if !(s.spike_factor > 1.0 && s.spike_factor.is_finite() && s.window > 0) {
            return Err(Error::config("stability", "need spike_factor > 1 and a window of at least 1 step"));
        }
        if !(s.min_rise.is_finite() && s.min_rise >= 0.0) {
            return Err(Error::config("stability.min_rise", "a loss difference >= 0 (0 judges the factor alone)"));
        }
        if !(self.mesh.timeout_s.is_finite() && self.mesh.timeout_s > 0.0 && self.mesh.timeout_s <= 86_400.0) {
            return Err(Error::config(
                "mesh.timeout_s",
                "seconds a rank waits for another before declaring it hung: more than 0, at most 86400 (the default is 600)",
            ));
        }
        self.faults.validate(self.mesh.world_size())
    }

    /// Where Local SGD cannot run, or would save a checkpoint of replicas
    /// that disagree: checkpoints (and a stop part-way) must fall on steps
    /// where the replicas meet.
    fn check_local_sgd(&self, outer: OuterConfig) -> Result<()> {
        let every = outer.every;
        if self.mesh.dp * self.mesh.ep == 1 {
            return Err(Error::config("local_sgd.every", "meets data replicas, and this run has one; set mesh.dp > 1, or leave local_sgd.every at 0"));
        }
        if self.mesh.cp > 1 {
            return Err(Error::config(
                "local_sgd.every",
                "context-parallel ranks hold parts of the same sequences and must sum their gradients every step, which Local SGD does not; set mesh.cp = 1, or leave local_sgd.every at 0",
            ));
        }
        if self.zero.stage != 0 {
            return Err(Error::config(
                "local_sgd.every",
                format!("ZeRO (stage {}) shards one optimizer over the replicas, and Local SGD gives each replica its own; turn ZeRO off", self.zero.stage),
            ));
        }
        if self.mesh.compression()? != Compression::None {
            return Err(Error::config(
                "local_sgd.every",
                "with Local SGD no gradients travel between replicas (parameters do, every H steps); leave mesh.grad_compression at \"none\"",
            ));
        }
        if self.checkpoint.every > 0 && !self.checkpoint.every.is_multiple_of(every) {
            return Err(Error::config(
                "checkpoint.every",
                format!(
                    "{} is not a multiple of local_sgd.every ({every}): a checkpoint must fall where the replicas meet and agree; use a multiple of {every}",
                    self.checkpoint.every
                ),
            ));
        }
        if let Some(stop) = self.run.stop_after.filter(|s| !s.is_multiple_of(every) && *s < self.run.steps) {
            return Err(Error::config(
                "run.stop_after",
                format!("{stop} is not a multiple of local_sgd.every ({every}): a job must stop where the replicas meet and agree; use a multiple of {every}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every world size and configuration either keeps the global batch
    /// exactly on whole model replicas, or is refused naming `mesh.elastic`.
    #[test]
    fn elastic_resizing_keeps_the_global_batch_or_says_why_not() {
        for (tp, pp, ep) in [(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 2, 2)] {
            for dp in 1..=6 {
                for accum in 1..=4 {
                    let mesh = MeshConfig { dp, tp, pp, ep, ..MeshConfig::default() };
                    for world in 0..=40 {
                        match mesh.resized(world, accum) {
                            Ok((dp2, accum2)) => {
                                assert_eq!(dp2 * tp * pp * ep, world, "every rank holds part of a model replica");
                                assert_eq!(dp2 * accum2, dp * accum, "the global batch is kept");
                            }
                            Err(e) => {
                                let model = tp * pp * ep;
                                assert!(world == 0 || world % model != 0 || (dp * accum) % (world / model) != 0, "{world} ranks refused: {e}");
                                assert!(e.to_string().contains("mesh.elastic"), "{e}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn an_empty_file_is_the_defaults() {
        assert_eq!(TrainConfig::parse("", &[]).unwrap(), TrainConfig::default());
    }

    #[test]
    fn overrides_are_typed_and_checked() {
        let c = TrainConfig::parse("", &["mesh.schedule=gpipe", "precision.compute=bf16", "run.steps=17", "model.layers=3"]).unwrap();
        assert_eq!((c.mesh.schedule.as_str(), c.precision.compute.as_str(), c.run.steps), ("gpipe", "bf16", 17));
        assert_eq!(c.model.get("layers").and_then(|v| v.as_integer()), Some(3));
        let e = TrainConfig::parse("", &["mesh.dp=two"]).unwrap_err().to_string();
        assert!(e.contains("dp"), "{e}");
        assert!(TrainConfig::parse("", &["mesh.dp"]).is_err());
    }

    #[test]
    fn every_schedule_name_parses_and_an_unknown_one_is_named() {
        for (name, kind) in [
            ("gpipe", ScheduleKind::GPipe),
            ("1f1b", ScheduleKind::OneFOneB),
            ("interleaved", ScheduleKind::Interleaved { chunks: 2 }),
            ("zb-h1", ScheduleKind::ZeroBubbleH1),
        ] {
            let c = TrainConfig::parse("", &[&format!("mesh.schedule={name}")]).unwrap();
            assert_eq!(c.mesh.schedule_kind().unwrap(), kind);
        }
        let e = TrainConfig::parse("", &["mesh.schedule=zb-h2"]).unwrap_err().to_string();
        assert!(e.contains("mesh.schedule") && e.contains("unknown schedule `zb-h2`") && e.contains("`zb-h1`"), "{e}");
    }

    #[test]
    fn grad_compression_is_named_and_refused_where_it_cannot_apply() {
        for (name, want) in [("none", Compression::None), ("bf16", Compression::Bf16), ("powersgd", Compression::PowerSgd { rank: 4, warmup: 0 })] {
            let c = TrainConfig::parse("", &["mesh.dp=2", &format!("mesh.grad_compression={name}")]).unwrap();
            assert_eq!(c.mesh.compression().unwrap(), want);
        }
        let c = TrainConfig::parse("", &["mesh.dp=2", "mesh.grad_compression=powersgd", "mesh.powersgd_rank=1", "mesh.powersgd_warmup=50"]).unwrap();
        assert_eq!(c.mesh.compression().unwrap(), Compression::PowerSgd { rank: 1, warmup: 50 });
        for (args, key, says) in [
            (&["mesh.dp=2", "mesh.grad_compression=topk"][..], "mesh.grad_compression", "unknown compression `topk`"),
            (&["mesh.dp=2", "mesh.grad_compression=powersgd", "mesh.powersgd_rank=0"][..], "mesh.powersgd_rank", "at least 1"),
            (&["mesh.grad_compression=powersgd"][..], "mesh.grad_compression", "one replica"),
            (&["mesh.dp=2", "mesh.grad_compression=bf16", "zero.stage=2"][..], "mesh.grad_compression", "ZeRO (stage 2)"),
        ] {
            let e = TrainConfig::parse("", args).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(says), "{args:?}: {e}");
        }
    }

    #[test]
    fn fp8_is_off_by_default_and_refused_where_it_cannot_apply() {
        assert_eq!(TrainConfig::parse("", &[]).unwrap().precision.fp8_recipe().unwrap(), None);
        let c = TrainConfig::parse(
            "",
            &["precision.fp8=true", "precision.fp8_history=4", "precision.fp8_margin=1", "mesh.tp=2", "mesh.sp=true", "mesh.tp_overlap=2"],
        )
        .unwrap();
        assert_eq!(c.precision.fp8_recipe().unwrap(), Some(Fp8Recipe { history: 4, margin: 1 }));
        for (args, key, says) in [
            (&["precision.fp8=true", "precision.fp8_history=0"][..], "precision.fp8_history", "at least 1"),
            (&["precision.fp8=true", "precision.fp8_margin=20"][..], "precision.fp8_margin", "outside 0 to 16"),
        ] {
            let e = TrainConfig::parse("", args).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(says), "{args:?}: {e}");
        }
    }

    #[test]
    fn offload_is_off_by_default_and_refused_where_it_cannot_apply() {
        let c = TrainConfig::parse("", &[]).unwrap();
        assert!(!c.zero.offload && !c.recompute.offload);
        TrainConfig::parse("[zero]\nstage = 3\noffload = true\n[recompute]\nmode = \"full\"\noffload = true\n", &[]).unwrap();
        for (args, key, says) in [
            (&["zero.offload=true"][..], "zero.offload", "set zero.stage to 1, 2 or 3"),
            (&["recompute.offload=true", "recompute.mode=none"][..], "recompute.offload", "recompute.mode"),
        ] {
            let e = TrainConfig::parse("", args).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(says), "{args:?}: {e}");
        }
    }

    #[test]
    fn local_sgd_is_off_by_default_and_refused_where_it_cannot_apply() {
        assert_eq!(TrainConfig::parse("", &["mesh.dp=2"]).unwrap().local_sgd.outer().unwrap(), None);
        let c = TrainConfig::parse("", &["mesh.dp=2", "local_sgd.every=10"]).unwrap();
        assert_eq!(c.local_sgd.outer().unwrap(), Some(OuterConfig::diloco(10)));
        let c = TrainConfig::parse(
            "",
            &["mesh.dp=2", "mesh.ep=2", "local_sgd.every=25", "local_sgd.outer_lr=1", "local_sgd.outer_momentum=0", "run.stop_after=75"],
        )
        .unwrap();
        assert_eq!(c.local_sgd.outer().unwrap(), Some(OuterConfig::averaging(25)));
        for (args, key, says) in [
            (&["local_sgd.every=10"][..], "local_sgd.every", "this run has one"),
            (&["mesh.dp=2", "local_sgd.every=10", "zero.stage=1"][..], "local_sgd.every", "ZeRO (stage 1)"),
            (&["mesh.dp=2", "local_sgd.every=10", "mesh.grad_compression=bf16"][..], "local_sgd.every", "grad_compression"),
            (&["mesh.dp=2", "local_sgd.every=20"][..], "checkpoint.every", "50 is not a multiple of local_sgd.every (20)"),
            (&["mesh.dp=2", "local_sgd.every=10", "run.stop_after=15"][..], "run.stop_after", "15 is not a multiple"),
            (&["mesh.dp=2", "local_sgd.every=10", "local_sgd.outer_lr=0"][..], "local_sgd.outer_lr", "outside (0, 2)"),
            (&["mesh.dp=2", "local_sgd.every=10", "local_sgd.outer_lr=2.5"][..], "local_sgd.outer_lr", "outside (0, 2)"),
            (&["mesh.dp=2", "local_sgd.every=10", "local_sgd.outer_momentum=1"][..], "local_sgd.outer_momentum", "outside [0, 1)"),
            (&["mesh.dp=2", "local_sgd.every=10", "local_sgd.outer_momentum=-0.1"][..], "local_sgd.outer_momentum", "outside [0, 1)"),
        ] {
            let e = TrainConfig::parse("", args).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(says), "{args:?}: {e}");
        }
    }

    #[test]
    fn tp_overlap_needs_sequence_parallelism_and_at_least_one_piece() {
        let c = TrainConfig::parse("", &["mesh.tp=2", "mesh.sp=true", "mesh.tp_overlap=4"]).unwrap();
        assert_eq!(c.mesh.tp_overlap, 4);
        for (args, says) in [
            (&["mesh.tp=2", "mesh.tp_overlap=2"][..], "mesh.sp = true"),
            (&["mesh.sp=true", "mesh.tp_overlap=2"][..], "mesh.tp > 1"),
            (&["mesh.tp=2", "mesh.sp=true", "mesh.tp_overlap=0"][..], "at least 1"),
        ] {
            let e = TrainConfig::parse("", args).unwrap_err().to_string();
            assert!(e.contains("mesh.tp_overlap") && e.contains(says), "{args:?}: {e}");
        }
    }

    #[test]
    fn misspelt_keys_and_bad_combinations_are_named() {
        let e = TrainConfig::parse("[mesh]\ndpp = 2\n", &[]).unwrap_err().to_string();
        assert!(e.contains("dpp") && e.contains("did you mean `dp`?"), "{e}");
        let e = TrainConfig::parse("[batch]\nseqlen = 2\n", &[]).unwrap_err().to_string();
        assert!(e.contains("did you mean `seq_len`?"), "{e}");
        let e = TrainConfig::parse("[optimizer]\nlr = 2\n", &[]).unwrap_err().to_string();
        assert!(e.contains("optimizer") && e.contains("did you mean `optim`?"), "{e}");
        // ZeRO combines with every axis.
        TrainConfig::parse("[zero]\nstage = 3\n[mesh]\ndp = 2\ntp = 2\npp = 2\nep = 2\nsp = true\n", &[]).unwrap();
        let e = TrainConfig::parse("[zero]\nstage = 4\n", &[]).unwrap_err().to_string();
        assert!(e.contains("zero.stage"), "{e}");
        let e = TrainConfig::parse("[mesh]\npp = 4\n[batch]\ngrad_accum = 2\n", &[]).unwrap_err().to_string();
        assert!(e.contains("grad_accum"), "{e}");
        let e = TrainConfig::parse("[precision]\ncompute = \"fp8\"\n", &[]).unwrap_err().to_string();
        assert!(e.contains("precision.compute"), "{e}");
        let e = TrainConfig::parse("[mesh]\ndevice = \"tpu\"\n", &[]).unwrap_err().to_string();
        assert!(e.contains("mesh.device") && e.contains("`cuda`"), "{e}");
        assert_eq!(TrainConfig::parse("[mesh]\ndevice = \"cuda\"\ndp = 2\n", &[]).unwrap().mesh.rank_device().unwrap(), RankDevice::Cuda);
        let e = TrainConfig::parse("", &["mesh.comm=udp"]).unwrap_err().to_string();
        assert!(e.contains("mesh.comm") && e.contains("`tcp`"), "{e}");
        assert_eq!(TrainConfig::parse("", &[]).unwrap().mesh.process_comms().unwrap(), ProcessComms::Tcp);
        // `mpi` only where the build has it, and a clear error elsewhere.
        let mpi = TrainConfig::parse("", &["mesh.comm=mpi"]);
        assert_eq!(mpi.is_ok(), cfg!(feature = "mpi"), "{mpi:?}");
        let e = TrainConfig::parse("", &["run.out=\"\""]).unwrap_err().to_string();
        assert!(e.contains("run.out") && e.contains("empty"), "{e}");
        let e = TrainConfig::parse("", &["run.stop_after=0"]).unwrap_err().to_string();
        assert!(e.contains("run.stop_after") && e.contains("first step"), "{e}");
    }

    #[test]
    fn the_written_config_reads_back_the_same() {
        let c = TrainConfig::parse("[mesh]\ndp = 2\n[model]\nlayers = 4\n", &[]).unwrap();
        assert_eq!(TrainConfig::parse(&c.to_toml().unwrap(), &[]).unwrap(), c);
    }
}
