//! ZeRO: the model states (optimizer moments, gradients, parameters)
//! partitioned over the data-parallel group instead of replicated.
//!
//! # The flat vector and its shards
//!
//! The model's distinct parameters, in the order [`visit_params`] reports
//! them (a tied parameter once, at its first name), are laid end to end into
//! one logical vector of Ψ elements (each parameter contributes its local
//! shard's elements when tensor parallelism splits it). That vector is
//! padded with zeros at the tail to `Ψp = N·⌈Ψ/N⌉` elements and cut into `N`
//! contiguous shards of `S = Ψp/N` elements; rank `r` of the data-parallel
//! group owns elements `r·S .. (r+1)·S`. A parameter may straddle two or more
//! shards. The padding (fewer than `N` elements) is never part of a
//! parameter: its gradient is zero, so AdamW keeps it at zero.
//!
//! # Stages
//!
//! - [`Stage::One`]: every rank keeps the full parameters and gradients;
//!   gradients are averaged with a bucketed, overlapped all-reduce
//!   ([`DataParallel`]); each rank keeps the AdamW moments of its shard only,
//!   updates its shard of the parameters and all-gathers the result.
//! - [`Stage::Two`]: as one, but each gradient bucket is reduce-scattered as
//!   soon as it is full (from [`Hooks::grad_ready`], asynchronously), so a
//!   rank keeps only the averaged gradient of its shard; the full gradients
//!   are dropped as soon as their bucket is packed.
//! - [`Stage::Three`]: as two, and between uses each rank holds only its
//!   shard of the parameters. The engine, installed as [`Hooks`], gathers a
//!   sub-module's parameters right before its forward or backward runs and
//!   frees them right after; from the second step on it also starts
//!   gathering the next sub-module's parameters (in the order learned during
//!   the first step) while the current one computes.
//!
//! The memory each stage needs is derived in the repository's `docs/zero.md`.
//!
//! # Tied parameters
//!
//! A parameter the model uses in several places (an embedding tied to the
//! head) is reduced only in [`finish`](Zero::finish), never during the
//! backward, and in buckets of its own: under pipeline parallelism its uses
//! sit on different stages, and the caller sums its gradient over them
//! (`sync_tied_grads`) after the backward and before `finish`.
//!
//! # Use
//!
//! ```
//! use std::sync::Arc;
//! use tessera::nn::Linear;
//! use tessera::parallel::zero::{Stage, Zero, ZeroConfig};
//! use tessera::prelude::*;
//!
//! let cx = Cx::new(Device::cpu());
//! let layer = tessera::module::build(Linear::new(4, 2, true).unwrap(), &cx).unwrap();
//! // On each rank of the data-parallel group (here a group of one):
//! let zero = Arc::new(Zero::new(&layer, cx.groups().dp.clone(), ZeroConfig::new(Stage::Two)).unwrap());
//! let mut cx = cx.with_hooks(zero.clone());
//! let x = Tensor::from_vec(vec![0.5f32; 8], [2, 4], cx.device()).unwrap();
//! let (y, saved) = <Linear as Module>::forward(&layer, &mut cx, Act::new(x)).unwrap();
//! let dy = Tensor::from_vec(vec![1.0f32; 4], y.tensor().shape().clone(), cx.device()).unwrap();
//! <Linear as Module>::backward(&layer, &mut cx, saved, Act::new(dy)).unwrap();
//! zero.step(1e-3).unwrap(); // averages the gradients, updates this rank's shard
//! ```
//!
//! Every rank of the group must construct the engine for the same model
//! and call [`finish`](Zero::finish), [`step`](Zero::step) and
//! [`gather_parameters`](Zero::gather_parameters) at the same points: each
//! issues collectives.
//!
//! [`visit_params`]: tessera_nn::module::visit_params

mod checkpoint;
mod gather;
mod layout;
mod offload;
mod reduce;
mod state;

pub use layout::FlatLayout;

use crate::buckets::Buckets;
use crate::data::DataParallel;
use layout::{flat_view, Entry, Flat};
use offload::{HostUpdate, UpdateJob};
use parking_lot::{Mutex, MutexGuard};
use state::{Params, State, Unit};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use tessera_core::tensor::{DType, Shape, Tensor};
use tessera_core::Device;
use tessera_core::{ops, Error, Result};
use tessera_dist::Communicator;
use tessera_nn::module::{self, Hooks, Module, Param};
use tessera_optim::{master_dtype, AdamWConfig};

/// The dtype a parameter is held in: its master dtype (f32 or f64), or a
/// half-precision dtype whose master copy the engine keeps in f32.
fn held_dtype(name: &str, value: &Tensor) -> Result<DType> {
    match value.dtype() {
        d @ (DType::BF16 | DType::F16) => Ok(d),
        _ => master_dtype(name, value),
    }
}

/// Which model states are partitioned over the data-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Optimizer state (the AdamW moments).
    One,
    /// Optimizer state and gradients.
    Two,
    /// Optimizer state, gradients and parameters.
    Three,
}

/// The settings of a [`Zero`] engine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ZeroConfig {
    /// What is partitioned.
    pub stage: Stage,
    /// AdamW's hyper-parameters (the learning rate goes to each [`Zero::step`]).
    pub adamw: AdamWConfig,
    /// Gradient bytes collected before a bucket's all-reduce (stage 1) or
    /// reduce-scatter (stages 2 and 3) starts.
    pub bucket_bytes: usize,
    /// Stage 3: start gathering the next sub-module's parameters while the
    /// current one runs (from the second step on).
    pub prefetch: bool,
    /// ZeRO-Offload: keep this rank's master weights and AdamW moments in
    /// host memory and compute the update there, on a worker thread that
    /// overlaps the next step's forward (see [`with_offload`](Self::with_offload)).
    pub offload: bool,
}

impl ZeroConfig {
    /// `stage` with AdamW's defaults, 25 MiB buckets and prefetching on.
    pub fn new(stage: Stage) -> Self {
        ZeroConfig { stage, adamw: AdamWConfig::default(), bucket_bytes: 25 << 20, prefetch: true, offload: false }
    }

    /// Uses `adamw` for the update.
    pub fn with_adamw(mut self, adamw: AdamWConfig) -> Self {
        self.adamw = adamw;
        self
    }

    /// Collects about `bytes` of gradients per bucket.
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes;
        self
    }

    /// Turns stage 3's prefetching on or off.
    pub fn with_prefetch(mut self, on: bool) -> Self {
        self.prefetch = on;
        self
    }

    /// Turns ZeRO-Offload on or off.
    ///
    /// On, this rank's shard of the master weights and of both AdamW
    /// moments lives in host memory (a pool of its own, so the device's
    /// accounting no longer sees them; on CPU ranks a second accounting
    /// domain), and each [`Zero::step`] copies the averaged gradient shard
    /// there and returns while a worker thread applies the update, front to
    /// back. Parameters are then brought back sub-module by sub-module as
    /// the next forward reaches them (each waits only for its own part of
    /// the update):
    ///
    /// - at stages 1 and 2, every rank keeps the full parameters on the
    ///   device as before, but between a step and the forward that first
    ///   uses a sub-module its parameters have no value (read them with
    ///   [`Zero::gather_parameters`]);
    /// - at stage 3 the parameter shard is the host master copy itself, so
    ///   the device holds nothing but the sub-modules being run: every
    ///   gather copies this rank's rows from the host, and the prefetch
    ///   starts the next sub-module's copy and gather while the current one
    ///   computes.
    ///
    /// The values are bit for bit those of the update made on the device.
    pub fn with_offload(mut self, on: bool) -> Self {
        self.offload = on;
        self
    }
}

/// Cumulative counts of what the engine did (for tests and tuning).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZeroStats {
    /// Optimizer steps taken.
    pub steps: u64,
    /// Gradient buckets reduced (all-reduced in stage 1, reduce-scattered in 2 and 3).
    pub grad_buckets: usize,
    /// Of those, buckets started before [`Zero::finish`], i.e. during a backward.
    pub grad_buckets_during_backward: usize,
    /// Sub-module parameter gathers: at stage 3 for every forward and
    /// backward, at stages 1 and 2 with offload once per step (the first use
    /// after the update).
    pub gathers: usize,
    /// Stage 3: gathers that a prefetch had already started.
    pub prefetched: usize,
    /// ZeRO-Offload: the wall time of the host updates.
    pub host_update: std::time::Duration,
    /// ZeRO-Offload: the time callers were blocked waiting for a host
    /// update (the part of `host_update` the forward did not hide).
    pub host_update_waited: std::time::Duration,
}

/// A run of this rank's shard of the flat vector that lies in one parameter
/// (see [`Zero::shard_pieces`]).
#[derive(Clone, Debug)]
pub struct ShardPiece {
    /// The parameter's dotted name (its first, for a tied parameter).
    pub name: String,
    /// The parameter.
    pub param: Param,
    /// The elements of the parameter's local (tensor-parallel) shard,
    /// flattened in row-major order, that the piece holds.
    pub elements: Range<usize>,
    /// Where the piece starts in this rank's shard.
    pub offset: usize,
}

/// One rank's part of the model state a [`Zero`] engine partitions: its
/// shard of the flat parameter vector and of both AdamW moments (each
/// [`FlatLayout::shard_len`] elements, zero past the last parameter), and
/// the number of updates applied.
#[derive(Clone, Debug)]
pub struct ShardState {
    /// This rank's shard of the flat parameters.
    pub params: Tensor,
    /// This rank's shard of AdamW's first moment.
    pub m: Tensor,
    /// This rank's shard of AdamW's second moment.
    pub v: Tensor,
    /// Updates applied so far (bias correction counts them).
    pub steps: u64,
}

/// ZeRO over the data-parallel group: sharded AdamW with the gradient and
/// parameter traffic the chosen [`Stage`] needs. See the [module
/// documentation](self).
///
/// Install it on each rank's [`Cx`](tessera_nn::module::Cx) with
/// [`with_hooks`](tessera_nn::module::Cx::with_hooks); after each backward call
/// [`step`](Self::step) (which first calls [`finish`](Self::finish) if the
/// caller has not). The step consumes the gradients: there is nothing to
/// zero before the next backward.
pub struct Zero {
    stage: Stage,
    config: ZeroConfig,
    dp: Arc<dyn Communicator>,
    rank: usize,
    /// The flat parameter vector and its shards.
    flat: Flat,
    /// Each parameter's index in `entries`.
    entry_of: HashMap<tessera_nn::module::ParamId, usize>,
    units: Vec<Unit>,
    unit_of_path: HashMap<String, usize>,
    /// Stage 3: parameters owned by the model's root (no sub-module call
    /// announces them), kept gathered.
    persistent: Vec<usize>,
    /// Stage 1: the data-parallel engine that all-reduces the gradients.
    all_reduce: Option<DataParallel>,
    /// Stages 2 and 3: the fixed gradient buckets (entry indices).
    buckets: Buckets,
    /// Whether each entry is tied (used in several places): reduced only in
    /// `finish`, after the caller summed it over the stages that use it.
    tied: Vec<bool>,
    /// With expert parallelism: the expert-parallel group, over which the
    /// shard of every gradient but the experts' is summed too, and whether
    /// each entry is an expert's.
    experts: Option<(Arc<dyn Communicator>, Vec<bool>)>,
    /// With offload: the host memory that holds the optimizer state.
    host: Option<Device>,
    state: Mutex<State>,
}

impl Zero {
    /// Shards `model`'s optimizer state (and, per `config.stage`, its
    /// gradients and parameters) over `dp`.
    ///
    /// The model must be materialised (see [`module::build`]) identically on
    /// every rank, in f32 (or f64) on one device; every rank of `dp` calls
    /// this with the same model and configuration. Stage 3 keeps only this
    /// rank's shard of the parameters from here on.
    pub fn new<M: Module>(model: &M, dp: Arc<dyn Communicator>, config: ZeroConfig) -> Result<Self> {
        Zero::build(model, dp, None, config)
    }

    /// With expert parallelism: the engine shards over `groups.dp` (the
    /// replicas that hold the same experts, so the same flat layout); an
    /// expert's gradient is averaged over it as usual (the all-to-all
    /// already brought it every expert-parallel rank's tokens), while every
    /// other gradient is also summed over `groups.ep`: at stage 1 through
    /// the all-reduce over all replicas (`groups.replicas`), at stages 2 and
    /// 3 on this rank's shard only, after the reduce-scatter (1/dp of the
    /// bytes). Every gradient is divided by the number of replicas, dp × ep.
    pub fn with_experts<M: Module>(model: &M, groups: &tessera_dist::Groups, config: ZeroConfig) -> Result<Self> {
        Zero::build(model, groups.dp.clone(), Some((groups.ep.clone(), groups.replicas.clone())), config)
    }

    fn build<M: Module>(
        model: &M,
        dp: Arc<dyn Communicator>,
        experts: Option<(Arc<dyn Communicator>, Arc<dyn Communicator>)>,
        config: ZeroConfig,
    ) -> Result<Self> {
        const OP: &str = "Zero::new";
        config.adamw.validate()?;
        if config.bucket_bytes == 0 {
            return Err(Error::invalid(OP, "the bucket size must be positive (e.g. 25 MiB)"));
        }
        let mut entries: Vec<Entry> = Vec::new();
        let mut seen: HashMap<tessera_nn::module::ParamId, usize> = HashMap::new();
        let mut owners: Vec<(String, usize)> = Vec::new();
        let mut tied = std::collections::HashSet::new();
        let mut is_expert: Vec<bool> = Vec::new();
        let mut kind: Option<(DType, Device)> = None;
        let mut problem: Option<String> = None;
        module::visit_params(model, |e| {
            // Another pipeline stage holds (and updates) a remote parameter.
            if e.param.is_remote() {
                return Ok(());
            }
            let index = match seen.get(&e.param.id()) {
                Some(&i) => {
                    tied.insert(i);
                    i
                }
                None => {
                    let value = e.param.value().map_err(|_| {
                        Error::param_unavailable(
                            OP,
                            format!("parameter `{}` has no value; build (materialise) the model on this rank before sharding it", e.name),
                        )
                    })?;
                    let dtype = held_dtype(e.name, &value)?;
                    match &kind {
                        None => kind = Some((dtype, value.device().clone())),
                        Some((d, dev)) if *d != dtype || !dev.same(value.device()) => {
                            problem.get_or_insert_with(|| format!("parameter `{}` is {dtype} on {:?}, the first one {d} on {dev:?}", e.name, value.device()));
                        }
                        Some(_) => {}
                    }
                    let offset = entries.last().map_or(0, |x| x.offset + x.len);
                    entries.push(Entry { name: e.name.to_string(), param: e.param.clone(), shape: value.shape().clone(), offset, len: value.elem_count() });
                    is_expert.push(e.expert.is_some());
                    seen.insert(e.param.id(), entries.len() - 1);
                    entries.len() - 1
                }
            };
            let owner = e.module.to_string();
            owners.push((owner, index));
            Ok(())
        })?;
        if let Some(p) = problem {
            return Err(Error::unsupported(
                OP,
                format!("{p}; ZeRO flattens all parameters into one vector, so materialise them all in one dtype on one device"),
            ));
        }
        let Some((dtype, device)) = kind else {
            return Err(Error::invalid(OP, "the model has no parameters; there is nothing to shard or optimise"));
        };
        let numel = entries.last().map_or(0, |x| x.offset + x.len);
        if numel == 0 {
            return Err(Error::invalid(OP, "the model's parameters have no elements; there is nothing to shard or optimise"));
        }
        let (rank, ranks) = (dp.rank(), dp.size());
        let layout = FlatLayout::new(numel, ranks);

        let mut units: Vec<Unit> = Vec::new();
        let mut unit_of_path = HashMap::new();
        let mut persistent = Vec::new();
        for (owner, i) in owners {
            if owner.is_empty() {
                if !persistent.contains(&i) {
                    persistent.push(i);
                }
                continue;
            }
            let u = *unit_of_path.entry(owner.clone()).or_insert_with(|| {
                units.push(Unit { path: owner, entries: Vec::new() });
                units.len() - 1
            });
            if !units[u].entries.contains(&i) {
                units[u].entries.push(i);
            }
        }

        let all_reduce = match (config.stage, &experts) {
            (Stage::One, None) => Some(DataParallel::new(model, dp.clone(), config.bucket_bytes)?),
            (Stage::One, Some((_, replicas))) => Some(DataParallel::with_experts(model, replicas.clone(), dp.clone(), config.bucket_bytes)?),
            _ => None,
        };
        let experts = experts.map(|(ep, _)| (ep, is_expert));
        let bytes: Vec<usize> = entries.iter().map(|e| e.len * dtype.size_in_bytes()).collect();
        let tied: Vec<bool> = (0..entries.len()).map(|i| tied.contains(&i)).collect();
        let buckets = Buckets::keyed(&bytes, &tied.iter().map(|&t| usize::from(t)).collect::<Vec<_>>(), config.bucket_bytes);
        let flat = Flat { layout, entries, dtype, device };
        // The optimizer state is in full precision whatever the parameters
        // are held in.
        let state_dtype = if dtype.is_half() { DType::F32 } else { dtype };
        let host = config.offload.then(Device::cpu);
        let state_device = host.as_ref().unwrap_or(&flat.device);
        let m = Tensor::zeros([layout.shard_len], state_dtype, state_device)?;
        let v = Tensor::zeros([layout.shard_len], state_dtype, state_device)?;
        // After the moments, as the engine has always allocated: the memory
        // figures of its tests count on this order.
        let params = initial_params(&flat, config.stage, rank, &persistent)?;
        let (params, master) = match &host {
            // Offloaded, the master copy is always kept (on the host), and
            // at stage 3 it is the only copy of the shard.
            Some(host) => {
                let master = params.shard(layout.shard_range(rank))?.to_dtype(state_dtype)?.to_device(host)?;
                (if config.stage == Stage::Three { Params::Offloaded } else { params }, Some(master))
            }
            None if dtype.is_half() => {
                let master = params.shard(layout.shard_range(rank))?.to_dtype(DType::F32)?;
                (params, Some(master))
            }
            None => (params, None),
        };
        let n = flat.entries.len();
        let state = State {
            params,
            master,
            m,
            v,
            open: Vec::new(),
            ready: vec![false; n],
            packed: vec![false; n],
            inflight: Vec::new(),
            grad_shard: None,
            synced: false,
            held: vec![0; n],
            order: Vec::new(),
            recording: true,
            cursor: 0,
            on_track: true,
            prefetch: None,
            update: None,
            stale: vec![false; n],
            stats: ZeroStats::default(),
            sync: Default::default(),
            last_sync: Default::default(),
        };
        let entry_of = flat.entries.iter().enumerate().map(|(i, e)| (e.param.id(), i)).collect();
        Ok(Zero {
            stage: config.stage,
            config,
            dp,
            rank,
            flat,
            entry_of,
            units,
            unit_of_path,
            persistent,
            all_reduce,
            buckets,
            tied,
            experts,
            host,
            state: Mutex::new(state),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// The stage.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The settings.
    pub fn config(&self) -> &ZeroConfig {
        &self.config
    }

    /// How the flat parameter vector is sharded.
    pub fn layout(&self) -> FlatLayout {
        self.flat.layout
    }

    /// What the engine has done so far.
    pub fn stats(&self) -> ZeroStats {
        self.state().stats
    }

    /// The gradient communication of the last [`finish`](Self::finish):
    /// buckets, bytes, wall time in flight and time `finish` was blocked,
    /// measured as [`DataParallel`] measures them.
    pub fn sync_stats(&self) -> crate::data::SyncStats {
        self.state().last_sync
    }

    /// The sub-module paths whose parameters stage 3 gathers around their
    /// runs, in the order of the model's parameters.
    pub fn gathered_paths(&self) -> Vec<&str> {
        self.units.iter().map(|u| u.path.as_str()).collect()
    }

    /// Bytes of optimizer state on this rank: both moments of its shard,
    /// and its shard of the f32 master copy when the parameters are held
    /// in half precision.
    pub fn state_bytes(&self) -> usize {
        let s = self.state();
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        bytes(&s.m) + bytes(&s.v) + s.master.as_ref().map_or(0, bytes)
    }

    /// Every distinct parameter's full value, with its name, in visit order.
    ///
    /// In stage 3 this all-gathers the shards (every rank must call it at
    /// the same point); in stages 1 and 2 every rank already holds them.
    pub fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let mut s = self.state();
        self.join_update(&mut s)?;
        let flat = match &s.params {
            Params::Flat(flat) => flat.clone(),
            Params::Shard(shard) => self.dp.all_gather(shard, 0)?,
            Params::Offloaded => {
                let master = s.master.as_ref().expect("offload keeps the master copy");
                self.dp.all_gather(&master.to_dtype(self.flat.dtype)?.to_device(&self.flat.device)?, 0)?
            }
        };
        self.flat.entries.iter().map(|e| Ok((e.name.clone(), flat.narrow(0, e.offset, e.len)?.reshape(e.shape.clone())?))).collect()
    }

    /// The parameters this rank's shard of the flat vector covers, in order:
    /// what each element of [`shard_state`](Self::shard_state)'s tensors is.
    pub fn shard_pieces(&self) -> Vec<ShardPiece> {
        let range = self.flat.layout.shard_range(self.rank);
        self.flat
            .pieces_in(range.clone())
            .into_iter()
            .map(|p| {
                let e = &self.flat.entries[p.entry];
                ShardPiece { name: e.name.clone(), param: e.param.clone(), elements: p.start..p.start + p.len, offset: e.offset + p.start - range.start }
            })
            .collect()
    }

    /// This rank's shard of the parameters and of the optimizer state (what
    /// a checkpoint saves). The tensors are views of the live state, which
    /// the next [`step`](Self::step) updates in place: copy them to keep them.
    pub fn shard_state(&self) -> Result<ShardState> {
        let mut s = self.state();
        self.join_update(&mut s)?;
        let params = match &s.master {
            Some(master) => master.clone(),
            None => s.params.shard(self.flat.layout.shard_range(self.rank))?,
        };
        Ok(ShardState { params, m: s.m.clone(), v: s.v.clone(), steps: s.stats.steps })
    }

    /// Replaces this rank's shard of the parameters and of the optimizer
    /// state (restoring a checkpoint, between steps). Every rank of the
    /// group calls it together: stages 1 and 2 all-gather the parameters
    /// again, stage 3 regathers those it keeps whole.
    pub fn load_shard_state(&self, state: ShardState) -> Result<()> {
        const OP: &str = "Zero::load_shard_state";
        let want = Shape::new([self.flat.layout.shard_len]);
        let state_dtype = self.state().m.dtype();
        for (what, t) in [("parameter", &state.params), ("first-moment", &state.m), ("second-moment", &state.v)] {
            if *t.shape() != want || t.dtype() != state_dtype {
                return Err(Error::shape(
                    OP,
                    format!(
                        "a {what} shard of {} {}, this rank's shard is {} {want}; restore state for the same model and data-parallel degree",
                        t.dtype(),
                        t.shape(),
                        state_dtype
                    ),
                ));
            }
        }
        let mut s = self.state();
        self.join_update(&mut s)?;
        if !s.inflight.is_empty() || s.grad_shard.is_some() || s.synced {
            return Err(Error::state_mismatch(
                OP,
                "gradients of a step are still being reduced; restore state between steps (after `step`, before the next backward)",
            ));
        }
        let on_state_device = |t: Tensor| match &self.host {
            Some(host) if !t.device().same(host) => t.to_device(host),
            _ => Ok(t),
        };
        s.m = on_state_device(state.m)?;
        s.v = on_state_device(state.v)?;
        s.stats.steps = state.steps;
        // Parameters held in half precision, or offloaded: the restored
        // values are the master copy, rounded into the parameters.
        let params = match s.master.is_some() {
            true => {
                let held = state.params.to_dtype(self.flat.dtype)?;
                let held = if held.device().same(&self.flat.device) { held } else { held.to_device(&self.flat.device)? };
                s.master = Some(on_state_device(state.params)?);
                held
            }
            false => state.params,
        };
        match self.stage {
            Stage::One | Stage::Two => {
                let flat = self.dp.all_gather(&params, 0)?;
                self.flat.point_values_at(&flat)?;
                s.params = Params::Flat(flat);
                s.stale.fill(false);
            }
            Stage::Three => {
                s.params = if self.host.is_some() { Params::Offloaded } else { Params::Shard(params) };
                if !self.persistent.is_empty() {
                    let ids = self.persistent.clone();
                    let got = self.gather_now(&s, &ids)?;
                    self.install(&ids, got)?;
                }
            }
        }
        Ok(())
    }

    /// One AdamW update of this rank's shard at learning rate `lr` (after
    /// [`finish`](Self::finish), which it calls if the caller has not);
    /// stages 1 and 2 then all-gather the updated parameters. Consumes the
    /// gradients.
    pub fn step(&self, lr: f64) -> Result<()> {
        self.step_scaled(lr, 1.0)
    }

    /// The global norm of the averaged gradients (after
    /// [`finish`](Self::finish), which it calls if the caller has not):
    /// each rank's shard squared and summed, then summed over the
    /// data-parallel group, so every rank gets the same value at every stage
    /// though stages 2 and 3 hold only a shard. NaN or infinite when any
    /// gradient is (an fp16 overflow). The norm of this engine's parameters
    /// only: with tensor, pipeline or expert parallelism, see
    /// [`grad_squares`](Self::grad_squares).
    pub fn grad_norm(&self) -> Result<f64> {
        Ok(self.grad_squares(1, |_| Some(0))?[0].sqrt())
    }

    /// The squared averaged gradients summed per class (after
    /// [`finish`](Self::finish), which it calls if the caller has not):
    /// `class(param)` puts each parameter in one of `classes` sums, or in
    /// none; each rank sums its shard, then the sums are added over the
    /// data-parallel group, so every rank gets the same values at every
    /// stage. A caller that also splits the model over other groups sums
    /// each class over the groups it is split over (tensor-parallel shards,
    /// experts, stages) to get the model's global norm.
    pub fn grad_squares(&self, classes: usize, class: impl Fn(&Param) -> Option<usize>) -> Result<Vec<f64>> {
        let mut s = self.state();
        self.ensure_synced(&mut s)?;
        let grad = self.grad_shard(&mut s, false)?;
        let range = self.flat.layout.shard_range(self.rank);
        let mut local = vec![0.0f64; classes];
        for p in self.flat.pieces_in(range.clone()) {
            let e = &self.flat.entries[p.entry];
            let Some(c) = class(&e.param) else { continue };
            if c >= classes {
                return Err(Error::invalid("Zero::grad_squares", format!("parameter `{}` was put in class {c} of {classes}", e.name)));
            }
            let at = e.offset + p.start - range.start;
            local[c] += ops::sum_squares(&grad.narrow(0, at, p.len)?)?.to_scalar()?;
        }
        self.dp.all_reduce_sum(&Tensor::from_vec(local, [classes], s.m.device())?)?.to_vec::<f64>()
    }

    /// [`step`](Self::step) with every gradient multiplied by `grad_scale`
    /// first: the clipping factor, over the loss scale under fp16.
    pub fn step_scaled(&self, lr: f64, grad_scale: f64) -> Result<()> {
        let mut s = self.state();
        self.join_update(&mut s)?;
        self.ensure_synced(&mut s)?;
        let step = s.stats.steps + 1;
        let mut upd = self.config.adamw.at(step, lr)?;
        upd.grad_scale = grad_scale;
        if let Some(host) = &self.host {
            return self.step_offloaded(&mut s, host, upd);
        }
        let range = self.flat.layout.shard_range(self.rank);
        let grad = self.grad_shard(&mut s, true)?;
        let params = match &s.master {
            // The update goes to the master copy, rounded into the shard.
            Some(master) => {
                ops::adamw_update(&upd, master, &grad, &s.m, &s.v)?;
                master.to_dtype(self.flat.dtype)?
            }
            None => {
                let params = s.params.shard(range.clone())?;
                ops::adamw_update(&upd, &params, &grad, &s.m, &s.v)?;
                params
            }
        };
        drop(grad);
        s.synced = false;
        s.stats.steps = step;
        for e in &self.flat.entries {
            e.param.take_grad();
        }
        match self.stage {
            Stage::One | Stage::Two => {
                let flat = self.dp.all_gather(&params, 0)?;
                drop(params);
                self.flat.point_values_at(&flat)?;
                s.params = Params::Flat(flat);
            }
            Stage::Three => {
                // In place, unless rounded from a master copy.
                if s.master.is_some() {
                    s.params = Params::Shard(params);
                } else {
                    drop(params);
                }
                s.recording = false;
                s.cursor = 0;
                s.on_track = true;
                if !self.persistent.is_empty() {
                    let ids = self.persistent.clone();
                    let got = self.gather_now(&s, &ids)?;
                    self.install(&ids, got)?;
                }
            }
        }
        Ok(())
    }
}

impl Zero {
    /// ZeRO-Offload: the host memory that holds this rank's master weights
    /// and optimizer state (`None` without offload).
    pub fn host(&self) -> Option<&Device> {
        self.host.as_ref()
    }

    /// The step with offload: the averaged gradient shard goes to the host
    /// and a worker starts the update there; the parameters come back as
    /// the next forward gathers them.
    fn step_offloaded(&self, s: &mut State, host: &Device, upd: tessera_core::ops::AdamWStep) -> Result<()> {
        let range = self.flat.layout.shard_range(self.rank);
        // Copied to the host now, so the device holds no gradient while
        // the next forward runs.
        let grad = self.grad_shard(s, true)?.to_device(host)?;
        let boundaries = self.flat.pieces_in(range.clone()).iter().map(|p| self.flat.entries[p.entry].offset + p.start + p.len - range.start).collect();
        let master = s.master.clone().expect("offload keeps the master copy");
        s.update = Some(HostUpdate::start(UpdateJob { step: upd, master, grad, m: s.m.clone(), v: s.v.clone(), boundaries })?);
        s.synced = false;
        s.stats.steps = upd.step;
        for e in &self.flat.entries {
            e.param.take_grad();
        }
        match self.stage {
            Stage::One | Stage::Two => {
                // Every value is out of date until its first use gathers it.
                for e in &self.flat.entries {
                    e.param.free_value();
                }
                s.params = Params::Offloaded;
                s.stale.fill(true);
            }
            Stage::Three => {
                s.recording = false;
                s.cursor = 0;
                s.on_track = true;
            }
        }
        if !self.persistent.is_empty() {
            let ids = self.persistent.clone();
            let got = self.gather_now(s, &ids)?;
            self.install(&ids, got)?;
            for &i in &ids {
                s.stale[i] = false;
            }
        }
        Ok(())
    }

    /// Waits for the host update under way, if any, and records its times.
    fn join_update(&self, s: &mut State) -> Result<()> {
        if let Some(update) = s.update.take() {
            let (ran, waited) = update.finish()?;
            s.stats.host_update += ran;
            s.stats.host_update_waited += waited;
        }
        Ok(())
    }

    /// Averages the gradients if that is still to be done.
    fn ensure_synced(&self, s: &mut State) -> Result<()> {
        let synced = if self.stage == Stage::One { s.synced } else { s.grad_shard.is_some() };
        if synced {
            Ok(())
        } else {
            self.finish_locked(s)
        }
    }

    /// This rank's shard of the averaged gradients, flat: at stage 1 cut
    /// from the parameters' (whole, averaged) gradients, at stages 2 and 3
    /// the reduce-scattered shard, taken when `take`.
    fn grad_shard(&self, s: &mut State, take: bool) -> Result<Tensor> {
        let range = self.flat.layout.shard_range(self.rank);
        match self.stage {
            Stage::One => {
                let parts: Vec<Tensor> = self
                    .flat
                    .pieces_in(range.clone())
                    .into_iter()
                    .map(|p| {
                        let e = &self.flat.entries[p.entry];
                        let g = e.param.grad().ok_or_else(|| self.missing_grad(e))?;
                        let g = if g.dtype() == self.flat.dtype { g } else { g.to_dtype(self.flat.dtype)? };
                        flat_view(&g)?.narrow(0, p.start, p.len)
                    })
                    .collect::<Result<_>>()?;
                self.flat.padded_concat(parts, range.len())
            }
            _ if take => Ok(s.grad_shard.take().expect("synchronised above")),
            _ => Ok(s.grad_shard.clone().expect("synchronised above")),
        }
    }

    /// Drops this step's gradients without an update (a step skipped for an
    /// overflow or an anomaly): the averaged shard and every parameter's
    /// gradient, so the next step starts from none.
    pub fn discard_grads(&self) -> Result<()> {
        let mut s = self.state();
        self.ensure_synced(&mut s)?;
        s.grad_shard = None;
        s.synced = false;
        for e in &self.flat.entries {
            e.param.take_grad();
        }
        if self.stage == Stage::Three {
            // The next step's forward gathers as this one's did.
            s.recording = false;
            s.cursor = 0;
            s.on_track = true;
        }
        Ok(())
    }
}

/// The parameters' values a new engine holds: at stage 3 this rank's shard
/// of the flat vector (every parameter's full value freed, but those of the
/// model's root, `persistent`); otherwise the whole flat vector, which every
/// parameter's value becomes a view of.
fn initial_params(flat: &Flat, stage: Stage, rank: usize, persistent: &[usize]) -> Result<Params> {
    let values: Vec<Tensor> = flat.entries.iter().map(|e| e.param.value()).collect::<Result<_>>()?;
    if stage == Stage::Three {
        // Keep only this rank's pieces; drop the full values.
        let range = flat.layout.shard_range(rank);
        let parts: Vec<Tensor> =
            flat.pieces_in(range.clone()).into_iter().map(|p| flat_view(&values[p.entry])?.narrow(0, p.start, p.len)).collect::<Result<_>>()?;
        let shard = flat.padded_concat(parts, range.len())?;
        drop(values);
        for (i, e) in flat.entries.iter().enumerate() {
            if !persistent.contains(&i) {
                e.param.free_value();
            }
        }
        Ok(Params::Shard(shard))
    } else {
        let parts: Vec<Tensor> = values.iter().map(flat_view).collect::<Result<_>>()?;
        drop(values);
        let whole = flat.padded_concat(parts, flat.layout.padded)?;
        flat.point_values_at(&whole)?;
        Ok(Params::Flat(whole))
    }
}

impl Hooks for Zero {
    fn before_forward(&self, path: &str) -> Result<()> {
        self.on_enter(path)
    }

    fn after_forward(&self, path: &str) -> Result<()> {
        self.on_exit(path);
        Ok(())
    }

    fn before_backward(&self, path: &str) -> Result<()> {
        self.on_enter(path)
    }

    fn after_backward(&self, path: &str) -> Result<()> {
        self.on_exit(path);
        Ok(())
    }

    fn grad_ready(&self, param: &Param) -> Result<()> {
        if let Some(dp) = &self.all_reduce {
            return dp.grad_ready(param);
        }
        let Some(&i) = self.entry_of.get(&param.id()) else {
            return Err(Error::state_mismatch(
                "Zero",
                format!("{param:?} is not a parameter of the model this engine was built for; build one engine per model"),
            ));
        };
        let mut s = self.state();
        // A tied parameter waits for `finish` (see the module documentation).
        if s.packed[i] || s.ready[i] || self.tied[i] {
            return Ok(());
        }
        s.ready[i] = true;
        let members = self.buckets.members(self.buckets.of(i));
        if members.iter().all(|&j| s.ready[j] && !s.packed[j]) {
            s.open = members.to_vec();
            self.launch(&mut s)?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for Zero {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Zero({:?}, rank {} of {}, {:?})", self.stage, self.rank, self.flat.layout.ranks, self.flat.layout)
    }
}
