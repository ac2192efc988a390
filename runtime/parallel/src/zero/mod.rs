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

use crate::data::DataParallel;
use tessera_dist::{Communicator, Pending};
use tessera_core::{Error, Result};
use tessera_nn::module::{self, Hooks, Module, Param};
use tessera_core::ops;
use tessera_optim::{master_dtype, AdamWConfig};
use tessera_core::tensor::{DType, Shape, Tensor};
use tessera_core::Device;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

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
}

impl ZeroConfig {
    /// `stage` with AdamW's defaults, 25 MiB buckets and prefetching on.
    pub fn new(stage: Stage) -> Self {
        ZeroConfig { stage, adamw: AdamWConfig::default(), bucket_bytes: 25 << 20, prefetch: true }
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
}

/// How the flattened parameters are cut into shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlatLayout {
    /// Ψ: elements of all distinct parameters (this rank's tensor-parallel shards).
    pub numel: usize,
    /// Ψ rounded up to a multiple of the group size (the zero padding at the tail).
    pub padded: usize,
    /// Elements per shard: `padded / ranks`.
    pub shard_len: usize,
    /// Ranks of the data-parallel group.
    pub ranks: usize,
}

impl FlatLayout {
    fn new(numel: usize, ranks: usize) -> Self {
        let shard_len = numel.div_ceil(ranks);
        FlatLayout { numel, padded: shard_len * ranks, shard_len, ranks }
    }

    /// The elements of the flat vector that rank `rank` owns.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        rank * self.shard_len..(rank + 1) * self.shard_len
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
    /// Stage 3: sub-module parameter gathers (forward and backward).
    pub gathers: usize,
    /// Stage 3: gathers that a prefetch had already started.
    pub prefetched: usize,
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

/// One distinct parameter and its place in the flat vector.
struct Entry {
    name: String,
    param: Param,
    shape: Shape,
    offset: usize,
    len: usize,
}

/// The part of one parameter that lies in one shard.
#[derive(Clone, Copy, Debug)]
struct Piece {
    entry: usize,
    /// First element within the parameter.
    start: usize,
    len: usize,
}

/// A set of parameters exchanged together, split by the shard each piece lies in.
struct Rows {
    rows: Vec<Vec<Piece>>,
    /// Length every rank's row is padded to.
    width: usize,
}

/// A sub-module whose own parameters stage 3 gathers around its runs.
struct Unit {
    path: String,
    entries: Vec<usize>,
}

/// A gradient bucket in flight (stages 2 and 3).
struct Bucket {
    rows: Rows,
    /// Where this rank's row starts in the result: 0 for a reduce-scatter
    /// (the result is the row), the earlier rows' length for an all-reduce.
    my_start: usize,
    pending: Pending,
}

struct State {
    /// Stages 1 and 2: the full flat parameter vector; every parameter's
    /// value is a view of it.
    flat: Option<Tensor>,
    /// Stage 3: this rank's shard of the flat parameter vector (the master copy).
    shard: Option<Tensor>,
    m: Tensor,
    v: Tensor,
    /// Stages 2 and 3: the parameters of the bucket being packed.
    open: Vec<usize>,
    /// Stages 2 and 3: whether each parameter's gradient was announced this step.
    ready: Vec<bool>,
    /// Whether each parameter's gradient was packed into a bucket this step.
    packed: Vec<bool>,
    inflight: Vec<Bucket>,
    /// Stages 2 and 3: this rank's averaged gradient shard, once finished.
    grad_shard: Option<Tensor>,
    /// Stage 1: whether the gradients were averaged since the last step.
    synced: bool,
    /// Stage 3: how many runs hold each parameter's gathered value.
    held: Vec<usize>,
    /// Stage 3: the gather order recorded during the first step.
    order: Vec<usize>,
    recording: bool,
    /// Position in `order` of the next gather expected.
    cursor: usize,
    /// Whether this step has followed the recorded order so far.
    on_track: bool,
    prefetch: Option<(usize, Pending)>,
    stats: ZeroStats,
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
    layout: FlatLayout,
    entries: Vec<Entry>,
    /// Each parameter's index in `entries`.
    entry_of: HashMap<tessera_nn::module::ParamId, usize>,
    units: Vec<Unit>,
    unit_of_path: HashMap<String, usize>,
    /// Stage 3: parameters owned by the model's root (no sub-module call
    /// announces them), kept gathered.
    persistent: Vec<usize>,
    dtype: DType,
    device: Device,
    all_reduce: Option<DataParallel>,
    /// Stages 2 and 3: the fixed gradient buckets (entry indices, packing
    /// order), the same on every rank whatever order gradients arrive in.
    buckets: Vec<Vec<usize>>,
    bucket_of: Vec<usize>,
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
        const OP: &str = "Zero::new";
        config.adamw.validate()?;
        if config.bucket_bytes == 0 {
            return Err(Error::invalid(OP, "the bucket size must be positive (e.g. 25 MiB)"));
        }
        let mut entries: Vec<Entry> = Vec::new();
        let mut seen: HashMap<tessera_nn::module::ParamId, usize> = HashMap::new();
        let mut owners: Vec<(String, usize)> = Vec::new();
        let mut kind: Option<(DType, Device)> = None;
        let mut problem: Option<String> = None;
        module::visit_params(model, |e| {
            // Another pipeline stage holds (and updates) a remote parameter.
            if e.param.is_remote() {
                return Ok(());
            }
            let index = match seen.get(&e.param.id()) {
                Some(&i) => i,
                None => {
                    let value = e.param.value().map_err(|_| {
                        Error::invalid(OP, format!("parameter `{}` has no value; build (materialise) the model on this rank before sharding it", e.name))
                    })?;
                    let dtype = master_dtype(e.name, &value)?;
                    match &kind {
                        None => kind = Some((dtype, value.device().clone())),
                        Some((d, dev)) if *d != dtype || !dev.same(value.device()) => {
                            problem.get_or_insert_with(|| format!("parameter `{}` is {dtype} on {:?}, the first one {d} on {dev:?}", e.name, value.device()));
                        }
                        Some(_) => {}
                    }
                    let offset = entries.last().map_or(0, |x| x.offset + x.len);
                    entries.push(Entry { name: e.name.to_string(), param: e.param.clone(), shape: value.shape().clone(), offset, len: value.elem_count() });
                    seen.insert(e.param.id(), entries.len() - 1);
                    entries.len() - 1
                }
            };
            let owner = e.module.to_string();
            owners.push((owner, index));
            Ok(())
        })?;
        if let Some(p) = problem {
            return Err(Error::invalid(OP, format!("{p}; ZeRO flattens all parameters into one vector, so materialise them all in one dtype on one device")));
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

        let all_reduce = match config.stage {
            Stage::One => Some(DataParallel::new(model, dp.clone(), config.bucket_bytes)?),
            _ => None,
        };
        // Fixed buckets: the parameters in reverse order (about the order
        // their gradients become final), cut every `bucket_bytes`.
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut filled = config.bucket_bytes;
        for i in (0..entries.len()).rev() {
            if filled >= config.bucket_bytes {
                buckets.push(Vec::new());
                filled = 0;
            }
            buckets.last_mut().expect("pushed").push(i);
            filled += entries[i].len * dtype.size_in_bytes();
        }
        let mut bucket_of = vec![0; entries.len()];
        for (b, members) in buckets.iter().enumerate() {
            for &i in members {
                bucket_of[i] = b;
            }
        }
        let m = Tensor::zeros([layout.shard_len], dtype, &device)?;
        let v = Tensor::zeros([layout.shard_len], dtype, &device)?;
        let n = entries.len();
        let state = State {
            flat: None,
            shard: None,
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
            stats: ZeroStats::default(),
        };
        let entry_of = entries.iter().enumerate().map(|(i, e)| (e.param.id(), i)).collect();
        let zero = Zero {
            stage: config.stage,
            config,
            dp,
            rank,
            layout,
            entries,
            entry_of,
            units,
            unit_of_path,
            persistent,
            dtype,
            device,
            all_reduce,
            buckets,
            bucket_of,
            state: Mutex::new(state),
        };
        {
            let mut s = zero.state();
            let values: Vec<Tensor> = zero.entries.iter().map(|e| e.param.value()).collect::<Result<_>>()?;
            if zero.stage == Stage::Three {
                // Keep only this rank's pieces; drop the full values.
                let range = layout.shard_range(rank);
                let parts: Vec<Tensor> = zero
                    .pieces_in(range.clone())
                    .into_iter()
                    .map(|p| flat_view(&values[p.entry])?.narrow(0, p.start, p.len))
                    .collect::<Result<_>>()?;
                s.shard = Some(zero.padded_concat(parts, range.len())?);
                drop(values);
                for (i, e) in zero.entries.iter().enumerate() {
                    if !zero.persistent.contains(&i) {
                        e.param.free_value();
                    }
                }
            } else {
                let parts: Vec<Tensor> = values.iter().map(flat_view).collect::<Result<_>>()?;
                drop(values);
                let flat = zero.padded_concat(parts, layout.padded)?;
                zero.point_values_at(&flat)?;
                s.flat = Some(flat);
            }
        }
        Ok(zero)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
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
        self.layout
    }

    /// What the engine has done so far.
    pub fn stats(&self) -> ZeroStats {
        self.state().stats
    }

    /// The sub-module paths whose parameters stage 3 gathers around their
    /// runs, in the order of the model's parameters.
    pub fn gathered_paths(&self) -> Vec<&str> {
        self.units.iter().map(|u| u.path.as_str()).collect()
    }

    /// Bytes of optimizer state on this rank (both moments of its shard).
    pub fn state_bytes(&self) -> usize {
        2 * self.layout.shard_len * self.dtype.size_in_bytes()
    }

    /// Every distinct parameter's full value, with its name, in visit order.
    ///
    /// In stage 3 this all-gathers the shards (every rank must call it at
    /// the same point); in stages 1 and 2 every rank already holds them.
    pub fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let s = self.state();
        let flat = match (&s.flat, &s.shard) {
            (Some(flat), _) => flat.clone(),
            (None, Some(shard)) => self.dp.all_gather(shard, 0)?,
            (None, None) => unreachable!("one of the two is always set"),
        };
        self.entries.iter().map(|e| Ok((e.name.clone(), flat.narrow(0, e.offset, e.len)?.reshape(e.shape.clone())?))).collect()
    }

    /// The parameters this rank's shard of the flat vector covers, in order:
    /// what each element of [`shard_state`](Self::shard_state)'s tensors is.
    pub fn shard_pieces(&self) -> Vec<ShardPiece> {
        let range = self.layout.shard_range(self.rank);
        self.pieces_in(range.clone())
            .into_iter()
            .map(|p| {
                let e = &self.entries[p.entry];
                ShardPiece { name: e.name.clone(), param: e.param.clone(), elements: p.start..p.start + p.len, offset: e.offset + p.start - range.start }
            })
            .collect()
    }

    /// This rank's shard of the parameters and of the optimizer state (what
    /// a checkpoint saves). The tensors are views of the live state, which
    /// the next [`step`](Self::step) updates in place: copy them to keep them.
    pub fn shard_state(&self) -> Result<ShardState> {
        let s = self.state();
        let params = match (&s.flat, &s.shard) {
            (Some(flat), _) => {
                let range = self.layout.shard_range(self.rank);
                flat.narrow(0, range.start, range.len())?
            }
            (None, Some(shard)) => shard.clone(),
            (None, None) => unreachable!("one of the two is always set"),
        };
        Ok(ShardState { params, m: s.m.clone(), v: s.v.clone(), steps: s.stats.steps })
    }

    /// Replaces this rank's shard of the parameters and of the optimizer
    /// state (restoring a checkpoint, between steps). Every rank of the
    /// group calls it together: stages 1 and 2 all-gather the parameters
    /// again, stage 3 regathers those it keeps whole.
    pub fn load_shard_state(&self, state: ShardState) -> Result<()> {
        const OP: &str = "Zero::load_shard_state";
        let want = Shape::new([self.layout.shard_len]);
        for (what, t) in [("parameter", &state.params), ("first-moment", &state.m), ("second-moment", &state.v)] {
            if *t.shape() != want || t.dtype() != self.dtype {
                return Err(Error::shape(OP, format!("a {what} shard of {} {}, this rank's shard is {} {want}; restore state for the same model and data-parallel degree", t.dtype(), t.shape(), self.dtype)));
            }
        }
        let mut s = self.state();
        if !s.inflight.is_empty() || s.grad_shard.is_some() || s.synced {
            return Err(Error::invalid(OP, "gradients of a step are still being reduced; restore state between steps (after `step`, before the next backward)"));
        }
        s.m = state.m;
        s.v = state.v;
        s.stats.steps = state.steps;
        match self.stage {
            Stage::One | Stage::Two => {
                let flat = self.dp.all_gather(&state.params, 0)?;
                self.point_values_at(&flat)?;
                s.flat = Some(flat);
            }
            Stage::Three => {
                s.shard = Some(state.params);
                if !self.persistent.is_empty() {
                    let ids = self.persistent.clone();
                    let got = self.gather_now(&s, &ids)?;
                    self.install(&ids, got)?;
                }
            }
        }
        Ok(())
    }

    /// Stage 3: gathers the parameters of the sub-module at `path` (owned
    /// by it directly; `""` for the model's root, whose parameters stay
    /// gathered anyway) for a run that no sub-module call announces, such as
    /// a layer called directly. Pair it with [`release_for`](Self::release_for).
    /// Other stages hold every parameter already: a no-op.
    pub fn gather_for(&self, path: &str) -> Result<()> {
        if self.stage != Stage::Three {
            return Ok(());
        }
        if path.is_empty() {
            return self.acquire_entries(&(0..self.entries.len()).collect::<Vec<_>>());
        }
        match self.unit_of_path.get(path) {
            Some(&u) => self.acquire(u),
            None => Err(self.unknown_path(path)),
        }
    }

    /// Stage 3: frees what [`gather_for`](Self::gather_for) gathered.
    pub fn release_for(&self, path: &str) -> Result<()> {
        if self.stage != Stage::Three {
            return Ok(());
        }
        if path.is_empty() {
            self.release_entries(&(0..self.entries.len()).collect::<Vec<_>>());
            return Ok(());
        }
        match self.unit_of_path.get(path) {
            Some(&u) => {
                self.release_entries(&self.units[u].entries);
                Ok(())
            }
            None => Err(self.unknown_path(path)),
        }
    }

    fn unknown_path(&self, path: &str) -> Error {
        Error::invalid(
            "Zero::gather_for",
            format!("no sub-module at `{path}` owns parameters; pass one of {:?}, or \"\" for the whole model", self.gathered_paths()),
        )
    }

    /// Averages the gradients over the group: waits for every bucket started
    /// during the backward, after reducing the rest. Stage 1 writes the
    /// averages back into the parameters' gradients; stages 2 and 3 keep
    /// only this rank's shard of them and drop the full gradients.
    ///
    /// [`step`](Self::step) calls it when the caller has not.
    pub fn finish(&self) -> Result<()> {
        let mut s = self.state();
        self.finish_locked(&mut s)
    }

    fn finish_locked(&self, s: &mut State) -> Result<()> {
        if let Some(dp) = &self.all_reduce {
            let st = dp.finish()?;
            s.stats.grad_buckets += st.buckets;
            s.stats.grad_buckets_during_backward += st.launched_during_backward;
            if let Some(e) = self.entries.iter().find(|e| e.param.grad().is_none()) {
                return Err(self.missing_grad(e));
            }
            s.synced = true;
            return Ok(());
        }
        s.stats.grad_buckets_during_backward += s.inflight.len();
        // Buckets not sent yet (gradients complete but never announced, or
        // never final) go now, each whole, in the fixed order.
        for members in &self.buckets {
            if members.iter().all(|&i| s.packed[i]) {
                continue;
            }
            if let Some(&i) = members.iter().find(|&&i| self.entries[i].param.grad().is_none()) {
                return Err(self.missing_grad(&self.entries[i]));
            }
            s.open = members.clone();
            self.launch(s)?;
        }
        let scale = 1.0 / self.layout.ranks as f64;
        let base = self.rank * self.layout.shard_len;
        let mut pieces: Vec<(usize, Tensor)> = Vec::new();
        for b in std::mem::take(&mut s.inflight) {
            let summed = b.pending.wait()?;
            let mine: usize = b.rows.rows[self.rank].iter().map(|p| p.len).sum();
            let mean = ops::scale(&flat_view(&summed)?.narrow(0, b.my_start, mine)?, scale)?;
            drop(summed);
            let mut at = 0;
            for p in &b.rows.rows[self.rank] {
                pieces.push((self.entries[p.entry].offset + p.start - base, mean.narrow(0, at, p.len)?));
                at += p.len;
            }
        }
        pieces.sort_by_key(|(o, _)| *o);
        let mut parts = Vec::with_capacity(pieces.len() + 1);
        let mut at = 0;
        for (o, t) in pieces {
            if o != at {
                return Err(Error::invalid("Zero::finish", format!("gradient pieces of shard {} do not tile it (gap at {at}, next piece at {o}); a parameter was reduced twice or not at all", self.rank)));
            }
            at += t.elem_count();
            parts.push(t);
        }
        s.grad_shard = Some(self.padded_concat(parts, self.layout.shard_len)?);
        s.packed.iter_mut().for_each(|p| *p = false);
        s.ready.iter_mut().for_each(|r| *r = false);
        Ok(())
    }

    fn missing_grad(&self, e: &Entry) -> Error {
        Error::invalid(
            "Zero::finish",
            format!(
                "parameter `{}` has no gradient this step; ZeRO updates every parameter from its averaged gradient, so every parameter must take part in the forward and backward on every rank (run the backward before the step, or leave unused parameters out of the model)",
                e.name
            ),
        )
    }

    /// Packs the open bucket (stages 2 and 3) and starts its reduce-scatter;
    /// drops the full gradients it packed.
    fn launch(&self, s: &mut State) -> Result<()> {
        if s.open.is_empty() {
            return Ok(());
        }
        let ids = std::mem::take(&mut s.open);
        let rows = self.rows(&ids);
        let grads: HashMap<usize, Tensor> = ids
            .iter()
            .map(|&i| {
                let e = &self.entries[i];
                let g = e.param.grad().ok_or_else(|| self.missing_grad(e))?;
                let g = if g.dtype() == self.dtype { g } else { g.to_dtype(self.dtype)? };
                Ok((i, flat_view(&g)?))
            })
            .collect::<Result<_>>()?;
        // A reduce-scatter needs rows of equal width: when the bucket's
        // elements fall unevenly among the shards, the padding would cost
        // more than an all-reduce of the bucket (2(N-1)/N of its length per
        // rank, against (N-1)/N of N rows), so the bucket is all-reduced.
        let total: usize = rows.rows.iter().flatten().map(|p| p.len).sum();
        let scatter = rows.width * self.layout.ranks <= 2 * total;
        let mut parts = Vec::new();
        let mut my_start = 0;
        for (r, row) in rows.rows.iter().enumerate() {
            let mut len = 0;
            for p in row {
                parts.push(grads[&p.entry].narrow(0, p.start, p.len)?);
                len += p.len;
            }
            if scatter && len < rows.width {
                parts.push(Tensor::zeros([rows.width - len], self.dtype, &self.device)?);
            }
            if !scatter && r < self.rank {
                my_start += len;
            }
        }
        let packed = Tensor::concat_flat(&parts.iter().collect::<Vec<_>>())?;
        drop(parts);
        drop(grads);
        for &i in &ids {
            self.entries[i].param.take_grad();
            s.packed[i] = true;
        }
        let pending = if scatter { self.dp.reduce_scatter_sum_async(&packed, 0)? } else { self.dp.all_reduce_sum_async(&packed)? };
        s.stats.grad_buckets += 1;
        s.inflight.push(Bucket { rows, my_start, pending });
        Ok(())
    }

    /// One AdamW update of this rank's shard at learning rate `lr` (after
    /// [`finish`](Self::finish), which it calls if the caller has not);
    /// stages 1 and 2 then all-gather the updated parameters. Consumes the
    /// gradients.
    pub fn step(&self, lr: f64) -> Result<()> {
        let mut s = self.state();
        let synced = if self.stage == Stage::One { s.synced } else { s.grad_shard.is_some() };
        if !synced {
            self.finish_locked(&mut s)?;
        }
        let step = s.stats.steps + 1;
        let upd = self.config.adamw.at(step, lr)?;
        let range = self.layout.shard_range(self.rank);
        let grad = match self.stage {
            Stage::One => {
                let parts: Vec<Tensor> = self
                    .pieces_in(range.clone())
                    .into_iter()
                    .map(|p| {
                        let e = &self.entries[p.entry];
                        let g = e.param.grad().ok_or_else(|| self.missing_grad(e))?;
                        let g = if g.dtype() == self.dtype { g } else { g.to_dtype(self.dtype)? };
                        flat_view(&g)?.narrow(0, p.start, p.len)
                    })
                    .collect::<Result<_>>()?;
                self.padded_concat(parts, range.len())?
            }
            _ => s.grad_shard.take().expect("finished above"),
        };
        let params = match (&s.flat, &s.shard) {
            (Some(flat), _) => flat.narrow(0, range.start, range.len())?,
            (None, Some(shard)) => shard.clone(),
            (None, None) => unreachable!("one of the two is always set"),
        };
        ops::adamw_update(&upd, &params, &grad, &s.m, &s.v)?;
        drop(grad);
        s.synced = false;
        s.stats.steps = step;
        for e in &self.entries {
            e.param.take_grad();
        }
        match self.stage {
            Stage::One | Stage::Two => {
                let flat = self.dp.all_gather(&params, 0)?;
                drop(params);
                self.point_values_at(&flat)?;
                s.flat = Some(flat);
            }
            Stage::Three => {
                drop(params);
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

    /// Stages 1 and 2: makes every parameter's value a view of `flat`.
    fn point_values_at(&self, flat: &Tensor) -> Result<()> {
        for e in &self.entries {
            e.param.set_value(flat.narrow(0, e.offset, e.len)?.reshape(e.shape.clone())?)?;
        }
        Ok(())
    }

    /// The pieces of the flat range `range` (within one shard), in order.
    fn pieces_in(&self, range: Range<usize>) -> Vec<Piece> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let (a, b) = (e.offset.max(range.start), (e.offset + e.len).min(range.end));
                (a < b).then(|| Piece { entry: i, start: a - e.offset, len: b - a })
            })
            .collect()
    }

    /// Splits the parameters `ids` by the shard each of their elements lies in.
    fn rows(&self, ids: &[usize]) -> Rows {
        let sl = self.layout.shard_len;
        let mut rows = vec![Vec::new(); self.layout.ranks];
        for &i in ids {
            let e = &self.entries[i];
            let end = e.offset + e.len;
            let mut at = e.offset;
            while at < end {
                let r = at / sl;
                let stop = ((r + 1) * sl).min(end);
                rows[r].push(Piece { entry: i, start: at - e.offset, len: stop - at });
                at = stop;
            }
        }
        let width = rows.iter().map(|r: &Vec<Piece>| r.iter().map(|p| p.len).sum::<usize>()).max().unwrap_or(0).max(1);
        Rows { rows, width }
    }

    /// `parts` joined and padded with zeros to `len` elements.
    fn padded_concat(&self, mut parts: Vec<Tensor>, len: usize) -> Result<Tensor> {
        let have: usize = parts.iter().map(Tensor::elem_count).sum();
        if have < len {
            parts.push(Tensor::zeros([len - have], self.dtype, &self.device)?);
        }
        Tensor::concat_flat(&parts.iter().collect::<Vec<_>>())
    }

    /// Stage 3: this rank's row of a gather of `rows`.
    fn my_row(&self, s: &State, rows: &Rows) -> Result<Tensor> {
        let shard = s.shard.as_ref().expect("stage 3 holds a shard");
        let base = self.rank * self.layout.shard_len;
        let parts: Vec<Tensor> = rows.rows[self.rank]
            .iter()
            .map(|p| shard.narrow(0, self.entries[p.entry].offset + p.start - base, p.len))
            .collect::<Result<_>>()?;
        self.padded_concat(parts, rows.width)
    }

    /// Stage 3: starts gathering the parameters `ids`.
    fn gather_async(&self, s: &State, ids: &[usize]) -> Result<Pending> {
        let rows = self.rows(ids);
        let row = self.my_row(s, &rows)?;
        self.dp.all_gather_async(&row, 0)
    }

    /// Stage 3: gathers the parameters `ids` now.
    fn gather_now(&self, s: &State, ids: &[usize]) -> Result<Tensor> {
        self.gather_async(s, ids)?.wait()
    }

    /// Stage 3: sets the values of `ids` from their gathered rows.
    fn install(&self, ids: &[usize], gathered: Tensor) -> Result<()> {
        let rows = self.rows(ids);
        for &i in ids {
            let mut parts = Vec::new();
            for (r, row) in rows.rows.iter().enumerate() {
                let mut at = r * rows.width;
                for p in row {
                    if p.entry == i {
                        parts.push(gathered.narrow(0, at, p.len)?);
                    }
                    at += p.len;
                }
            }
            let e = &self.entries[i];
            let value = Tensor::concat_flat(&parts.iter().collect::<Vec<_>>())?.reshape(e.shape.clone())?;
            e.param.set_value(value)?;
        }
        Ok(())
    }

    /// Stage 3: gathers unit `u` (from its prefetch if one was started) and
    /// starts prefetching the unit expected next.
    fn acquire(&self, u: usize) -> Result<()> {
        let mut s = self.state();
        let ids = &self.units[u].entries;
        s.stats.gathers += 1;
        let prefetched = match s.prefetch.take() {
            Some((pu, pending)) if pu == u => {
                s.stats.prefetched += 1;
                Some(pending.wait()?)
            }
            Some((_, pending)) => {
                // Off the recorded order: the prefetch was issued on every
                // rank, so complete it, but use it no more this step.
                pending.wait()?;
                s.on_track = false;
                None
            }
            None => None,
        };
        let gathered = match prefetched {
            Some(g) => g,
            None => self.gather_now(&s, ids)?,
        };
        self.install(ids, gathered)?;
        for &i in ids {
            s.held[i] += 1;
        }
        if s.recording {
            s.order.push(u);
        } else if s.on_track && s.order.get(s.cursor) == Some(&u) {
            s.cursor += 1;
            if self.config.prefetch {
                if let Some(&next) = s.order.get(s.cursor) {
                    let pending = self.gather_async(&s, &self.units[next].entries)?;
                    s.prefetch = Some((next, pending));
                }
            }
        } else {
            s.on_track = false;
        }
        Ok(())
    }

    /// Stage 3: gathers the parameters `ids` for a run announced by the caller.
    fn acquire_entries(&self, ids: &[usize]) -> Result<()> {
        let mut s = self.state();
        if let Some((_, pending)) = s.prefetch.take() {
            pending.wait()?;
            s.on_track = false;
        }
        let gathered = self.gather_now(&s, ids)?;
        self.install(ids, gathered)?;
        for &i in ids {
            s.held[i] += 1;
        }
        Ok(())
    }

    /// Stage 3: one run no longer needs `ids`; frees those no run holds.
    fn release_entries(&self, ids: &[usize]) {
        let mut s = self.state();
        for &i in ids {
            s.held[i] = s.held[i].saturating_sub(1);
            if s.held[i] == 0 && !self.persistent.contains(&i) {
                self.entries[i].param.free_value();
            }
        }
    }

    fn on_enter(&self, path: &str) -> Result<()> {
        match self.unit_of_path.get(path) {
            Some(&u) if self.stage == Stage::Three => self.acquire(u),
            _ => Ok(()),
        }
    }

    fn on_exit(&self, path: &str) {
        if let (Some(&u), Stage::Three) = (self.unit_of_path.get(path), self.stage) {
            self.release_entries(&self.units[u].entries);
        }
    }
}

/// A contiguous tensor as one dimension (a view when it already is contiguous).
fn flat_view(t: &Tensor) -> Result<Tensor> {
    t.contiguous()?.reshape([t.elem_count()])
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
            return Err(Error::invalid("Zero", format!("{param:?} is not a parameter of the model this engine was built for; build one engine per model")));
        };
        let mut s = self.state();
        if s.packed[i] || s.ready[i] {
            return Ok(());
        }
        s.ready[i] = true;
        let b = self.bucket_of[i];
        if self.buckets[b].iter().all(|&j| s.ready[j] && !s.packed[j]) {
            s.open = self.buckets[b].clone();
            self.launch(&mut s)?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for Zero {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Zero({:?}, rank {} of {}, {:?})", self.stage, self.rank, self.layout.ranks, self.layout)
    }
}
