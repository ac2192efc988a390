//! Running one step of a model on a mesh of in-process ranks and on one
//! rank, with the check's linear loss.

use super::compare::{self, RankGrads};

use super::{fd, Check, ParallelRun, Report};
use std::sync::Arc;
use std::time::Duration;
use tessera_core::tensor::{DType, Tensor};
use tessera_core::{Device, RngKey};
use tessera_core::{Error, Result};
use tessera_dist::inproc::{mesh_groups, InProcess};
use tessera_dist::mesh::{Axis, Coords, Degrees, Mesh};
use tessera_nn::module::{self, Act, Cx, Layout, Module, Seq, Staged};
use tessera_parallel::data::DataParallel;
use tessera_parallel::pipeline::{one_f_one_b, run_stage, sync_tied_grads};

/// The rank a model is built for: `make` may read it (to hold only this
/// rank's experts, say); most models ignore it.
#[derive(Clone, Copy, Debug)]
pub struct Rank {
    /// The rank in the world (0 for the single-rank reference).
    pub rank: usize,
    /// Its coordinates on the mesh.
    pub coords: Coords,
    /// The mesh's degrees.
    pub degrees: Degrees,
}

/// The loss of a microbatch's local output: its part of the loss and the
/// output's gradient.
pub(super) type LossGrad<'a> = &'a dyn Fn(usize, &Tensor) -> Result<(f64, Tensor)>;

/// How a step runs a model: straight through, or through the pipeline executor.
pub(super) trait Exec<M: Module>: Sync {
    /// Runs forward and backward over `microbatches` on this rank; returns
    /// the sum of this rank's partial losses.
    fn step(&self, model: &M, cx: &mut Cx, microbatches: &[Tensor], stage: usize, grad: LossGrad<'_>) -> Result<f64>;
}

/// Every run without a pipeline.
pub(super) struct Plain;

/// Runs with a pipeline go through `run_stage`.
pub(super) struct Pipelined;

fn straight<M: Module>(model: &M, cx: &mut Cx, microbatches: &[Tensor], grad: LossGrad<'_>) -> Result<f64> {
    let mut loss = 0.0;
    let first = cx.batch_offset();
    let mut row = first;
    for (mb, x) in microbatches.iter().enumerate() {
        cx.set_batch_offset(row);
        row += x.dims()[0] as u64;
        let (y, saved) = model.forward(cx, Act::new(x.clone()))?;
        let (l, dy) = grad(mb, y.tensor())?;
        loss += l;
        model.backward(cx, saved, Act::new(dy))?;
    }
    cx.set_batch_offset(first);
    Ok(loss)
}

impl<M: Module> Exec<M> for Plain {
    fn step(&self, model: &M, cx: &mut Cx, microbatches: &[Tensor], _stage: usize, grad: LossGrad<'_>) -> Result<f64> {
        straight(model, cx, microbatches, grad)
    }
}

impl<M: Staged> Exec<M> for Pipelined {
    fn step(&self, model: &M, cx: &mut Cx, microbatches: &[Tensor], stage: usize, grad: LossGrad<'_>) -> Result<f64> {
        let stages = cx.groups().pp.size();
        if stages == 1 && microbatches.len() == 1 {
            return straight(model, cx, microbatches, grad);
        }
        let schedule = one_f_one_b(stages, microbatches.len())?;
        let report = run_stage(model, cx, &schedule, stage, microbatches, |mb, out| {
            let (l, dy) = grad(mb, out.tensor())?;
            Ok((l, Act::new(dy)))
        })?;
        sync_tied_grads(model, cx)?;
        Ok(report.losses.iter().map(|(_, l)| l).sum())
    }
}

/// The form of a model's output on the ranks, for cutting out each rank's
/// part of the loss's random weights.
#[derive(Clone, Copy, Debug, PartialEq)]
enum OutPart {
    /// Every rank holds the whole output.
    Whole,
    /// Ranks hold slices along this dimension (the last, or the sequence).
    Split(Option<usize>),
    /// Every rank holds a full-shape partial sum.
    Partial,
}

fn out_part<M: Module>(sequence_split: bool) -> Result<OutPart> {
    Ok(match <M::Out as Layout>::NAME {
        "Replicated" if sequence_split && M::SEQ_OUT == Seq::Split => OutPart::Split(Some(1)),
        "Replicated" => OutPart::Whole,
        "SplitSeq" => OutPart::Split(Some(1)),
        "SplitHidden" => OutPart::Split(None),
        "PartialSum" => OutPart::Partial,
        other => return Err(Error::unsupported("check_parallel", format!("a model whose output is `{other}` has no single-rank counterpart to compare with"))),
    })
}

/// Part `k` of `n` of `t` along `dim`.
fn part(t: &Tensor, dim: usize, k: usize, n: usize) -> Result<Tensor> {
    let size = t.dims()[dim];
    if !size.is_multiple_of(n) {
        return Err(Error::shape(
            "check_parallel",
            format!("dimension {dim} of {} does not split into {n} equal parts; choose sizes the degrees divide", t.shape()),
        ));
    }
    t.narrow(dim, k * (size / n), size / n)?.contiguous()
}

/// The loss's random weights for a batch shaped like `y`, drawn per global
/// element so that every rank can cut out its part.
pub(super) fn weights(seed: u64, dims: &[usize], dtype: DType, dev: &Device) -> Result<Tensor> {
    let key = RngKey::new(seed ^ 0x105_5EED, 17);
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n as u64).map(|i| key.uniform_at(i) as f64 * 2.0 - 1.0).collect();
    Tensor::from_vec(v, dims, dev)?.to_dtype(dtype)
}

/// What one rank returns.
pub(super) struct RankResult {
    /// This rank's part of the loss, summed over its microbatches.
    pub loss: f64,
    /// The same sum of `|y·r|` rather than `y·r`: the scale against which
    /// the loss's rounding error is measured (a loss whose terms cancel is
    /// small, its error is not).
    pub loss_scale: f64,
    pub grads: RankGrads,
}

/// One step of `run` over its ranks; the results in rank order.
fn run_mesh<M: Module, F: Fn(&Rank) -> Result<M> + Sync, E: Exec<M>>(
    make: &F,
    input: &Tensor,
    check: &Check,
    run: &ParallelRun,
    exec: &E,
) -> Result<Vec<RankResult>> {
    let world = run.world();
    let mesh = Mesh::new(run.degrees, world, world)?;
    let comm = InProcess::with_timeout(world, Duration::from_secs(60))?;
    let batch = input.dims().first().copied().unwrap_or(0);
    let (dp, mbs) = (run.degrees.get(Axis::Dp), run.microbatches.max(1));
    if batch == 0 || !batch.is_multiple_of(dp * mbs) {
        return Err(Error::shape(
            "check_parallel",
            format!("a batch of {batch} rows does not split into {dp} replicas of {mbs} microbatches; use a batch that {} divides", dp * mbs),
        ));
    }
    let host = input.to_f64_vec()?;
    let (dims, in_dtype) = (input.dims().to_vec(), input.dtype());
    let results: Vec<std::thread::Result<Result<RankResult>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (mesh, comm, host, dims) = (&mesh, &comm, &host, &dims);
                s.spawn(move || -> Result<RankResult> {
                    let r = rank_step(make, check, run, exec, mesh, comm, rank, host, dims, in_dtype);
                    if let Err(e) = &r {
                        comm.abort(rank, &e.to_string());
                    }
                    r
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join()).collect()
    });
    let mut out = Vec::with_capacity(world);
    let mut first_error: Option<Error> = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(panic) => {
                first_error.get_or_insert(Error::RankPanicked { rank, message: tessera_core::error::panic_message(panic.as_ref()) });
            }
        }
    }
    match first_error {
        Some(e) => Err(e.context(format!("check_parallel `{run}`"))),
        None => Ok(out),
    }
}

#[allow(clippy::too_many_arguments)]
fn rank_step<M: Module, F: Fn(&Rank) -> Result<M> + Sync, E: Exec<M>>(
    make: &F,
    check: &Check,
    run: &ParallelRun,
    exec: &E,
    mesh: &Mesh,
    comm: &InProcess,
    rank: usize,
    host: &[f64],
    dims: &[usize],
    in_dtype: DType,
) -> Result<RankResult> {
    let dev = Device::cpu();
    let coords = mesh.coords(rank)?;
    let groups = mesh_groups(comm, mesh, rank, &dev)?;
    // `dp`: the data replicas, which see other rows; the data-parallel
    // group spans them and the context-parallel ranks, which see other
    // tokens of the same rows, and averages gradients over both.
    let (tp, dp, cp, pp) = (groups.tp.size(), run.degrees.get(Axis::Dp), run.degrees.get(Axis::Cp), groups.pp.size());
    let dp_group = groups.dp.clone();
    let mut cx = Cx::new(dev.clone())
        .with_dtype(check.dtype)
        .with_seed(check.seed)
        .with_groups(groups)
        .with_sequence_parallel(run.sequence_parallel)
        .with_tp_overlap(run.tp_overlap);
    if pp > 1 {
        cx = cx.with_pipeline_chunks(1);
    }
    let model = module::build(make(&Rank { rank, coords, degrees: run.degrees })?, &cx)?;
    let sync = if dp_group.size() > 1 {
        let sync = Arc::new(DataParallel::new(&model, dp_group, run.bucket_bytes)?);
        cx = cx.with_hooks(sync.clone());
        Some(sync)
    } else {
        None
    };
    let full = Tensor::from_vec(host.to_vec(), dims, &dev)?.to_dtype(in_dtype)?;
    let replica = part(&full, 0, coords[Axis::Dp], dp)?;
    let rows = replica.dims()[0];
    cx.set_batch_offset((coords[Axis::Dp] * rows) as u64);
    let sequence_split = cx.sequence_split();
    let context = cx.context_split();
    // The input in the form the model takes it: this rank's chunks of each
    // sequence (context parallelism), and its slice of them (sequence
    // parallelism).
    let takes_slice = sequence_split && <M::In as Layout>::IS_REPLICATED && M::SEQ_IN == Seq::Split;
    let microbatches: Vec<Tensor> = (0..run.microbatches.max(1))
        .map(|mb| {
            let x = context.local_of(&part(&replica, 0, mb, run.microbatches.max(1))?, 1)?;
            if takes_slice {
                part(&x, 1, coords[Axis::Tp], tp)
            } else {
                Ok(x)
            }
        })
        .collect::<Result<_>>()?;
    let out = out_part::<M>(sequence_split)?;
    let (seed, t) = (check.seed, coords[Axis::Tp]);
    let mb_rows = rows / run.microbatches.max(1);
    let loss_scale = std::cell::Cell::new(0.0);
    let grad = |mb: usize, y: &Tensor| -> Result<(f64, Tensor)> {
        // The whole microbatch's output shape, then this rank's part of the weights.
        let mut global = y.dims().to_vec();
        match out {
            OutPart::Split(Some(d)) => global[d] *= tp,
            OutPart::Split(None) => *global.last_mut().expect("an output has a dimension") *= tp,
            _ => {}
        }
        global[0] = dims[0];
        if cp > 1 {
            global[1] *= cp;
        }
        let first = coords[Axis::Dp] * rows + mb * mb_rows;
        let all = weights(seed, &global, y.dtype(), y.device())?.narrow(0, first, y.dims()[0])?.contiguous()?;
        let all = context.local_of(&all, 1)?;
        let r = match out {
            OutPart::Split(Some(d)) => part(&all, d, t, tp)?,
            OutPart::Split(None) => part(&all, global.len() - 1, t, tp)?,
            _ => all,
        };
        // Each context-parallel rank holds part of every row's terms; it
        // counts them cp times, as the gradients are averaged over cp.
        let per_row = cp as f64 / rows as f64;
        let terms: Vec<f64> = y.to_f64_vec()?.iter().zip(r.to_f64_vec()?).map(|(a, b)| a * b).collect();
        loss_scale.set(loss_scale.get() + terms.iter().map(|t| t.abs()).sum::<f64>() * per_row);
        Ok((terms.iter().sum::<f64>() * per_row, tessera_core::ops::scale(&r, per_row)?))
    };
    let loss = exec.step(&model, &mut cx, &microbatches, coords[Axis::Pp], &grad)?;
    if let Some(sync) = &sync {
        sync.finish()?;
    }
    // Only one rank of the tensor-parallel group counts a loss every rank holds whole.
    let counted = !(out == OutPart::Whole && t != 0);
    Ok(RankResult { loss: if counted { loss } else { 0.0 }, loss_scale: if counted { loss_scale.get() } else { 0.0 }, grads: compare::rank_grads(&model)? })
}

/// The single-rank reference, with `microbatches` microbatches run one after
/// another through the model's own forward and backward (never through the
/// pipeline entry points, which are among what is checked).
fn reference<M: Module, F: Fn(&Rank) -> Result<M> + Sync>(make: &F, input: &Tensor, check: &Check, microbatches: usize) -> Result<RankResult> {
    let run = ParallelRun { degrees: Degrees::new(), sequence_parallel: false, tp_overlap: 1, bucket_bytes: 1, microbatches };
    Ok(run_mesh(make, input, check, &run, &Plain)?.pop().expect("one rank"))
}

/// Runs every run of `check` and compares it with its reference.
pub(super) fn check<M: Module, F: Fn(&Rank) -> Result<M> + Sync, E: Exec<M>>(make: &F, input: &Tensor, check: &Check, exec: &E) -> Result<Report> {
    let mut report = Report::default();
    let mut failures = Vec::new();
    let mut references: Vec<(usize, RankResult)> = Vec::new();
    // One rank in f64, to measure what rounding alone does to the f32 reference.
    let exact = Check { dtype: DType::F64, ..check.clone() };
    let mut exacts: Vec<(usize, RankResult)> = Vec::new();
    let allowance = check.rounding_allowance > 0.0 && check.dtype != DType::F64;
    if check.finite_differences > 0 {
        failures.extend(fd::check(make, input, check, &mut report)?);
    }
    for run in &check.runs {
        let mbs = if run.degrees.get(Axis::Pp) > 1 { run.microbatches } else { 1 };
        if !references.iter().any(|(m, _)| *m == mbs) {
            references.push((mbs, reference(make, input, check, mbs)?));
        }
        if allowance && !exacts.iter().any(|(m, _)| *m == mbs) {
            exacts.push((mbs, reference(make, input, &exact, mbs)?));
        }
        let reference = &references.iter().find(|(m, _)| *m == mbs).expect("computed").1;
        let rounding = exacts.iter().find(|(m, _)| *m == mbs).map(|(_, r)| (r, check.rounding_allowance));
        let ranks = run_mesh(make, input, check, run, exec)?;
        let got = compare::Gathered::new(run, &ranks)?;
        if let Err(e) = got.compare(run, reference, rounding, check.tolerance, &mut report) {
            failures.push(e);
        }
    }
    if failures.is_empty() {
        Ok(report)
    } else {
        Err(Error::ParallelMismatch(failures.join("\n")))
    }
}
