//! A model's costs, read from its structure: the planner's metadata.
//!
//! [`Module::describe`](super::Module::describe) walks a model the way its
//! forward runs, without tensors: every layer reports, for one rank and per
//! token of a micro-batch, the matrix FLOPs of its forward and backward, the
//! bytes it keeps for the backward, the bytes its element-wise passes move,
//! and the collectives it issues, for one choice of tensor-parallel degree,
//! sequence parallelism, sequence length, compute dtype and recompute policy
//! ([`CostSettings`]). `#[derive(Module)]` generates the walk of a model from
//! its `#[forward]` body, exactly as it generates the forward: the same calls,
//! sequence-parallel conversions, precision regions and recompute, so the
//! description cannot drift from what runs. The primitive layers describe
//! themselves by hand.
//!
//! Conventions, the ones the field's MFU figures use:
//!
//! * FLOPs count matrix products only, two per multiply-add: a linear layer
//!   `2·k·n` per token forward and twice that backward (input and weight
//!   gradients); causal attention `4·h·d·(T+1)/2` per token forward (`QKᵀ`
//!   and `PV` over the `(T+1)/2` keys a query sees on average) and 2.5 times
//!   that backward (the probabilities recomputed, then four products).
//!   [`tessera_core::ops::flops`] counts the same products as they run.
//! * Saved bytes count each buffer once, however many layers keep it (a
//!   linear layer keeps its input, which is often the previous layer's
//!   output, already kept): the figure a device's memory tracker shows.
//! * A collective's size is the whole buffer one rank holds for it: an
//!   all-reduce's message, an all-gather's output, a reduce-scatter's input,
//!   the rows an all-to-all exchanges.

use super::{Layout, Module, ParamId, RecomputeOverride, Role, RoleKind, Seq, StagePart};
use serde::Serialize;
use std::collections::HashSet;
use tessera_core::tensor::DType;
use tessera_core::{Error, Result};

/// What a description is made for: the layout and precision of one run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostSettings {
    /// Tensor-parallel degree.
    pub tp: usize,
    /// Sequence parallelism (effective only when `tp > 1`).
    pub sp: bool,
    /// Expert-parallel degree (the all-to-all of mixture-of-experts layers).
    pub ep: usize,
    /// Context-parallel degree: each rank holds `1/cp` of every sequence's
    /// tokens, and attention passes key/value blocks around the cp ranks
    /// (a [`CollectiveKind::Ring`]).
    pub cp: usize,
    /// Tokens per sequence, whole (attention's cost grows with it).
    pub seq_len: usize,
    /// The dtype activations are computed and kept in, outside any
    /// `#[precision]` region.
    pub dtype: DType,
    /// Which recompute runs, as [`Cx::set_recompute_override`](super::Cx::set_recompute_override) sets it.
    pub recompute: RecomputeOverride,
}

impl CostSettings {
    /// One rank, no recompute override, f32, sequences of `seq_len`.
    pub fn single(seq_len: usize) -> CostSettings {
        CostSettings { tp: 1, sp: false, ep: 1, cp: 1, seq_len, dtype: DType::F32, recompute: RecomputeOverride::AsDeclared }
    }

    /// Whether `Replicated` values may be split over the sequence.
    pub fn sequence_split(&self) -> bool {
        self.sp && self.tp > 1
    }
}

/// An activation as the description sees it: its width on this rank, the
/// share of the micro-batch's tokens this rank holds, and its dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Activation {
    id: u64,
    /// Elements per token on this rank (a `SplitHidden` value's local width).
    pub width: usize,
    /// The share of the micro-batch's tokens this rank holds: 1, or `1/tp`
    /// for a value split over the sequence.
    pub tokens: f64,
    /// The dtype of its elements.
    pub dtype: DType,
}

impl Activation {
    /// Bytes per token of the micro-batch on this rank.
    pub fn bytes(&self) -> f64 {
        self.width as f64 * self.tokens * self.dtype.size_in_bytes() as f64
    }

    /// Elements per token of the micro-batch on this rank.
    pub fn elements(&self) -> f64 {
        self.width as f64 * self.tokens
    }
}

/// A collective operation, as [`CollectiveCost`] names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    /// Sum over the group, every rank gets the sum.
    AllReduce,
    /// Sum over the group, every rank gets its slice.
    ReduceScatter,
    /// Every rank gets every rank's slice.
    AllGather,
    /// Every rank sends a part to every other.
    AllToAll,
    /// Every rank passes a block of `bytes_per_token` to the next around
    /// the group, `size − 1` times (ring attention's key/value blocks).
    Ring,
}

/// The group a collective runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    /// The tensor-parallel group.
    Tp,
    /// The expert-parallel group.
    Ep,
    /// The context-parallel group.
    Cp,
}

/// Which pass a cost belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    /// The forward.
    Forward,
    /// The backward.
    Backward,
}

/// One collective a model issues per micro-batch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CollectiveCost {
    /// The dotted path of the layer or conversion that issues it.
    pub path: String,
    /// Where a pipeline places it.
    #[serde(skip)]
    pub stage: StagePart,
    /// The operation.
    pub kind: CollectiveKind,
    /// Its group.
    pub group: Group,
    /// Its pass.
    pub pass: Pass,
    /// The buffer's bytes per token of the micro-batch (see the module doc).
    pub bytes_per_token: f64,
    /// Bytes that do not grow with the tokens, once per micro-batch: the
    /// gradient of a parameter replicated over the tensor-parallel group,
    /// summed over it when the layer saw a slice of the tokens.
    pub bytes_per_micro_batch: f64,
    /// Matrix FLOPs per token that run while it is in flight (issued before
    /// them, waited for after): where the link runs beside compute, they
    /// hide that much of its time. 0 for a collective waited for at once.
    pub beside_flops: f64,
    /// Whether this is the sum of replicated parameters' gradients that a
    /// backward makes at its end, in one all-reduce for the whole backward
    /// ([`Cx::grad`](super::Cx::grad)): there is one such entry per
    /// pipeline part (a layer of the split field is a part of its own), and
    /// the entries of the parts one pipeline stage runs travel together.
    pub backward_sum: bool,
}

/// One parameter as the description sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ParamCost {
    /// Its dotted name.
    pub name: String,
    /// The role of the layer holding it.
    pub role: RoleKind,
    /// Elements of its global shape.
    pub elements: usize,
    /// Whether the tensor-parallel group splits it (column, row and
    /// vocabulary roles); otherwise every rank of the group holds it whole.
    pub split: bool,
    /// Whether it belongs to one expert of a mixture (expert parallelism
    /// places each expert on one rank of its group).
    pub expert: bool,
    /// Where a pipeline places it.
    #[serde(skip)]
    pub stage: StagePart,
    /// Whether it is a second name of a parameter already listed (a tied
    /// weight): held again by the stage that uses it, counted once in totals.
    pub tied: bool,
}

impl ParamCost {
    /// The elements one rank holds with `tp`-way tensor and `ep`-way expert parallelism.
    pub fn elements_per_rank(&self, tp: usize, ep: usize) -> f64 {
        let mut n = self.elements as f64;
        if self.split {
            n /= tp as f64;
        }
        if self.expert {
            n /= ep as f64;
        }
        n
    }
}

/// The costs of one layer call, per token of a micro-batch on one rank.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerCost {
    /// The dotted path of the call (`h.3.attn.core`).
    pub path: String,
    /// Where a pipeline places it.
    #[serde(skip)]
    pub stage: StagePart,
    /// Matrix FLOPs of the forward.
    pub forward_flops: f64,
    /// Matrix FLOPs of the backward.
    pub backward_flops: f64,
    /// Forward FLOPs run again in the backward by recompute.
    pub recompute_flops: f64,
    /// Bytes kept for the backward that no earlier layer already keeps.
    pub saved_bytes: f64,
    /// Bytes the forward's element-wise passes read and write.
    pub forward_traffic: f64,
    /// Bytes the backward's element-wise passes read and write.
    pub backward_traffic: f64,
    /// Elements of transcendental element-wise functions (gelu, silu,
    /// swiglu) the forward computes: bound by arithmetic, not memory, on a CPU.
    pub forward_nonlinear: f64,
    /// The same in the backward (their derivatives).
    pub backward_nonlinear: f64,
    /// Whether the FLOPs are attention's (its own kernel, its own rate)
    /// rather than matrix products'.
    pub attention: bool,
    /// The matrix products among the FLOPs, by shape (a product's rate
    /// depends on it).
    pub products: Vec<Product>,
}

impl LayerCost {
    /// A layer at `path` placed at `stage` that costs nothing yet.
    pub fn new(path: String, stage: StagePart) -> LayerCost {
        LayerCost {
            path,
            stage,
            forward_flops: 0.0,
            backward_flops: 0.0,
            recompute_flops: 0.0,
            saved_bytes: 0.0,
            forward_traffic: 0.0,
            backward_traffic: 0.0,
            forward_nonlinear: 0.0,
            backward_nonlinear: 0.0,
            attention: false,
            products: Vec::new(),
        }
    }
}

/// A product of a layer's input with a `[k, n]` weight, on the share
/// `tokens` of the micro-batch's tokens this rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Product {
    /// The inner dimension (the input's width on this rank).
    pub k: usize,
    /// The output's width on this rank.
    pub n: usize,
    /// The share of the micro-batch's tokens it multiplies.
    pub tokens: f64,
}

/// The description of a model for one [`CostSettings`]: every layer's costs
/// and every collective, per token of a micro-batch on one rank.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelCost {
    /// The parameters, in visit order.
    pub params: Vec<ParamCost>,
    /// The layers, in forward order.
    pub layers: Vec<LayerCost>,
    /// The collectives, in the order of their passes' issue.
    pub collectives: Vec<CollectiveCost>,
    /// The most bytes a recomputed layer holds at once while its backward
    /// runs (its activations, brought back), per token.
    pub recompute_peak_bytes: f64,
    /// The bytes per token of the model's output (the logits the loss reads).
    pub output_bytes: f64,
    /// The bytes per token of the activation a pipeline hands from stage to
    /// stage (the input of the `#[stage(split)]` field's layers); 0 for a
    /// model without one.
    pub boundary_bytes: f64,
}

impl ModelCost {
    /// Parameters of the model (each tied weight once).
    pub fn param_count(&self) -> usize {
        self.params.iter().filter(|p| !p.tied).map(|p| p.elements).sum()
    }

    /// Parameters of the model that `keep` places, each tied weight once.
    pub fn param_count_where(&self, keep: impl Fn(&ParamCost) -> bool) -> usize {
        self.params.iter().filter(|p| !p.tied && keep(p)).map(|p| p.elements).sum()
    }

    /// Sums `f` over the layers placed by `keep`.
    fn sum(&self, keep: impl Fn(StagePart) -> bool, f: impl Fn(&LayerCost) -> f64) -> f64 {
        self.layers.iter().filter(|l| keep(l.stage)).map(f).sum()
    }

    /// Forward matrix FLOPs per token.
    pub fn forward_flops(&self) -> f64 {
        self.sum(|_| true, |l| l.forward_flops)
    }

    /// Backward matrix FLOPs per token (recompute not included).
    pub fn backward_flops(&self) -> f64 {
        self.sum(|_| true, |l| l.backward_flops)
    }

    /// Forward FLOPs recompute runs again, per token.
    pub fn recompute_flops(&self) -> f64 {
        self.sum(|_| true, |l| l.recompute_flops)
    }

    /// Bytes kept between forward and backward, per token.
    pub fn saved_bytes(&self) -> f64 {
        self.sum(|_| true, |l| l.saved_bytes)
    }

    /// Bytes element-wise passes move, per token, forward and backward.
    pub fn traffic_bytes(&self) -> (f64, f64) {
        (self.sum(|_| true, |l| l.forward_traffic), self.sum(|_| true, |l| l.backward_traffic))
    }

    /// The costs of what `keep` says is on a stage, as a model of its own.
    pub fn part(&self, keep: impl Fn(StagePart) -> bool) -> ModelCost {
        ModelCost {
            params: self.params.iter().filter(|p| keep(p.stage)).map(|p| ParamCost { tied: false, ..p.clone() }).collect(),
            layers: self.layers.iter().filter(|l| keep(l.stage)).cloned().collect(),
            collectives: self.collectives.iter().filter(|c| keep(c.stage)).cloned().collect(),
            recompute_peak_bytes: self.recompute_peak_bytes,
            output_bytes: self.output_bytes,
            boundary_bytes: self.boundary_bytes,
        }
    }
}

/// What a recompute scope that keeps only its input would have kept: its
/// buffers, counted once, for the transient of its backward.
struct Scope {
    ids: HashSet<u64>,
    bytes: f64,
}

/// The walk [`Module::describe`](super::Module::describe) reports to: it
/// holds the settings, the path and the recompute state, as [`Cx`](super::Cx)
/// does for a forward, and collects the costs.
pub struct Describe {
    settings: CostSettings,
    compute: DType,
    path: Vec<String>,
    next_id: u64,
    kept: HashSet<u64>,
    /// Open scopes whose activations are discarded and recomputed (the
    /// outermost holds the tally).
    discarding: Vec<Scope>,
    selective: bool,
    token_slice: bool,
    layer_recompute: Option<super::Recompute>,
    placing: Placing,
    cost: ModelCost,
    /// The replicated parameters' gradient bytes summed over the group at
    /// the end of the backward, by the pipeline part holding them.
    replicated: Vec<(StagePart, f64)>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Placing {
    Open,
    SplitField,
    Part(StagePart),
}

impl Describe {
    /// A walk for `settings`.
    pub fn new(settings: CostSettings) -> Result<Describe> {
        if settings.tp == 0 || settings.ep == 0 || settings.seq_len == 0 {
            return Err(Error::invalid("Describe", format!("tp ({}), ep ({}) and seq_len ({}) must be positive", settings.tp, settings.ep, settings.seq_len)));
        }
        if settings.sequence_split() && !settings.seq_len.is_multiple_of(settings.tp) {
            return Err(Error::indivisible(
                "Describe",
                format!(
                    "a sequence of {} tokens cannot be split over a tensor-parallel group of {}; use a length the degree divides",
                    settings.seq_len, settings.tp
                ),
            ));
        }
        Ok(Describe {
            settings,
            compute: settings.dtype,
            path: Vec::new(),
            next_id: 0,
            kept: HashSet::new(),
            discarding: Vec::new(),
            selective: false,
            token_slice: false,
            layer_recompute: None,
            placing: Placing::Open,
            cost: ModelCost {
                params: Vec::new(),
                layers: Vec::new(),
                collectives: Vec::new(),
                recompute_peak_bytes: 0.0,
                output_bytes: 0.0,
                boundary_bytes: 0.0,
            },
            replicated: Vec::new(),
        })
    }

    /// The settings of the walk.
    pub fn settings(&self) -> &CostSettings {
        &self.settings
    }

    /// The dtype activations are computed in here.
    pub fn compute_dtype(&self) -> DType {
        self.compute
    }

    /// The dtype of per-row statistics (a norm's, attention's log-sum-exp):
    /// f32, or f64 in an f64 run.
    pub fn stat_dtype(&self) -> DType {
        if self.compute == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }

    /// Sets the compute dtype (a precision region); returns the previous one.
    pub fn set_compute_dtype(&mut self, d: DType) -> DType {
        std::mem::replace(&mut self.compute, d)
    }

    /// A new buffer of `width` elements per token, holding `tokens` of the
    /// micro-batch, in the compute dtype.
    pub fn output(&mut self, width: usize, tokens: f64) -> Activation {
        self.value(width, tokens, self.compute)
    }

    fn value(&mut self, width: usize, tokens: f64, dtype: DType) -> Activation {
        self.next_id += 1;
        Activation { id: self.next_id, width, tokens, dtype }
    }

    /// Ranks in the tensor-parallel group.
    pub fn tp(&self) -> usize {
        self.settings.tp
    }

    /// Whether `Replicated` values are split over the sequence here.
    pub fn sequence_split(&self) -> bool {
        self.settings.sequence_split()
    }

    /// Whether the layer running now is to drop its selective activations
    /// (`#[recompute(selective)]`).
    pub fn selective(&self) -> bool {
        self.selective
    }

    fn here(&self) -> String {
        self.path.join(".")
    }

    fn stage(&self) -> StagePart {
        match self.placing {
            Placing::Part(p) => p,
            Placing::Open | Placing::SplitField => StagePart::Whole,
        }
    }

    /// The entry of the layer at the current path (the last one, or a new one).
    fn entry(&mut self) -> &mut LayerCost {
        let path = self.here();
        let stage = self.stage();
        let fresh = self.cost.layers.last().is_none_or(|l| l.path != path);
        if fresh {
            self.cost.layers.push(LayerCost::new(path, stage));
        }
        self.cost.layers.last_mut().expect("pushed")
    }

    /// What of a forward cost `forward` runs again in the backward: all of
    /// it inside a scope that full recompute discards, else nothing.
    fn rerun(&self, forward: f64) -> f64 {
        if self.discarding.is_empty() {
            0.0
        } else {
            forward
        }
    }

    /// Matrix FLOPs per token of the micro-batch: `forward` and `backward`,
    /// for the layer at the current path. Recomputed when in a recompute scope.
    pub fn flops(&mut self, forward: f64, backward: f64) {
        let again = self.rerun(forward);
        let e = self.entry();
        e.forward_flops += forward;
        e.backward_flops += backward;
        e.recompute_flops += again;
    }

    /// A product of `x` (`k` wide) with a `[k, n]` weight: `2·k·n` FLOPs per
    /// token forward, `4·k·n` backward (the input's and the weight's gradients).
    pub fn matmul(&mut self, x: &Activation, k: usize, n: usize) {
        let f = 2.0 * (k * n) as f64 * x.tokens;
        self.flops(f, 2.0 * f);
        self.entry().products.push(Product { k, n, tokens: x.tokens });
    }

    /// Attention's FLOPs (see [`flops`](Self::flops)), which run in its own
    /// kernel at its own rate.
    pub fn attention_flops(&mut self, forward: f64, backward: f64) {
        self.flops(forward, backward);
        self.entry().attention = true;
    }

    /// Elements of a transcendental element-wise function, forward and backward.
    pub fn nonlinear(&mut self, forward: f64, backward: f64) {
        let again = self.rerun(forward);
        let e = self.entry();
        e.forward_nonlinear += forward;
        e.backward_nonlinear += backward + again;
    }

    /// Forward FLOPs the current layer reruns in its backward (a selective
    /// recompute's core).
    pub fn recompute(&mut self, forward: f64) {
        self.entry().recompute_flops += forward;
    }

    /// Element-wise bytes moved per token, forward and backward.
    pub fn traffic(&mut self, forward: f64, backward: f64) {
        let again = self.rerun(forward);
        let e = self.entry();
        e.forward_traffic += forward;
        e.backward_traffic += backward + again;
    }

    /// Keeps `x` for the backward (once, however many layers keep it).
    pub fn save(&mut self, x: &Activation) {
        match self.discarding.first_mut() {
            Some(scope) => {
                if scope.ids.insert(x.id) {
                    scope.bytes += x.bytes();
                }
                // Still marks the path, so the layer shows in the table.
                self.entry();
            }
            None => {
                let fresh = self.kept.insert(x.id);
                let bytes = if fresh { x.bytes() } else { 0.0 };
                self.entry().saved_bytes += bytes;
            }
        }
    }

    /// Keeps a new buffer of `width` elements per token (on `tokens` of the
    /// micro-batch) of `dtype`: a norm's statistics, attention's log-sum-exp.
    pub fn save_new(&mut self, width: usize, tokens: f64, dtype: DType) {
        let v = self.value(width, tokens, dtype);
        self.save(&v);
    }

    /// A collective of `bytes_per_token` over `group` in `pass`, issued by the
    /// layer at the current path.
    pub fn collective(&mut self, kind: CollectiveKind, group: Group, pass: Pass, bytes_per_token: f64) {
        self.issue(kind, group, pass, bytes_per_token, 0.0, 0.0);
    }

    /// A collective in flight while `flops_per_token` matrix FLOPs run
    /// (see [`CollectiveCost::beside_flops`]).
    pub fn collective_beside(&mut self, kind: CollectiveKind, group: Group, pass: Pass, bytes_per_token: f64, flops_per_token: f64) {
        self.issue(kind, group, pass, bytes_per_token, 0.0, flops_per_token);
    }

    /// A collective of `bytes` per micro-batch, whatever its tokens (the
    /// counts an expert-parallel dispatch exchanges first).
    pub fn collective_per_micro_batch(&mut self, kind: CollectiveKind, group: Group, pass: Pass, bytes: f64) {
        self.issue(kind, group, pass, 0.0, bytes, 0.0);
    }

    fn issue(&mut self, kind: CollectiveKind, group: Group, pass: Pass, bytes_per_token: f64, bytes_per_micro_batch: f64, beside_flops: f64) {
        let size = match group {
            Group::Tp => self.settings.tp,
            Group::Ep => self.settings.ep,
            Group::Cp => self.settings.cp,
        };
        if size == 1 {
            return;
        }
        let (path, stage) = (self.here(), self.stage());
        let c = CollectiveCost { path, stage, kind, group, pass, bytes_per_token, bytes_per_micro_batch, beside_flops, backward_sum: false };
        // A collective of a recomputed forward runs again in the backward.
        if pass == Pass::Forward && !self.discarding.is_empty() {
            self.cost.collectives.push(CollectiveCost { pass: Pass::Backward, ..c.clone() });
        }
        self.cost.collectives.push(c);
    }

    /// The gradients of parameters replicated over the tensor-parallel
    /// group (of `elements` each), delivered by the layer running now:
    /// summed over the group when the layer saw a slice of the tokens (see
    /// [`Cx::grad`](super::Cx::grad)), all of a backward's together at its
    /// end, in one all-reduce ([`finish`](Self::finish) describes it, per
    /// pipeline part: see [`CollectiveCost::backward_sum`]).
    pub fn replicated_grads(&mut self, elements: &[usize]) {
        if !self.token_slice || !self.settings.sequence_split() {
            return;
        }
        let bytes: f64 = elements.iter().map(|&n| (n * self.compute.size_in_bytes()) as f64).sum();
        let stage = self.stage();
        match self.replicated.iter_mut().find(|(s, _)| *s == stage) {
            Some((_, total)) => *total += bytes,
            None => self.replicated.push((stage, bytes)),
        }
    }

    /// Runs `f` inside the sub-path `name`.
    pub fn child<T>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.path.push(name.to_string());
        let r = f(self);
        self.path.pop();
        r
    }

    /// Runs `f` for the part of a pipelined model `part` names.
    pub fn stage_part<T>(&mut self, part: StagePart, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.placing_for(Placing::Part(part), f)
    }

    /// Runs `f` for the `#[stage(split)]` field, whose layers report themselves.
    pub fn split_field<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.placing_for(Placing::SplitField, f)
    }

    /// Notes `x` as the activation a pipeline hands between stages, when
    /// the layers being described now are the ones a pipeline splits.
    pub fn boundary(&mut self, x: &Activation) {
        if self.placing == Placing::SplitField {
            self.cost.boundary_bytes = x.bytes();
        }
    }

    /// Runs `f` for layer `index` of `count` of a pipelined stack.
    pub fn pipeline_layer<T>(&mut self, index: usize, count: usize, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.placing != Placing::SplitField {
            return f(self);
        }
        self.placing = Placing::Part(StagePart::Layer { index, count });
        let r = f(self);
        self.placing = Placing::SplitField;
        r
    }

    fn placing_for<T>(&mut self, placing: Placing, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.placing != Placing::Open {
            return f(self);
        }
        self.placing = placing;
        let r = f(self);
        self.placing = Placing::Open;
        r
    }

    /// Takes the recompute a stack applies to each of its layers (see
    /// [`Module::RECOMPUTES_PER_LAYER`](super::Module::RECOMPUTES_PER_LAYER)).
    pub fn take_layer_recompute(&mut self) -> Option<super::Recompute> {
        self.layer_recompute.take()
    }

    /// `x` moved between sequence forms, as [`seq_convert`](super::seq_convert) does.
    pub fn seq_convert<L: Layout>(&mut self, x: Activation, from: Seq, to: Seq) -> Activation {
        if !L::IS_REPLICATED || from == to || !self.settings.sequence_split() {
            return x;
        }
        let tp = self.settings.tp as f64;
        match to {
            Seq::Whole => {
                let y = self.value(x.width, x.tokens * tp, x.dtype);
                self.collective(CollectiveKind::AllGather, Group::Tp, Pass::Forward, y.bytes());
                y
            }
            Seq::Split => {
                self.collective(CollectiveKind::AllGather, Group::Tp, Pass::Backward, x.bytes());
                self.value(x.width, x.tokens / tp, x.dtype)
            }
        }
    }

    /// `x` cast to `dtype` (a precision region's border); a new buffer when the dtype changes.
    pub fn cast(&mut self, x: Activation, dtype: DType) -> Activation {
        if x.dtype == dtype || !x.dtype.is_float() {
            return x;
        }
        let y = self.value(x.width, x.tokens, dtype);
        self.traffic(x.bytes() + y.bytes(), x.bytes() + y.bytes());
        y
    }

    fn check_same(&self, op: &'static str, a: &Activation, b: &Activation) -> Result<()> {
        if a.width != b.width || a.tokens != b.tokens {
            return Err(Error::shape(
                op,
                format!("`{}` combines values of {} and {} elements per token on a rank; both sides must have the same shape", self.here(), a.width, b.width),
            ));
        }
        Ok(())
    }

    /// `a + b`: nothing kept.
    pub fn add(&mut self, a: Activation, b: Activation) -> Result<Activation> {
        self.check_same("+", &a, &b)?;
        let y = self.output(a.width, a.tokens);
        self.traffic(3.0 * y.bytes(), 0.0);
        Ok(y)
    }

    /// `a * b` or `swiglu(a, b)`: both operands kept.
    pub fn product(&mut self, a: Activation, b: Activation) -> Result<Activation> {
        self.check_same("*", &a, &b)?;
        self.save(&a);
        self.save(&b);
        let y = self.output(a.width, a.tokens);
        self.traffic(3.0 * y.bytes(), 5.0 * y.bytes());
        Ok(y)
    }

    /// `swiglu(a, b)`: both operands kept, `silu` of one.
    pub fn swiglu(&mut self, a: Activation, b: Activation) -> Result<Activation> {
        let y = self.product(a, b)?;
        self.nonlinear(y.elements(), y.elements());
        Ok(y)
    }

    /// The backward of a value read `uses` times: its gradients are summed,
    /// one pass per extra use.
    pub fn reused(&mut self, x: &Activation, uses: usize) {
        if uses > 1 {
            self.traffic(0.0, 3.0 * (uses - 1) as f64 * x.bytes());
        }
    }

    /// `gelu(a)`, `silu(a)`: the operand kept.
    pub fn activation(&mut self, a: Activation) -> Activation {
        self.save(&a);
        let y = self.output(a.width, a.tokens);
        self.traffic(2.0 * y.bytes(), 3.0 * y.bytes());
        self.nonlinear(y.elements(), y.elements());
        y
    }

    /// `all_reduce(a)` (a reduce-scatter under sequence parallelism): the
    /// backward is free, or an all-gather.
    pub fn all_reduce(&mut self, a: Activation) -> Activation {
        if self.settings.sequence_split() {
            return self.reduce_scatter(a);
        }
        self.collective(CollectiveKind::AllReduce, Group::Tp, Pass::Forward, a.bytes());
        self.output(a.width, a.tokens)
    }

    /// `reduce_scatter(a)`: an all-gather in the backward.
    pub fn reduce_scatter(&mut self, a: Activation) -> Activation {
        self.collective(CollectiveKind::ReduceScatter, Group::Tp, Pass::Forward, a.bytes());
        self.collective(CollectiveKind::AllGather, Group::Tp, Pass::Backward, a.bytes());
        let tp = self.settings.tp as f64;
        self.output(a.width, a.tokens / tp)
    }

    /// `all_gather(a)`: the backward takes this rank's slice.
    pub fn all_gather(&mut self, a: Activation) -> Activation {
        let tp = self.settings.tp as f64;
        let y = self.output(a.width, a.tokens * tp);
        self.collective(CollectiveKind::AllGather, Group::Tp, Pass::Forward, y.bytes());
        y
    }

    /// Opens a scope that discards its activations (full recompute).
    fn begin_discard(&mut self) {
        self.discarding.push(Scope { ids: HashSet::new(), bytes: 0.0 });
    }

    fn end_discard(&mut self) {
        let scope = self.discarding.pop().expect("opened");
        if self.discarding.is_empty() {
            self.cost.recompute_peak_bytes = self.cost.recompute_peak_bytes.max(scope.bytes);
        }
    }

    /// The description, once the walk is done; `out` is the model's output.
    pub fn finish(mut self, out: &Activation) -> ModelCost {
        for (stage, bytes) in std::mem::take(&mut self.replicated) {
            let c = CollectiveCost {
                path: String::new(),
                stage,
                kind: CollectiveKind::AllReduce,
                group: Group::Tp,
                pass: Pass::Backward,
                bytes_per_token: 0.0,
                bytes_per_micro_batch: bytes,
                beside_flops: 0.0,
                backward_sum: true,
            };
            self.cost.collectives.push(c);
        }
        self.cost.output_bytes = out.bytes();
        self.cost
    }
}

/// Describes `m` called as the sub-module `name` on `x`, with `declared`
/// recompute (as [`call_recompute`](super::call_recompute) runs it, subject
/// to the settings' override).
pub fn describe_call<R: Role, M: Module<R>>(m: &M, d: &mut Describe, name: &str, x: Activation, declared: Option<super::Recompute>) -> Result<Activation> {
    use super::Recompute;
    let effective = match (d.settings.recompute, declared) {
        (RecomputeOverride::Off, _) | (_, None) => None,
        (RecomputeOverride::Full, Some(_)) => Some(Recompute::Full),
        (RecomputeOverride::AsDeclared, declared) => declared,
    };
    let slice = <M::In as Layout>::IS_REPLICATED && M::SEQ_IN == Seq::Split;
    let outer = std::mem::replace(&mut d.token_slice, slice);
    let r = d.child(name, |d| {
        if M::RECOMPUTES_PER_LAYER {
            d.layer_recompute = effective;
            let r = m.describe(d, x);
            d.layer_recompute = None;
            return r;
        }
        match effective {
            Some(Recompute::Full) => {
                d.save(&x);
                d.begin_discard();
                let r = m.describe(d, x);
                d.end_discard();
                r
            }
            Some(Recompute::Selective) => {
                let outer = std::mem::replace(&mut d.selective, true);
                let r = m.describe(d, x);
                d.selective = outer;
                r
            }
            None => m.describe(d, x),
        }
    });
    d.token_slice = outer;
    r
}

/// The description of `model` for `settings`, fed token ids (one u32 per
/// token): the walk of a whole language model.
pub fn describe<M: Module>(model: &M, settings: CostSettings) -> Result<ModelCost> {
    describe_with_input(model, settings, 1, DType::U32)
}

/// The description of `model` for `settings`, fed `width` elements per
/// token of `dtype` (a model over hidden states rather than token ids).
pub fn describe_with_input<M: Module>(model: &M, settings: CostSettings, width: usize, dtype: DType) -> Result<ModelCost> {
    let mut d = Describe::new(settings)?;
    // The caller hands the model its input in the form it takes.
    let split = M::SEQ_IN == Seq::Split && <M::In as Layout>::IS_REPLICATED && settings.sequence_split();
    let tokens = if split { 1.0 / settings.tp as f64 } else { 1.0 };
    let x = d.value(width, tokens, dtype);
    let y = model.describe(&mut d, x)?;
    let mut cost = d.finish(&y);
    let mut seen: HashSet<ParamId> = HashSet::new();
    super::visit_params(model, |e| {
        cost.params.push(ParamCost {
            name: e.name.to_string(),
            role: e.role,
            elements: e.param.global_shape().elem_count(),
            split: e.split_dim.is_some(),
            expert: e.expert.is_some(),
            stage: e.stage,
            tied: !seen.insert(e.param.id()),
        });
        Ok(())
    })?;
    Ok(cost)
}
