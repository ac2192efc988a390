//! The cost model: the memory and the time of one training step of a model
//! laid out over a cluster.
//!
//! What the model costs comes from its own description
//! ([`Module::describe`](tessera_nn::module::Module::describe)): per token of
//! a micro-batch, each layer's matrix FLOPs, the bytes it keeps and moves,
//! its collectives, its parameters and where a pipeline places them. What
//! the cluster can do comes from its [`ClusterProfile`]. The step is then:
//!
//! - **compute** per pipeline stage and micro-batch: FLOPs at the device's
//!   matrix rate plus element-wise bytes at its memory bandwidth, with the
//!   tensor- and expert-parallel collectives on the critical path (less
//!   the products that run beside one, where the link overlaps compute);
//! - **the pipeline**: the schedule Tessera runs (GPipe, 1F1B or
//!   interleaved) replayed by its simulator with those costs and the
//!   stage-to-stage transfers, which gives the makespan and the bubble;
//! - **data parallelism**: the gradients' reduction (a reduce-scatter and an
//!   all-gather with ZeRO, the parameters gathered each micro-batch at
//!   stage 3) over its group's link, less the part the backward hides where
//!   the link overlaps compute;
//! - **the optimizer**: AdamW's pass over the rank's state at memory bandwidth.
//!
//! Memory per rank, on the stage that holds the most: the model states
//! ([`memory::model_states`](crate::memory::model_states)) of its share of the
//! parameters, the activations the schedule keeps in flight, the logits and
//! their gradient, the layer a recompute brings back, and the backward's
//! working buffers.
//!
//! Groups sit in the mesh order `dp × ep × cp × pp × tp` (tensor parallel
//! innermost), so tensor-parallel groups fill a node first, and a group's
//! link is the node's or the one between nodes by where it falls
//! ([`ClusterProfile::link`]).
//!
//! Context parallelism gives each rank `1/cp` of every sequence's tokens:
//! everything per token (FLOPs, activations, logits) is counted over those,
//! attention's FLOPs per token stay those of the whole sequence (the split
//! balances them), its key/value ring is a collective of the cp group, and
//! the cp ranks are data replicas for the gradients and ZeRO's shards.

use crate::collective::Collective;
use crate::memory::{model_states, Precision, StateBytes, ZeroStage};
use crate::profile::{ClusterProfile, Link};
use tessera_core::{DType, Error, Result};
use tessera_nn::module::{CollectiveKind, CostSettings, Group, ModelCost, Pass, RecomputeOverride, StagePart};
use tessera_parallel::pipeline::{Action, Costs, ScheduleKind};

/// One way to lay out a training step: the parallel degrees, the schedule,
/// the batch and what is kept.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Layout {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Expert-parallel degree (its ranks are data-parallel replicas too).
    pub ep: usize,
    /// Context-parallel degree: every sequence split over `cp` ranks (for
    /// the gradients, replicas too).
    pub cp: usize,
    /// Sequence parallelism over the tensor-parallel group.
    pub sp: bool,
    /// The pipeline schedule (its chunks are the virtual stages per stage).
    pub schedule: ScheduleKind,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per step on each replica (the pipeline's micro-batches).
    pub grad_accum: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Which recompute runs.
    pub recompute: RecomputeOverride,
    /// The ZeRO stage over the data-parallel replicas.
    pub zero: ZeroStage,
    /// The dtype activations are computed in (`F32` or `BF16`).
    pub compute: DType,
    /// Whether parameters (and gradients) are held in the compute dtype with
    /// an f32 master copy in the optimizer, rather than in f32.
    pub half_params: bool,
    /// Bytes of a data-parallel gradient bucket (`mesh.bucket_bytes`).
    pub bucket_bytes: usize,
    /// ZeRO-Offload (`zero.offload`, with a ZeRO stage): the master copy and
    /// the moments, and at stage 3 the parameter shard, in host memory; the
    /// update on the host CPU, overlapping the next forward.
    pub offload: bool,
}

/// Bytes per second between a GPU and its host (PCIe 4.0 x16 as measured,
/// about half its peak; the ZeRO-Offload paper's figures are of this order).
pub const HOST_LINK_BYTES_PER_S: f64 = 25e9;

/// Bytes per second of one GPU's share of its host's memory bandwidth for
/// the CPU AdamW (a two-socket server's ~300 GB/s over 8 GPUs, with the
/// rest of the host's work beside it).
pub const HOST_ADAMW_BYTES_PER_S: f64 = 20e9;

impl Layout {
    /// Whether the optimizer state is in host memory (offload needs a ZeRO stage).
    pub fn offloaded(&self) -> bool {
        self.offload && self.zero >= ZeroStage::One
    }

    /// Ranks the layout runs on.
    pub fn world(&self) -> usize {
        self.dp * self.ep * self.cp * self.pp * self.tp
    }

    /// Tokens of a micro-batch on one rank (its share under context parallelism).
    pub fn tokens(&self) -> f64 {
        (self.micro_batch * self.seq_len) as f64 / self.cp as f64
    }

    /// The ranks holding the same dense parameters, over which their
    /// gradients are summed and ZeRO shards them: dp × cp × ep.
    fn dense_replicas(&self) -> usize {
        self.dp * self.cp * self.ep
    }

    /// The ranks holding the same experts: dp × cp.
    fn expert_replicas(&self) -> usize {
        self.dp * self.cp
    }

    /// Sequences per step over all replicas.
    pub fn global_batch(&self) -> usize {
        self.dp * self.ep * self.grad_accum * self.micro_batch
    }

    /// Model chunks per pipeline stage.
    pub fn chunks(&self) -> usize {
        self.schedule.chunks()
    }

    /// The description a layout asks of the model.
    pub fn settings(&self) -> CostSettings {
        CostSettings { tp: self.tp, sp: self.sp, ep: self.ep, cp: self.cp, seq_len: self.seq_len, dtype: self.compute, recompute: self.recompute }
    }

    /// Bytes per parameter of the model states.
    fn precision(&self) -> Precision {
        if self.half_params {
            Precision { param: self.compute.size_in_bytes() as f64, grad: self.compute.size_in_bytes() as f64, ..Precision::BF16_ADAMW }
        } else {
            Precision::F32_ADAMW
        }
    }
}

/// Where a step's time goes, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTime {
    /// The whole step.
    pub step: f64,
    /// Forward, backward and recompute on the slowest stage, all micro-batches.
    pub compute: f64,
    /// Tensor- and expert-parallel collectives and the context-parallel
    /// ring on the critical path.
    pub model_comm: f64,
    /// The pipeline's idle time on the slowest stage (fill and drain) and
    /// its transfers.
    pub bubble: f64,
    /// Data-parallel communication not hidden by the backward.
    pub dp_exposed: f64,
    /// Data-parallel communication in all.
    pub dp_total: f64,
    /// The optimizer's update.
    pub optimizer: f64,
}

/// What a rank holds at its peak, in bytes, on the stage that holds the most.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepMemory {
    /// Parameters, gradients and optimizer states.
    pub states: StateBytes,
    /// Activations kept for the backward, over the micro-batches in flight.
    pub activations: f64,
    /// The logits and their gradient (the last stage).
    pub logits: f64,
    /// Buffers of the backward: a layer brought back by recompute, the
    /// activation gradients, a weight's gradient before it is added.
    pub workspace: f64,
    /// With ZeRO-Offload: the rank's bytes in host memory (the f32 master
    /// copy and both moments of its shard, and the gradient shard copied
    /// over for the update); not part of [`total`](Self::total).
    pub host: f64,
}

impl StepMemory {
    /// All of it, on the device.
    pub fn total(&self) -> f64 {
        self.states.total() + self.activations + self.logits + self.workspace
    }
}

/// The cost model's verdict on a layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// The layout.
    pub layout: Layout,
    /// Time of one step.
    pub time: StepTime,
    /// Memory per rank.
    pub memory: StepMemory,
    /// The model's training FLOPs per token (forward and backward, no
    /// recompute, as one device would run them): MFU's numerator.
    pub model_flops_per_token: f64,
    /// Tokens per second over the whole job.
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation: model FLOPs per second over the ranks' peak.
    pub mfu: f64,
}

/// The pipeline stage and chunk a part of the model runs on, with `pp`
/// stages of `chunks` chunks (Tessera's placement: virtual stage `k` is
/// chunk `k / pp` of stage `k % pp`, layers split evenly over virtual stages).
fn virtual_stage(part: StagePart, pp: usize, chunks: usize) -> Option<usize> {
    let v = pp * chunks;
    match part {
        StagePart::Whole => None,
        StagePart::First => Some(0),
        StagePart::Last => Some(v - 1),
        StagePart::Layer { index, count } => {
            let (base, extra) = (count / v, count % v);
            // The inverse of `Stack::stage_range`: the first `extra` virtual
            // stages hold one layer more.
            let long = extra * (base + 1);
            Some(if index < long { index / (base + 1) } else { extra + (index - long) / base.max(1) })
        }
    }
}

/// The per-micro-batch time of one virtual stage's compute.
#[derive(Clone, Copy, Debug, Default)]
struct ChunkCost {
    forward: f64,
    backward: f64,
}

/// What the layout puts on each stage: kept bytes per micro-batch of each
/// virtual stage, the parameters per rank of each stage (dense ones,
/// replicated over dp × ep, and expert ones, over dp), and the parameters
/// per rank of the stage's largest module (the unit the backward makes a
/// gradient for at a time, and ZeRO-3 gathers at a time).
struct Placed {
    saved: Vec<f64>,
    dense: Vec<f64>,
    experts: Vec<f64>,
    largest_module: Vec<f64>,
}

/// The virtual stages `part` runs on (all of them for a part every stage holds).
fn stages_of(part: StagePart, l: &Layout) -> Vec<usize> {
    let v = l.pp * l.chunks();
    virtual_stage(part, l.pp, l.chunks()).map_or_else(|| (0..v).collect(), |k| vec![k])
}

fn place(cost: &ModelCost, l: &Layout) -> Placed {
    let tokens = l.tokens();
    let mut saved = vec![0.0; l.pp * l.chunks()];
    for layer in &cost.layers {
        for k in stages_of(layer.stage, l) {
            saved[k] += tokens * layer.saved_bytes;
        }
    }
    let (mut dense, mut experts) = (vec![0.0; l.pp], vec![0.0; l.pp]);
    // Parameters per rank of each module (the parameter's name less its
    // last part) on each stage.
    let mut modules: Vec<std::collections::HashMap<&str, f64>> = vec![Default::default(); l.pp];
    for p in &cost.params {
        // A tied weight's second name is the same memory on one stage, a
        // copy on another (the pipeline keeps the two in step).
        if p.tied && l.pp == 1 {
            continue;
        }
        let n = p.elements_per_rank(l.tp, l.ep);
        for s in dedup(stages_of(p.stage, l).into_iter().map(|k| k % l.pp).collect()) {
            if p.expert {
                experts[s] += n;
            } else {
                dense[s] += n;
            }
            let module = p.name.rsplit_once('.').map_or("", |(m, _)| m);
            *modules[s].entry(module).or_default() += n;
        }
    }
    let largest_module = modules.iter().map(|m| m.values().copied().fold(0.0, f64::max)).collect();
    Placed { saved, dense, experts, largest_module }
}

/// The memory of one rank at its peak, on the stage that holds the most,
/// for `layout` of the model `cost` describes (for `layout.settings()`).
pub fn memory(cost: &ModelCost, layout: &Layout) -> Result<StepMemory> {
    memory_of(cost, layout, &place(cost, layout))
}

/// [`memory`] of what [`place`] put on each stage.
///
/// A stage's peak is the largest of the moments its schedule passes
/// through (Tessera's engines drop the gradients after each step, so they
/// exist only once a backward has run in it):
///
/// - after each forward and at the start of each backward: the model
///   states, the gradients if an earlier backward of the step made them,
///   and the activations of the micro-batches in flight;
/// - at the start of the stage's last backward, with data parallelism: the
///   gradient buckets being packed and reduced as well;
/// - at the update: the states, and under ZeRO-1 and -2 the new flat
///   parameter buffer the all-gather fills while the old one is live.
///
/// On top of the activations come the backward's working buffers: the
/// layer a recompute brings back, an activation and its gradient at the
/// stage's boundary, the gradient of the module the backward is in (twice
/// while micro-batches accumulate: the new one before it is added), and
/// under ZeRO-3 the gathered parameters of the module running and of the
/// one prefetched, each as gathered rows and as assembled tensors.
fn memory_of(cost: &ModelCost, layout: &Layout, placed: &Placed) -> Result<StepMemory> {
    let l = layout;
    let tokens = l.tokens();
    let bytes = l.compute.size_in_bytes() as f64;
    let chunks = l.chunks();
    let schedule = if l.pp > 1 { Some(l.schedule.build(l.pp, l.grad_accum)?) } else { None };
    let precision = l.precision();
    let accumulating = l.grad_accum > 1;
    let mut worst = StepMemory::default();
    let mut most_host = 0.0f64;
    for s in 0..l.pp {
        let mut full =
            add(model_states(placed.dense[s], l.dense_replicas(), l.zero, precision), model_states(placed.experts[s], l.expert_replicas(), l.zero, precision));
        let mut host = 0.0;
        if l.offloaded() {
            // On the host: the optimizer state, and stage 3's parameter
            // shard (the gathered modules are counted below); there, an
            // f32 master copy whatever the parameters are held in, and the
            // gradient shard during the update.
            let shard = placed.dense[s] / l.dense_replicas() as f64 + placed.experts[s] / l.expert_replicas() as f64;
            host = shard * (4.0 + 8.0 + precision.grad);
            full.optimizer = 0.0;
            if l.zero >= ZeroStage::Three {
                full.params = 0.0;
            }
        }
        let mut with_grads = full;
        if l.zero >= ZeroStage::Two && accumulating {
            // Gradients accumulate whole over the micro-batches; only the
            // last backward's buckets are reduce-scattered into shards.
            with_grads.grads = (placed.dense[s] + placed.experts[s]) * precision.grad;
        }
        let without_grads = StateBytes { grads: 0.0, ..full };
        // A unit in flight is one chunk's activations; take the stage's largest chunk.
        let chunk_saved = (0..chunks).map(|c| placed.saved[c * l.pp + s]).fold(0.0, f64::max);
        let logits = if s == l.pp - 1 { 2.0 * cost.output_bytes * tokens } else { 0.0 };
        let module_grad = placed.largest_module[s] * precision.grad * if accumulating { 2.0 } else { 1.0 };
        let gathered = if l.zero >= ZeroStage::Three && l.dense_replicas() > 1 { 4.0 * placed.largest_module[s] * precision.param } else { 0.0 };
        let workspace = cost.recompute_peak_bytes * tokens + 2.0 * cost.boundary_bytes.max(bytes) * tokens + module_grad + gathered;
        let buckets = if l.dense_replicas() > 1 { 2.0 * l.bucket_bytes as f64 } else { 0.0 };

        // The stage's forwards and backwards in order (one micro-batch after
        // another without a pipeline).
        // Each is (forward, frees): a split backward's input half is
        // neither, and its weight half frees the unit.
        let order: Vec<(bool, bool)> = match &schedule {
            Some(sc) => sc.actions(s).iter().filter(|a| a.is_compute()).map(|a| (matches!(a, Action::Forward { .. }), a.frees_activations())).collect(),
            None => (0..l.grad_accum).flat_map(|_| [(true, false), (false, true)]).collect(),
        };
        let last_backward = order.iter().rposition(|&(forward, _)| !forward);
        let (mut in_flight, mut backed) = (0usize, false);
        let mut moments = Vec::with_capacity(order.len() + 1);
        for (i, &(forward, frees)) in order.iter().enumerate() {
            if forward {
                in_flight += 1;
            }
            let states = if backed { with_grads } else { without_grads };
            let extra = if !forward && Some(i) == last_backward { buckets } else { 0.0 };
            moments.push(StepMemory { states, activations: in_flight as f64 * chunk_saved, logits, workspace: workspace + extra, host });
            if frees {
                in_flight = in_flight.saturating_sub(1);
            }
            backed |= !forward;
        }
        // (Offloaded, the parameters come back layer by layer instead.)
        let new_flat =
            if matches!(l.zero, ZeroStage::One | ZeroStage::Two) && !l.offloaded() { (placed.dense[s] + placed.experts[s]) * precision.param } else { 0.0 };
        moments.push(StepMemory { states: with_grads, activations: 0.0, logits: 0.0, workspace: new_flat, host });
        most_host = most_host.max(host);
        for m in moments {
            if m.total() > worst.total() {
                worst = m;
            }
        }
    }
    worst.host = most_host;
    Ok(worst)
}

/// The matrix-multiply rate for `dtype` at a product of `m × k` by `k × n`,
/// from the shapes measured (else the datasheet peak): the measured rate
/// where the shape was measured, else a blend of the nearest measured
/// shapes (up to [`BLEND`], by the logarithm of each side), each weighted
/// by the inverse square of its distance. A product between two measured
/// row counts gets a rate between theirs, rather than the whole of the
/// nearer one's: a CPU's rate changes by several times between 64 and 2048
/// rows. Outside the measured range it stays among the nearest measured
/// rates: a blend never leaves the range of what was measured.
fn matmul_rate(cluster: &ClusterProfile, dtype: DType, (m, k, n): (usize, usize, usize)) -> Result<f64> {
    let name = dtype.to_string();
    let log = |a: usize| (a.max(1) as f64).ln();
    let mut near: Vec<(f64, f64)> = cluster
        .device
        .matmul
        .iter()
        .filter(|r| r.dtype == name)
        .map(|r| {
            let d = (log(r.m) - log(m)).powi(2) + (log(r.k) - log(k)).powi(2) + (log(r.n) - log(n)).powi(2);
            (d, r.flops)
        })
        .collect();
    if near.is_empty() {
        return cluster.peak_flops(&name);
    }
    near.sort_by(|a, b| a.0.total_cmp(&b.0));
    if near[0].0 < 1e-12 {
        return Ok(near[0].1);
    }
    // Times, not rates, blend: a product's seconds per flop.
    let (mut weights, mut seconds) = (0.0, 0.0);
    for &(d, flops) in near.iter().take(BLEND) {
        weights += 1.0 / d;
        seconds += 1.0 / (d * flops);
    }
    Ok(weights / seconds)
}

/// How many measured shapes [`matmul_rate`] blends.
const BLEND: usize = 4;

/// Seconds of `kind` moving `bytes` over a group of `size` on `link`.
fn collective_seconds(kind: CollectiveKind, link: &Link, size: usize, bytes: f64) -> f64 {
    let op = match kind {
        CollectiveKind::AllReduce => Collective::AllReduce,
        CollectiveKind::ReduceScatter => Collective::ReduceScatter,
        CollectiveKind::AllGather => Collective::AllGather,
        CollectiveKind::AllToAll => Collective::AllToAll,
        // A block to the next rank, `size − 1` times in sequence.
        CollectiveKind::Ring => return (size - 1) as f64 * Collective::SendRecv.seconds(link, 2, bytes),
    };
    op.seconds(link, size, bytes)
}

/// Estimates `layout` of the model described by `cost` (its description for
/// `layout.settings()`) and `model_flops_per_token`, on `cluster`.
pub fn estimate(cost: &ModelCost, model_flops_per_token: f64, layout: &Layout, cluster: &ClusterProfile) -> Result<Estimate> {
    let l = layout;
    for (name, v) in [
        ("dp", l.dp),
        ("tp", l.tp),
        ("pp", l.pp),
        ("ep", l.ep),
        ("cp", l.cp),
        ("micro_batch", l.micro_batch),
        ("grad_accum", l.grad_accum),
        ("seq_len", l.seq_len),
    ] {
        if v == 0 {
            return Err(Error::config(name, "must be at least 1"));
        }
    }
    let chunks = l.chunks();
    let virtual_stages = l.pp * chunks;
    let tokens = l.tokens();
    let bytes = l.compute.size_in_bytes() as f64;

    // The groups' links, in the mesh order dp × ep × cp × pp × tp.
    let tp_link = cluster.link(l.tp, 1, l.world())?;
    let pp_link = cluster.link(l.pp.min(2), l.tp, l.world())?;
    let cp_link = cluster.link(l.cp, l.tp * l.pp, l.world())?;
    let ep_link = cluster.link(l.ep, l.tp * l.pp * l.cp, l.world())?;
    let dp_link = cluster.link(l.dense_replicas(), l.tp * l.pp, l.world())?;

    // The product shape that stands for the model's: a micro-batch's tokens
    // against the width the pipeline hands on, the MLP's width split over tp.
    let width = (cost.boundary_bytes / bytes).max(1.0) as usize;
    let rate = matmul_rate(cluster, l.compute, (tokens as usize, width, 4 * width / l.tp))?;
    let bandwidth = cluster.device.memory_bandwidth;
    let attention_rate = cluster.device.attention_flops.get(&l.compute.to_string()).copied().unwrap_or(rate);
    let nonlinear = cluster.device.nonlinear;

    // Each virtual stage's compute and model-parallel communication per micro-batch.
    let mut parts = vec![ChunkCost::default(); virtual_stages];
    let every = |part: StagePart| stages_of(part, l);
    let m = tokens as usize;
    for layer in &cost.layers {
        // Products at their own shapes' rates (forward `x·W`, backward
        // `dy·Wᵀ` and `xᵀ·dy`); the other FLOPs at attention's or the
        // representative rate.
        let (mut pf, mut pb, mut flops_f) = (0.0, 0.0, 0.0);
        for p in &layer.products {
            let (rows, f) = (((m as f64) * p.tokens) as usize, 2.0 * (p.k * p.n) as f64 * p.tokens);
            pf += f / matmul_rate(cluster, l.compute, (rows, p.k, p.n))?;
            pb += f / matmul_rate(cluster, l.compute, (rows, p.n, p.k))? + f / matmul_rate(cluster, l.compute, (p.k, rows, p.n))?;
            flops_f += f;
        }
        let r = if layer.attention { attention_rate } else { rate };
        let rest_f = (layer.forward_flops - flops_f).max(0.0) / r;
        let rest_b = (layer.backward_flops - 2.0 * flops_f).max(0.0) / r;
        // Recompute runs the forward again, at the forward's rates.
        let again = if layer.forward_flops > 0.0 { layer.recompute_flops / layer.forward_flops * (pf + rest_f) } else { 0.0 };
        let (nf, nb) = nonlinear.map_or((0.0, 0.0), |n| (layer.forward_nonlinear / n.forward, layer.backward_nonlinear / n.backward));
        for k in every(layer.stage) {
            let p = &mut parts[k];
            p.forward += tokens * (pf + rest_f + layer.forward_traffic / bandwidth + nf);
            p.backward += tokens * (pb + rest_b + again + layer.backward_traffic / bandwidth + nb);
        }
    }
    let mut comm = vec![(0.0, 0.0); virtual_stages];
    // The replicated gradients' sums of the parts each stage runs travel in
    // one all-reduce at the end of its backward.
    let mut backward_sums = vec![0.0; virtual_stages];
    for c in cost.collectives.iter().filter(|c| c.backward_sum) {
        for k in every(c.stage) {
            backward_sums[k] += c.bytes_per_token * tokens + c.bytes_per_micro_batch;
        }
    }
    for (k, &bytes) in backward_sums.iter().enumerate() {
        if bytes > 0.0 {
            comm[k].1 += collective_seconds(CollectiveKind::AllReduce, tp_link, l.tp, bytes);
        }
    }
    for c in cost.collectives.iter().filter(|c| !c.backward_sum) {
        let (link, size) = match c.group {
            Group::Tp => (tp_link, l.tp),
            Group::Ep => (ep_link, l.ep),
            Group::Cp => (cp_link, l.cp),
        };
        let mut seconds = collective_seconds(c.kind, link, size, c.bytes_per_token * tokens + c.bytes_per_micro_batch);
        if link.overlaps_compute {
            // What runs beside it hides that much of it.
            seconds = (seconds - c.beside_flops * tokens / rate).max(0.0);
        }
        for k in every(c.stage) {
            match c.pass {
                Pass::Forward => comm[k].0 += seconds,
                Pass::Backward => comm[k].1 += seconds,
            }
        }
    }
    // Each micro-batch after the first adds its weight gradients into the
    // accumulated ones (two read, one written).
    let grad_bytes = if l.half_params { bytes } else { 4.0 };
    let placed = place(cost, l);
    for (k, part) in parts.iter_mut().enumerate() {
        let s = k % l.pp;
        let held = (placed.dense[s] + placed.experts[s]) / chunks as f64;
        let accumulate = if l.grad_accum > 1 { 3.0 * held * grad_bytes / bandwidth * (l.grad_accum - 1) as f64 / l.grad_accum as f64 } else { 0.0 };
        part.backward += accumulate;
    }
    // The loss on the last stage: a pass over the logits each way.
    let logits = cost.output_bytes * tokens;
    parts[virtual_stages - 1].forward += 2.0 * logits / bandwidth;
    parts[virtual_stages - 1].backward += 2.0 * logits / bandwidth;

    let chunk_time = |k: usize| (parts[k].forward + comm[k].0, parts[k].backward + comm[k].1);
    let (mut forward, mut backward) = (0.0f64, 0.0f64);
    for k in 0..virtual_stages {
        let (f, b) = chunk_time(k);
        forward = forward.max(f);
        backward = backward.max(b);
    }
    let model_comm_per_mb = (0..virtual_stages).map(|k| comm[k].0 + comm[k].1).fold(0.0, f64::max) * chunks as f64;

    // The pipeline: the schedule replayed with the slowest chunk's costs.
    let (pipeline, busy) = if l.pp > 1 {
        let schedule = l.schedule.build(l.pp, l.grad_accum)?;
        let hand_off = Collective::SendRecv.seconds(pp_link, 2, cost.boundary_bytes * tokens);
        // A split backward's weight half: the products' `dW`, about a
        // forward's worth of work (less than half the backward when it recomputes).
        let sim = schedule.simulate(&Costs::new(forward, backward).with_weight(forward.min(backward / 2.0)).with_latency(hand_off))?;
        let busy = sim.stages().iter().map(|s| s.busy).fold(0.0, f64::max);
        // Ranks that share cores lend a waiting rank's share to the busy
        // ones: the step is the work, not the schedule's critical path.
        let makespan = if cluster.ranks_share_cores { busy + l.grad_accum as f64 * 2.0 * hand_off } else { sim.makespan() };
        (makespan, busy)
    } else {
        let t = l.grad_accum as f64 * (forward + backward);
        (t, t)
    };

    let (dense, experts) = (&placed.dense, &placed.experts);

    // Data parallelism: gradients reduced once per step (parameters gathered
    // per micro-batch at stage 3), overlapping the last backward where the link allows.
    let dp_time = |s: usize| -> f64 {
        let group = |params: f64, size: usize| {
            let g = params * grad_bytes;
            let reduce = if l.zero >= ZeroStage::One {
                Collective::ReduceScatter.seconds(dp_link, size, g) + Collective::AllGather.seconds(dp_link, size, g)
            } else {
                Collective::AllReduce.seconds(dp_link, size, g)
            };
            let gathers = if l.zero >= ZeroStage::Three { 2.0 * l.grad_accum as f64 * Collective::AllGather.seconds(dp_link, size, g) } else { 0.0 };
            reduce + gathers
        };
        group(dense[s], l.dense_replicas()) + group(experts[s], l.expert_replicas())
    };
    let dp_total = (0..l.pp).map(dp_time).fold(0.0, f64::max);
    let hidden = if dp_link.overlaps_compute { backward.min(dp_total) } else { 0.0 };
    let dp_exposed = dp_total - hidden;

    // AdamW over the rank's share of the state (at its measured rate, or
    // its traffic: parameter, gradient and both moments read, three
    // written), after the gradient norm's pass over every gradient.
    let replicas = |n: usize| if l.zero >= ZeroStage::One { n as f64 } else { 1.0 };
    let optimizer_params = (0..l.pp).map(|s| dense[s] / replicas(l.dense_replicas()) + experts[s] / replicas(l.expert_replicas())).fold(0.0, f64::max);
    let held = (0..l.pp).map(|s| dense[s] + experts[s]).fold(0.0, f64::max);
    let update = match cluster.device.optimizer_rate {
        Some(rate) => optimizer_params / rate,
        None => optimizer_params * 28.0 / bandwidth,
    };
    let mut optimizer = update + held * grad_bytes / bandwidth;
    if l.offloaded() {
        // The gradient shard goes to the host and the parameters come back
        // (at stage 3 gathered row by row, at stages 1 and 2 once), over
        // the host link; the host's update runs behind the next forward
        // (a third of the compute) and shows only where it is longer.
        let param_bytes = if l.half_params { bytes } else { 4.0 };
        let transfers = optimizer_params * (grad_bytes + param_bytes) / HOST_LINK_BYTES_PER_S;
        let host_update = optimizer_params * 28.0 / HOST_ADAMW_BYTES_PER_S;
        optimizer = held * grad_bytes / bandwidth + transfers + (host_update - busy / 3.0).max(0.0);
    }

    let step = pipeline + dp_exposed + optimizer;
    let compute = busy - l.grad_accum as f64 * model_comm_per_mb;
    let time = StepTime { step, compute, model_comm: l.grad_accum as f64 * model_comm_per_mb, bubble: pipeline - busy, dp_exposed, dp_total, optimizer };

    let memory = memory_of(cost, l, &placed)?;

    let tokens_per_step = (l.global_batch() * l.seq_len) as f64;
    let tokens_per_s = tokens_per_step / step;
    let peak = cluster.peak_flops(&l.compute.to_string())?;
    let mfu = model_flops_per_token * tokens_per_s / (peak * l.world() as f64);
    Ok(Estimate { layout: *l, time, memory, model_flops_per_token, tokens_per_s, mfu })
}

fn add(a: StateBytes, b: StateBytes) -> StateBytes {
    StateBytes { params: a.params + b.params, grads: a.grads + b.grads, optimizer: a.optimizer + b.optimizer }
}

fn dedup(mut v: Vec<usize>) -> Vec<usize> {
    v.sort_unstable();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::DeviceProfile;
    use std::collections::BTreeMap;
    use tessera_nn::module::{CollectiveCost, LayerCost, ParamCost, RoleKind};

    /// A stack of `layers` layers, each `flops` forward (twice that
    /// backward), keeping `saved` bytes and holding `params` parameters, per token.
    fn stack(layers: usize, flops: f64, saved: f64, params: usize) -> ModelCost {
        let stage = |index| StagePart::Layer { index, count: layers };
        ModelCost {
            params: (0..layers)
                .map(|i| ParamCost {
                    name: format!("h.{i}.w"),
                    role: RoleKind::Plain,
                    elements: params,
                    split: false,
                    expert: false,
                    stage: stage(i),
                    tied: false,
                })
                .collect(),
            layers: (0..layers)
                .map(|i| LayerCost { forward_flops: flops, backward_flops: 2.0 * flops, saved_bytes: saved, ..LayerCost::new(format!("h.{i}"), stage(i)) })
                .collect(),
            collectives: Vec::new(),
            recompute_peak_bytes: 0.0,
            output_bytes: 0.0,
            // Free hand-offs: the pipeline's time is its schedule's alone.
            boundary_bytes: 0.0,
        }
    }

    #[test]
    fn a_product_between_measured_shapes_gets_a_rate_between_theirs() {
        use crate::measure::MatmulRate;
        let mut c = cluster(1e12, false);
        let at = |m: usize, flops: f64| MatmulRate { m, n: 256, k: 256, dtype: "f32".into(), flops };
        c.device.matmul = vec![at(64, 1e9), at(256, 4e9), at(2048, 8e9)];
        let rate = |m: usize| matmul_rate(&c, DType::F32, (m, 256, 256)).unwrap();
        // Measured shapes keep their own rates.
        assert_eq!((rate(64), rate(256), rate(2048)), (1e9, 4e9, 8e9));
        // Between two, strictly between, and rising with the rows.
        let (r128, r1024) = (rate(128), rate(1024));
        assert!(1e9 < r128 && r128 < 4e9 && 4e9 < r1024 && r1024 < 8e9, "{r128} {r1024}");
        assert!(rate(100) < r128 && r128 < rate(200));
        // Outside the grid, never beyond what was measured.
        for m in [1, 8, 16_384, 1 << 20] {
            assert!((1e9..=8e9).contains(&rate(m)), "{m}: {}", rate(m));
        }
        // No measured shape of the dtype: the datasheet peak.
        assert!(matmul_rate(&c, DType::BF16, (64, 256, 256)).unwrap_err().to_string().contains("bf16"));
        c.device.peak_flops.insert("bf16".into(), 3e12);
        assert_eq!(matmul_rate(&c, DType::BF16, (64, 256, 256)).unwrap(), 3e12);
    }

    fn cluster(rate: f64, overlaps: bool) -> ClusterProfile {
        let link = Link { bandwidth: 1e9, latency: 0.0, by_size: Vec::new(), overlaps_compute: overlaps };
        ClusterProfile {
            name: "test".into(),
            gpus_per_node: 64,
            device: DeviceProfile {
                name: "test".into(),
                memory_bytes: 1 << 40,
                memory_bandwidth: 1e30,
                peak_flops: BTreeMap::from([("f32".to_string(), rate)]),
                matmul: Vec::new(),
                attention_flops: BTreeMap::new(),
                nonlinear: None,
                optimizer_rate: None,
            },
            intra_node: link,
            inter_node: None,
            ranks_share_cores: false,
            host_memory_bytes: None,
        }
    }

    fn layout(dp: usize, pp: usize, grad_accum: usize, schedule: ScheduleKind) -> Layout {
        Layout {
            dp,
            tp: 1,
            pp,
            ep: 1,
            cp: 1,
            sp: false,
            schedule,
            micro_batch: 1,
            grad_accum,
            seq_len: 10,
            recompute: RecomputeOverride::Off,
            zero: ZeroStage::None,
            compute: DType::F32,
            half_params: false,
            bucket_bytes: 1 << 20,
            offload: false,
        }
    }

    #[test]
    fn layers_go_to_the_virtual_stages_the_stack_gives_them() {
        for count in 1..24 {
            for v in 1..=count.min(8) {
                // Stack::stage_range: the first `count % v` stages hold one more.
                let (base, extra) = (count / v, count % v);
                for k in 0..v {
                    let start = k * base + k.min(extra);
                    for index in start..start + base + usize::from(k < extra) {
                        assert_eq!(virtual_stage(StagePart::Layer { index, count }, v, 1), Some(k), "layer {index} of {count} over {v}");
                    }
                }
            }
        }
    }

    #[test]
    fn one_device_computes_every_micro_batch_in_turn() {
        let cost = stack(4, 100.0, 8.0, 0);
        let e = estimate(&cost, 300.0, &layout(1, 1, 3, ScheduleKind::OneFOneB), &cluster(1e6, true)).unwrap();
        // 3 micro-batches × 10 tokens × 4 layers × 300 FLOPs at 1 MFLOP/s.
        assert!((e.time.step - 3.0 * 10.0 * 4.0 * 300.0 / 1e6).abs() < 1e-12, "{:?}", e.time);
        assert_eq!(e.time.bubble, 0.0);
        assert!((e.memory.activations - 4.0 * 8.0 * 10.0).abs() < 1e-9);
    }

    #[test]
    fn a_pipeline_pays_its_published_bubble_and_keeps_its_micro_batches_in_flight() {
        let cost = stack(8, 100.0, 8.0, 0);
        let (pp, m) = (4, 8);
        let e = estimate(&cost, 300.0, &layout(1, pp, m, ScheduleKind::OneFOneB), &cluster(1e6, true)).unwrap();
        // Each stage: 2 layers × 300 FLOPs × 10 tokens per micro-batch.
        let t = 2.0 * 300.0 * 10.0 / 1e6;
        assert!((e.time.step - (m + pp - 1) as f64 * t).abs() < 1e-9, "1F1B takes (m + p − 1) stage-steps: {:?}", e.time);
        assert!((e.time.bubble - (pp - 1) as f64 * t).abs() < 1e-9);
        // Stage 0 holds p micro-batches of its 2 layers.
        assert!((e.memory.activations - pp as f64 * 2.0 * 8.0 * 10.0).abs() < 1e-9);
        let g = estimate(&cost, 300.0, &layout(1, pp, m, ScheduleKind::GPipe), &cluster(1e6, true)).unwrap();
        assert!((g.memory.activations - m as f64 * 2.0 * 8.0 * 10.0).abs() < 1e-9, "GPipe keeps every micro-batch");
        // ZB-H1: the backward's weight half (a forward's worth) fills the
        // bubble, (p − 1)·(F + B − W) = (p − 1)·F with a third of the step's
        // work in each; the first stage still holds p micro-batches.
        let z = estimate(&cost, 300.0, &layout(1, pp, m, ScheduleKind::ZeroBubbleH1), &cluster(1e6, true)).unwrap();
        assert!((z.time.bubble - (pp - 1) as f64 * t / 3.0).abs() < 1e-9, "{:?}", z.time);
        assert!((z.time.step - m as f64 * t - (pp - 1) as f64 * t / 3.0).abs() < 1e-9, "{:?}", z.time);
        assert!((z.memory.activations - e.memory.activations).abs() < 1e-9);
    }

    #[test]
    fn a_collective_in_flight_beside_a_product_hides_behind_it_only_where_the_link_overlaps() {
        use tessera_nn::module::CollectiveCost;
        // One tensor-parallel all-gather of 4000 bytes per token in the
        // block's backward (20 µs over the test link), with some FLOPs per
        // token running beside it.
        let mut cost = stack(1, 100.0, 0.0, 0);
        let gather = |beside_flops| CollectiveCost {
            path: "h.0".into(),
            stage: StagePart::Layer { index: 0, count: 1 },
            kind: CollectiveKind::AllGather,
            group: Group::Tp,
            pass: Pass::Backward,
            bytes_per_token: 4000.0,
            bytes_per_micro_batch: 0.0,
            beside_flops,
            backward_sum: false,
        };
        let l = Layout { tp: 2, ..layout(1, 1, 1, ScheduleKind::OneFOneB) };
        let alone = Collective::AllGather.seconds(&cluster(1.0, true).intra_node, 2, 4000.0 * 10.0);
        let mut comm = |beside: f64, overlaps: bool| {
            cost.collectives = vec![gather(beside)];
            estimate(&cost, 300.0, &l, &cluster(1e6, overlaps)).unwrap().time.model_comm
        };
        assert!((comm(0.0, true) - alone).abs() < 1e-15, "nothing beside it: all of it");
        assert!((comm(200.0, false) - alone).abs() < 1e-15, "a link that shares the cores hides nothing");
        // Half of it: 1 FLOP per token × 10 tokens at 1 MFLOP/s is 10 µs.
        let hidden = 1.0 * 10.0 / 1e6;
        assert!((alone / hidden - 2.0).abs() < 1e-9 && (comm(1.0, true) - (alone - hidden)).abs() < 1e-15, "{alone} {hidden}");
        assert_eq!(comm(1e9, true), 0.0, "never below nothing");
    }

    #[test]
    fn data_parallel_reduction_hides_behind_the_backward_only_where_the_link_overlaps() {
        let cost = stack(2, 100.0, 0.0, 1000);
        let l = layout(4, 1, 1, ScheduleKind::OneFOneB);
        let reduce = Collective::AllReduce.seconds(&cluster(1.0, true).intra_node, 4, 2.0 * 1000.0 * 4.0);
        let slow = estimate(&cost, 300.0, &l, &cluster(1e6, false)).unwrap();
        assert!((slow.time.dp_total - reduce).abs() < 1e-12);
        assert_eq!(slow.time.dp_exposed, slow.time.dp_total);
        let fast = estimate(&cost, 300.0, &l, &cluster(1e6, true)).unwrap();
        let backward = 2.0 * 200.0 * 10.0 / 1e6;
        assert!((fast.time.dp_exposed - (reduce - backward).max(0.0)).abs() < 1e-12);
        // ZeRO-3 shards every state over the four replicas (the gradients,
        // dropped after each step, are not there at the peak of one micro-batch).
        let z3 = estimate(&cost, 300.0, &Layout { zero: ZeroStage::Three, ..l }, &cluster(1e6, false)).unwrap();
        assert!((z3.memory.states.total() - 12.0 * 2000.0 / 4.0).abs() < 1e-9, "{:?}", z3.memory);
    }

    /// The parts of a peak, for a stack of 2 layers of 1000 parameters each,
    /// keeping 10⁴ bytes per token (the activations outweigh the model states), on `layout`.
    fn peak(l: Layout) -> StepMemory {
        memory(&stack(2, 100.0, 1e4, 1000), &l).unwrap()
    }

    #[test]
    fn gradients_count_at_the_peak_only_once_a_backward_of_the_step_made_them() {
        // 2 layers × 10⁴ bytes × 10 tokens kept per micro-batch; 2000 f32 parameters.
        let acts = 2.0 * 1e4 * 10.0;
        let one = peak(layout(1, 1, 1, ScheduleKind::OneFOneB));
        assert_eq!((one.states.grads, one.activations), (0.0, acts), "one micro-batch: its backward starts with no gradients");
        let two = peak(layout(1, 1, 2, ScheduleKind::OneFOneB));
        assert_eq!((two.states.grads, two.activations), (4.0 * 2000.0, acts), "the second micro-batch runs beside the first one's gradients");
        // The backward's gradient of its module: one, and a second being
        // added into the accumulated one.
        assert!((two.workspace - one.workspace - 4.0 * 1000.0).abs() < 1e-9, "{one:?} {two:?}");
        // GPipe runs every forward before any backward: no gradients at the
        // peak, every micro-batch in flight; 1F1B with 4 micro-batches over
        // 2 stages meets its peak again after a backward.
        let gpipe = peak(layout(1, 2, 4, ScheduleKind::GPipe));
        assert_eq!((gpipe.states.grads, gpipe.activations), (0.0, 4.0 * 1e4 * 10.0));
        let one_f_one_b = peak(layout(1, 2, 4, ScheduleKind::OneFOneB));
        assert_eq!((one_f_one_b.states.grads, one_f_one_b.activations), (4.0 * 1000.0, 2.0 * 1e4 * 10.0));
    }

    #[test]
    fn data_parallel_buckets_and_zero_3_gathers_add_their_buffers() {
        let alone = peak(layout(1, 1, 1, ScheduleKind::OneFOneB));
        let dp = Layout { bucket_bytes: 5000, ..layout(2, 1, 1, ScheduleKind::OneFOneB) };
        assert!((peak(dp).workspace - alone.workspace - 2.0 * 5000.0).abs() < 1e-9, "a bucket packed, one reducing");
        // ZeRO-3 gathers the module running and the next one, each as rows
        // and as tensors: 4 × 1000 f32 parameters.
        let z3 = peak(Layout { zero: ZeroStage::Three, ..dp });
        assert!((z3.workspace - peak(dp).workspace - 4.0 * 4.0 * 1000.0).abs() < 1e-9);
        // ZeRO-1's update fills a new flat parameter buffer beside the old:
        // with nothing kept for the backward that is the peak.
        let update = memory(&stack(2, 100.0, 0.0, 1000), &Layout { zero: ZeroStage::One, ..dp }).unwrap();
        let states = model_states(2000.0, 2, ZeroStage::One, Precision::F32_ADAMW);
        assert_eq!(update.states, states);
        assert!((update.workspace - 4.0 * 2000.0).abs() < 1e-9, "{update:?}");
    }
    #[test]
    fn offload_moves_the_optimizer_state_and_stage_three_shards_to_the_host_for_transfer_time() {
        // 2000 f32 parameters over dp2: 1000 per shard.
        let at = |zero, offload| peak(Layout { zero, offload, ..layout(2, 1, 1, ScheduleKind::OneFOneB) });
        for zero in [ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
            let (on, off) = (at(zero, true), at(zero, false));
            assert_eq!(on.states.optimizer, 0.0, "{zero:?}: the moments are on the host");
            // The f32 master copy and both moments, and the gradient shard.
            assert_eq!(on.host, 1000.0 * (12.0 + 4.0), "{zero:?}");
            assert_eq!((off.host, on.states.grads), (0.0, off.states.grads), "{zero:?}");
            let params = if zero == ZeroStage::Three { 0.0 } else { off.states.params };
            assert_eq!(on.states.params, params, "{zero:?}: stage 3 keeps no shard on the device");
        }
        // Without a ZeRO stage there is nothing to offload.
        assert_eq!(at(ZeroStage::None, true), at(ZeroStage::None, false));
        // The step pays the gradient shard out and the parameters back over
        // the host link, and the host update only where the forward does
        // not cover it (here compute is free, so all of it).
        let cost = stack(2, 100.0, 1e4, 1000);
        let opt = |offload| {
            let l = Layout { zero: ZeroStage::Two, offload, ..layout(2, 1, 1, ScheduleKind::OneFOneB) };
            estimate(&cost, 1.0, &l, &cluster(1e30, false)).unwrap().time.optimizer
        };
        let want = 1000.0 * 8.0 / HOST_LINK_BYTES_PER_S + 1000.0 * 28.0 / HOST_ADAMW_BYTES_PER_S;
        assert!((opt(true) - opt(false) - want).abs() < 1e-12 * want.max(1.0) + 1e-15, "{} vs {}", opt(true), opt(false));
    }

    #[test]
    fn context_parallelism_divides_the_tokens_and_shards_the_state_like_replicas() {
        // seq 10 over cp2: each rank keeps 5 tokens' activations, and ZeRO
        // shards over the two cp ranks as over two data replicas.
        let one = peak(Layout { zero: ZeroStage::One, ..layout(1, 1, 1, ScheduleKind::OneFOneB) });
        let cp2 = peak(Layout { cp: 2, zero: ZeroStage::One, ..layout(1, 1, 1, ScheduleKind::OneFOneB) });
        assert_eq!((one.activations, cp2.activations), (2.0 * 1e4 * 10.0, 2.0 * 1e4 * 5.0));
        assert_eq!((one.states.optimizer, cp2.states.optimizer), (16_000.0, 8_000.0), "the moments sharded over 2 ranks");
        // The ring costs time over the cp link, less the attention beside it
        // when the link overlaps compute; one rank has none.
        let mut cost = stack(2, 100.0, 1e4, 1000);
        let ring = |pass| CollectiveCost {
            path: "h.0".into(),
            stage: StagePart::Whole,
            kind: CollectiveKind::Ring,
            group: Group::Cp,
            pass,
            bytes_per_token: 100.0,
            bytes_per_micro_batch: 0.0,
            beside_flops: 0.0,
            backward_sum: false,
        };
        cost.collectives = vec![ring(Pass::Forward), ring(Pass::Backward)];
        let l = |cp| Layout { cp, ..layout(1, 1, 1, ScheduleKind::OneFOneB) };
        let time = |cp| estimate(&cost, 1.0, &l(cp), &cluster(1e12, false)).unwrap().time.model_comm;
        assert_eq!(time(1), 0.0);
        // cp4: 3 hops each way of 100 bytes × 10/4 tokens at 1 GB/s.
        assert!((time(4) - 2.0 * 3.0 * 250.0 / 1e9).abs() < 1e-15, "{}", time(4));
    }
}
