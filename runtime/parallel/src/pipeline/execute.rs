//! Running one stage of a pipeline schedule on a model cut by `#[stage]`.

use super::{Action, Schedule};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};
use tessera_dist::Communicator;
pub use tessera_nn::module::layers_of;
use tessera_nn::module::{self, Act, Cx, Staged, WeightGrads};

/// What one stage did in one pipeline step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageReport {
    /// `(microbatch, loss)` for every microbatch whose loss this stage computed (the last stage).
    pub losses: Vec<(usize, f64)>,
    /// The most bytes this stage's device held during the step above what it
    /// held when the step began: the activations in flight, measured.
    pub peak_activation_bytes: usize,
    /// Most microbatches whose forward ran on this stage and whose backward had not yet.
    pub peak_in_flight: usize,
    /// Time spent computing (forwards, backwards, the loss).
    pub compute: Duration,
    /// Time spent sending and waiting for other stages: the bubble, measured.
    pub waiting: Duration,
    /// Every action of the schedule as it ran, in order (for traces).
    pub spans: Vec<ActionSpan>,
}

/// One action of a pipeline schedule as it ran on a stage.
#[derive(Clone, Debug, PartialEq)]
pub struct ActionSpan {
    /// The action.
    pub action: Action,
    /// When it started.
    pub start: Instant,
    /// When it ended.
    pub end: Instant,
}

impl StageReport {
    /// The share of the step this stage spent waiting on others.
    pub fn bubble_share(&self) -> f64 {
        let total = (self.compute + self.waiting).as_secs_f64();
        if total > 0.0 {
            self.waiting.as_secs_f64() / total
        } else {
            0.0
        }
    }
}

/// Runs `stage`'s actions of `schedule` for one step.
///
/// `inputs[mb]` is microbatch `mb`'s model input (read by the first virtual
/// stage only). On the last virtual stage, `loss(mb, output)` returns the
/// microbatch's loss and the gradient of the output (already scaled for the
/// step, e.g. by `1 / microbatches` for a mean). Activations and gradients
/// cross stages through the pipeline group `cx.groups().pp`, whose rank `s`
/// is stage `s`. Parameter gradients accumulate over the microbatches; call
/// [`sync_tied_grads`] afterwards when weights are shared across stages.
pub fn run_stage<M: Staged>(
    model: &M,
    cx: &mut Cx,
    schedule: &Schedule,
    stage: usize,
    inputs: &[Tensor],
    mut loss: impl FnMut(usize, &Act<M::Out>) -> Result<(f64, Act<M::Out>)>,
) -> Result<StageReport> {
    const OP: &str = "pipeline";
    let pp = cx.groups().pp.clone();
    if pp.size() != schedule.stages() || pp.rank() != stage {
        return Err(Error::schedule(
            OP,
            format!(
                "stage {stage} of a {}-stage schedule runs on rank {} of a pipeline group of {}; give each stage the rank of its index",
                schedule.stages(),
                pp.rank(),
                pp.size()
            ),
        ));
    }
    if let Some(layout) = cx.pipeline_layout()? {
        if layout.chunks() != schedule.chunks() {
            return Err(Error::schedule(
                OP,
                format!("the context declares {} chunks per stage but the schedule `{}` has {}; declare the schedule's chunks with `Cx::with_pipeline_chunks` before building the model", layout.chunks(), schedule.name(), schedule.chunks()),
            ));
        }
    }
    if inputs.len() != schedule.microbatches() {
        return Err(Error::schedule(OP, format!("{} inputs for {} microbatches", inputs.len(), schedule.microbatches())));
    }
    let virtual_stages = schedule.virtual_stages();
    let layers = model.split_layers();
    if layers < virtual_stages {
        return Err(Error::schedule(OP, format!("{layers} layers cannot fill {virtual_stages} virtual stages; use fewer stages or chunks")));
    }
    let last = virtual_stages - 1;
    let missing = |what: &str, mb: usize, c: usize| {
        Error::schedule(OP, format!("stage {stage}: {what} of microbatch {mb}, chunk {c} is not there; the schedule is out of order"))
    };

    let device = cx.device().clone();
    let base = device.memory_stats().in_use;
    device.reset_peak();

    let mut inbox: HashMap<(usize, usize), Act<M::Boundary>> = HashMap::new();
    let mut outbox: HashMap<(usize, usize), Act<M::Boundary>> = HashMap::new();
    let mut grad_in: HashMap<(usize, usize), Act<M::Boundary>> = HashMap::new();
    let mut grad_out: HashMap<(usize, usize), Act<M::Boundary>> = HashMap::new();
    let mut first: HashMap<usize, M::FirstSaved> = HashMap::new();
    let mut split: HashMap<(usize, usize), M::SplitSaved> = HashMap::new();
    let mut tail: HashMap<usize, (M::LastSaved, Act<M::Out>)> = HashMap::new();
    let mut report = StageReport::default();
    let mut in_flight = 0usize;
    // Weight gradients put aside by a split backward's input half, for its weight half.
    let mut put_aside: HashMap<(usize, usize), WeightGrads> = HashMap::new();
    // Gradients accumulate over the microbatches; a chunk's parameters are
    // announced final (for data parallelism) only in its last backward: for
    // a split backward, the last input half (norms, embeddings) and the
    // last weight half (the products' weights).
    let actions = schedule.actions(stage);
    let last_of =
        |half: fn(&Action) -> bool| -> HashMap<usize, usize> { actions.iter().enumerate().filter_map(|(i, a)| half(a).then_some((a.chunk(), i))).collect() };
    let last_input = last_of(|a| matches!(a, Action::Backward { .. } | Action::BackwardInput { .. }));
    let last_weight = last_of(|a| matches!(a, Action::Backward { .. } | Action::BackwardWeight { .. }));
    let announcing = cx.set_announce_grads(false);
    // Microbatch `mb` holds the rows after those of the microbatches before
    // it (dropout draws its masks at global rows; see `Cx::batch_offset`).
    let first_row = cx.batch_offset();
    let row_starts: Vec<u64> = inputs
        .iter()
        .scan(first_row, |next, x| {
            let start = *next;
            *next += x.dims().first().copied().unwrap_or(1) as u64;
            Some(start)
        })
        .collect();

    // The actions run in a closure so that, whatever fails, the context's
    // settings are restored below and nothing stays put aside.
    let outcome = (|| -> Result<()> {
        for (index, action) in actions.iter().enumerate() {
            let started = Instant::now();
            match *action {
                Action::Forward { microbatch: mb, chunk: c } => {
                    cx.set_batch_offset(row_starts[mb]);
                    let k = schedule.virtual_stage(stage, c);
                    let x = if k == 0 {
                        let (h, s) = model.forward_first(cx, Act::new(inputs[mb].clone()))?;
                        first.insert(mb, s);
                        h
                    } else {
                        inbox.remove(&(mb, c)).ok_or_else(|| missing("the input activation", mb, c))?
                    };
                    let (y, s) = model.forward_split(cx, layers_of(k, virtual_stages, layers), x)?;
                    split.insert((mb, c), s);
                    if k == last {
                        let (out, s) = model.forward_last(cx, y)?;
                        let (l, dy) = loss(mb, &out)?;
                        report.losses.push((mb, l));
                        tail.insert(mb, (s, dy));
                    } else if schedule.placement(k + 1).0 == stage {
                        inbox.insert((mb, c + 1), y);
                    } else {
                        outbox.insert((mb, c), y);
                    }
                    in_flight += 1;
                    report.peak_in_flight = report.peak_in_flight.max(in_flight);
                }
                Action::SendActivation { to, microbatch: mb, chunk: c } => {
                    let y = outbox.remove(&(mb, c)).ok_or_else(|| missing("the output activation", mb, c))?;
                    pp.send(y.tensor(), to)?;
                }
                Action::RecvActivation { from, microbatch: mb, chunk: c } => {
                    inbox.insert((mb, c), Act::new(pp.recv(from)?));
                }
                Action::Backward { microbatch: mb, chunk: c } | Action::BackwardInput { microbatch: mb, chunk: c } => {
                    cx.set_batch_offset(row_starts[mb]);
                    cx.set_announce_grads(announcing && last_input.get(&c) == Some(&index));
                    let split_half = matches!(action, Action::BackwardInput { .. });
                    if split_half {
                        cx.defer_weight_grads();
                    }
                    let k = schedule.virtual_stage(stage, c);
                    let g = if k == last {
                        let (s, dy) = tail.remove(&mb).ok_or_else(|| missing("the loss gradient", mb, c))?;
                        model.backward_last(cx, s, dy)?
                    } else {
                        grad_out.remove(&(mb, c)).ok_or_else(|| missing("the output gradient", mb, c))?
                    };
                    let s = split.remove(&(mb, c)).ok_or_else(|| missing("the saved forward state", mb, c))?;
                    let gx = model.backward_split(cx, layers_of(k, virtual_stages, layers), s, g)?;
                    if k == 0 {
                        let s = first.remove(&mb).ok_or_else(|| missing("the first part's state", mb, c))?;
                        model.backward_first(cx, s, gx)?;
                    } else if schedule.placement(k - 1).0 == stage {
                        grad_out.insert((mb, c - 1), gx);
                    } else {
                        grad_in.insert((mb, c), gx);
                    }
                    if split_half {
                        put_aside.insert((mb, c), cx.take_weight_grads());
                    } else {
                        in_flight -= 1;
                    }
                }
                Action::BackwardWeight { microbatch: mb, chunk: c } => {
                    cx.set_batch_offset(row_starts[mb]);
                    cx.set_announce_grads(announcing && last_weight.get(&c) == Some(&index));
                    let weights = put_aside.remove(&(mb, c)).ok_or_else(|| missing("the weight gradients put aside by the input half", mb, c))?;
                    weights.run(cx)?;
                    in_flight -= 1;
                }
                Action::SendGrad { to, microbatch: mb, chunk: c } => {
                    let g = grad_in.remove(&(mb, c)).ok_or_else(|| missing("the input gradient", mb, c))?;
                    pp.send(g.tensor(), to)?;
                }
                Action::RecvGrad { from, microbatch: mb, chunk: c } => {
                    grad_out.insert((mb, c), Act::new(pp.recv(from)?));
                }
            }
            let ended = Instant::now();
            if action.is_compute() {
                report.compute += ended - started;
            } else {
                report.waiting += ended - started;
            }
            report.spans.push(ActionSpan { action: *action, start: started, end: ended });
        }
        Ok(())
    })();
    cx.take_weight_grads();
    cx.set_announce_grads(announcing);
    cx.set_batch_offset(first_row);
    outcome?;
    report.peak_activation_bytes = device.memory_stats().peak.saturating_sub(base);
    Ok(report)
}

/// Sums the gradients of weights shared by several layers (`#[tied]`, such
/// as an embedding and an output head on the first and last stage) over the
/// pipeline group, so every stage holds the full gradient. Every stage must
/// call it; a stage that did not use a shared weight contributes zeros (and
/// keeps no gradient for a weight only other stages hold).
pub fn sync_tied_grads<M: Staged>(model: &M, cx: &Cx) -> Result<()> {
    if cx.groups().pp.size() == 1 {
        // One stage holds every use of a shared weight: nothing to sum.
        return Ok(());
    }
    let tied: Vec<tessera_nn::module::Param> = module::distinct_params(model)?.into_iter().filter(|n| n.is_tied()).map(|n| n.param).collect();
    let pp: &dyn Communicator = &*cx.groups().pp;
    for p in tied {
        let g = match p.grad() {
            Some(g) => g,
            None => Tensor::zeros(p.local_shape(), cx.param_dtype(), cx.device())?,
        };
        let sum = pp.all_reduce_sum(&g)?;
        if !p.is_remote() {
            p.set_grad(sum)?;
        }
    }
    Ok(())
}
