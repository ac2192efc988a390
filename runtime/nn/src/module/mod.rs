//! Modules: layers with typed layouts, a typed `Saved`, forward, backward and
//! a parameter visitor.
//!
//! Primitive layers (`Linear`, `LayerNorm`, attention, ...) implement
//! [`Module`] by hand. Models are structs of layers with `#[derive(Module)]`
//! and a `#[forward]` body, from which the macros generate the same trait.

mod call;
mod context;
mod cx;
mod decode;
mod deferred;
mod describe;
pub mod dsl;
mod fp8;
mod layout;
pub(crate) mod overlap;
mod param;
mod role;
pub(crate) mod seq;
mod sharded;
mod stage;
mod visit;

pub use call::{
    backward_root, call, call_backward, call_backward_gathering, call_layers, call_layers_backward, call_recompute, call_recompute_backward, fed, Feeds, Kept,
    KeptCall, Recompute,
};
pub use context::{ContextSplit, TokenRun};
pub use cx::{Cx, Hooks, RecomputeOverride};
pub use decode::{Decode, KvCache, KvLayer};
pub use deferred::WeightGrads;
pub use describe::{
    describe, describe_call, describe_with_input, Activation, CollectiveCost, CollectiveKind, CostSettings, Describe, Group, LayerCost, ModelCost, ParamCost,
    Pass, Product,
};
pub(crate) use fp8::Operand;
pub use fp8::{Fp8Recipe, Fp8Saved, Fp8Snapshot};
pub use layout::{Act, Dispatched, Layout, PartialSum, Pointwise, Replicated, SameLayout, Seq, SplitHidden, SplitSeq};
pub use seq::{seq_convert, seq_convert_backward};
#[doc(hidden)]
pub use sharded::{sharded, Erased, LayerRef, ShardedOp, ShardedOut};
/// The communicators a [`Cx`] holds; they belong to [`dist`](tessera_dist)
/// and are named here too, beside the context that carries them.
pub use tessera_dist::Groups;

/// Not layouts: one more item of each layout's name, so that rustc never
/// shortens a layout's path in its messages. rustc prints a type by its bare
/// name only when that name is unique and was not reached through a glob
/// import in the user's crate; since `use tessera::prelude::*` brings the
/// layouts in by glob, the names a user writes would print as
/// `tessera::module::Replicated` and the others as `PartialSum`, in one
/// message. With the names never unique, every diagnostic names every
/// layout the same way: `tessera::module::Replicated`.
pub mod layout_names {
    #![allow(dead_code)]
    /// Not a layout: a second item named `Replicated`.
    pub enum Replicated {}
    /// Not a layout: a second item named `SplitHidden`.
    pub enum SplitHidden {}
    /// Not a layout: a second item named `SplitSeq`.
    pub enum SplitSeq {}
    /// Not a layout: a second item named `PartialSum`.
    pub enum PartialSum {}
    /// Not a layout: a second item named `Dispatched`.
    pub enum Dispatched {}
}
pub use param::{InitialValues, Param, ParamId, Shard};
pub use role::{Column, Plain, Role, RoleKind, Row, Vocab};
pub use stage::{layers_of, PipelineLayout, StagePart};
pub use visit::{ExpertSlot, ParamEntry, Visitor};

use tessera_core::{Error, Result};

/// A layer, as used in role `R` by its parent (see [`Role`]).
///
/// `In` and `Out` are the layouts of its input and output on the
/// tensor-parallel group; `Saved` is what its forward keeps for its backward,
/// so activation memory is visible in the type. The backward consumes the
/// saved state, accumulates parameter gradients through [`Cx::grad`], and
/// returns the gradient of the input.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a layer usable in the role `{R}`",
    label = "no `Module<{R}>` for this type",
    note = "`#[shard(column)]` and `#[shard(row)]` apply to `Linear`; `#[shard(vocab)]` to `Embedding` and to a `Linear` output head; other layers take no `#[shard]`",
    note = "a struct of layers becomes a layer with `#[derive(Module)]` and a `#[forward]` impl"
)]
pub trait Module<R: Role = Plain>: Send + Sync {
    /// Layout of the input activation.
    type In: Layout;
    /// Layout of the output activation.
    type Out: Layout;
    /// What the forward keeps for the backward.
    type Saved: Send;

    /// Whether the layer applies a declared recompute to each of its own
    /// layers (a [`Stack`](crate::Stack)) rather than as a whole.
    const RECOMPUTES_PER_LAYER: bool = false;

    /// Under sequence parallelism, the form in which the layer takes a
    /// `Replicated` input (ignored for other input layouts).
    ///
    /// The default, [`Seq::Whole`], is always correct: the caller gathers the
    /// sequence first and the layer computes exactly what it computes without
    /// sequence parallelism. A layer that treats each token on its own (a
    /// norm, a linear map) declares [`Seq::Split`] and then works on this
    /// rank's slice of the tokens; every gradient it delivers for a parameter
    /// replicated over the tensor-parallel group is then partial, and
    /// [`Cx::grad`] sums it over the group. A layer that takes the slice and
    /// gathers it itself (a column-parallel linear) declares `Split` too.
    /// Models made with `#[derive(Module)]` derive both constants from their
    /// forward body.
    const SEQ_IN: Seq = Seq::Whole;

    /// Under sequence parallelism, the form of a `Replicated` output (ignored
    /// for other output layouts); [`Seq::Whole`] by default.
    const SEQ_OUT: Seq = Seq::Whole;

    /// Computes the output and the state the backward needs.
    fn forward(&self, cx: &mut Cx, x: Act<Self::In>) -> Result<(Act<Self::Out>, Self::Saved)>;

    /// Returns the gradient of the input and delivers the parameters' gradients.
    fn backward(&self, cx: &mut Cx, saved: Self::Saved, dy: Act<Self::Out>) -> Result<Act<Self::In>>;

    /// [`backward`](Self::backward) for an output that its caller passed
    /// straight to [`all_reduce`](dsl::all_reduce): `dy` is the gradient of
    /// the reduced value, before the backward of the `all_reduce` (under
    /// sequence parallelism, this rank's slice of the sequence, still to be
    /// gathered). The default runs that backward and then this layer's; a
    /// row-parallel layer (or a vocabulary-parallel embedding) instead
    /// gathers the other slices while its own slice's part runs (see
    /// [`Cx::with_tp_overlap`]). `#[derive(Module)]` calls it for a field
    /// whose only use is an `all_reduce`, and forwards it to its own last
    /// layer where that layer's output is the model's.
    fn backward_gathering(&self, cx: &mut Cx, saved: Self::Saved, dy: Act<Replicated>) -> Result<Act<Self::In>> {
        let dy = dsl::all_reduce_backward(cx, dy)?;
        self.backward(cx, saved, dsl::relabel(dy))
    }

    /// Reports every parameter with its dotted name (relative to this layer).
    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()>;

    /// Reports, into `problems`, every way this layer (at `path`) cannot be
    /// split over a tensor-parallel group of `degree` ranks that its
    /// parameters' shapes do not already show (attention heads, say).
    fn check_tp(&self, path: &str, degree: usize, problems: &mut Vec<String>) {
        let _ = (path, degree, problems);
    }

    /// Reports this layer's costs to the walk `d` (see [`describe`]): its
    /// matrix FLOPs, kept bytes, element-wise traffic and collectives for
    /// the input `x`; returns the output. `#[derive(Module)]` generates it
    /// from the forward; a layer implemented by hand describes itself, or
    /// the planner cannot cost a model that uses it.
    fn describe(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        let _ = (d, x);
        Err(Error::unsupported(
            "describe",
            format!(
                "`{}` does not describe its costs; implement `Module::describe` for it (see the primitive layers' for examples)",
                std::any::type_name::<Self>()
            ),
        ))
    }

    /// Links the weights that `#[tied(..)]` fields share (recursively).
    fn tie_params(&mut self) -> Result<()> {
        Ok(())
    }
}

/// A layer that a pipeline divides among its stages (`#[stage(split)]`):
/// a sequence of layers of one type, run a contiguous range at a time.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be split over pipeline stages",
    label = "`#[stage(split)]` needs a `Stack` of blocks",
    note = "put the repeated blocks in a `Stack<Block>` and mark that field `#[stage(split)]`"
)]
pub trait Pipelined: Module<Plain> {
    /// Number of layers to divide.
    fn layer_count(&self) -> usize;
    /// Forward over `layers` only (a stage's share).
    fn forward_layers(&self, cx: &mut Cx, layers: std::ops::Range<usize>, x: Act<Self::In>) -> Result<(Act<Self::Out>, Self::Saved)>;
    /// Backward over `layers`, with the state [`forward_layers`](Self::forward_layers) returned for them.
    fn backward_layers(&self, cx: &mut Cx, layers: std::ops::Range<usize>, saved: Self::Saved, dy: Act<Self::Out>) -> Result<Act<Self::In>>;
}

/// A model cut into pipeline stages at its `#[stage(split)]` field
/// (generated by `#[forward]`): the part before the split field, any
/// contiguous range of its layers, and the part after. Run in order over all
/// layers, the parts compute exactly the model's forward and backward.
pub trait Staged: Module {
    /// The layout of the activation crossing every stage boundary.
    type Boundary: Layout;
    /// What the part before the split field keeps for its backward.
    type FirstSaved: Send;
    /// What a range of the split field's layers keeps.
    type SplitSaved: Send;
    /// What the part after the split field keeps.
    type LastSaved: Send;

    /// Number of layers of the split field, to divide among (virtual) stages.
    fn split_layers(&self) -> usize;
    /// The first stage's part before the split layers.
    fn forward_first(&self, cx: &mut Cx, x: Act<Self::In>) -> Result<(Act<Self::Boundary>, Self::FirstSaved)>;
    /// Backward of [`forward_first`](Self::forward_first).
    fn backward_first(&self, cx: &mut Cx, saved: Self::FirstSaved, dy: Act<Self::Boundary>) -> Result<Act<Self::In>>;
    /// Layers `layers` of the split field.
    fn forward_split(&self, cx: &mut Cx, layers: std::ops::Range<usize>, x: Act<Self::Boundary>) -> Result<(Act<Self::Boundary>, Self::SplitSaved)>;
    /// Backward of [`forward_split`](Self::forward_split) over the same layers.
    fn backward_split(&self, cx: &mut Cx, layers: std::ops::Range<usize>, saved: Self::SplitSaved, dy: Act<Self::Boundary>) -> Result<Act<Self::Boundary>>;
    /// The last stage's part after the split layers.
    fn forward_last(&self, cx: &mut Cx, x: Act<Self::Boundary>) -> Result<(Act<Self::Out>, Self::LastSaved)>;
    /// Backward of [`forward_last`](Self::forward_last).
    fn backward_last(&self, cx: &mut Cx, saved: Self::LastSaved, dy: Act<Self::Out>) -> Result<Act<Self::Boundary>>;
}

/// Layers whose weight another layer can share (`#[tied(..)]`): an embedding
/// table and an output head of the same global shape.
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no weight to tie",
    label = "`#[tied(..)]` needs a layer with a single weight matrix",
    note = "tie an output `Linear` to an `Embedding` (or another `Linear`) of the same shape"
)]
pub trait Tie {
    /// The shared weight.
    fn weight(&self) -> &Param;
    /// Replaces this layer's weight by `p` (an error unless the global shapes match).
    fn tie_weight(&mut self, p: &Param) -> Result<()>;
}

/// Layers for which recompute saves memory: they keep activations between
/// forward and backward that a recompute can drop.
#[diagnostic::on_unimplemented(
    message = "`#[recompute]` on `{Self}` saves nothing",
    label = "this layer keeps no activation worth recomputing",
    note = "recompute layers with parameters, attention, or whole blocks; remove `#[recompute]` here"
)]
pub trait Recomputable {}

/// `prefix.name`, or `name` at the top.
#[doc(hidden)]
pub fn join_path(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

#[doc(hidden)]
pub fn assert_recomputable<M: Recomputable>() {}

/// Structs with `#[derive(Module)]`, which `#[forward]` needs.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "`#[forward]` is on an impl of `{Self}`, which has no `#[derive(Module)]`",
    label = "this struct needs `#[derive(Module)]`",
    note = "write `#[derive(Module)]` on the struct: the derive reads its layers and attributes, `#[forward]` its forward body"
)]
pub trait Derived {}

#[doc(hidden)]
pub fn assert_derived<M: Derived + ?Sized>() {}

/// Layers that selective recompute changes: they hold an attention core
/// (directly, or through the layers they contain) that
/// `#[recompute(selective)]` drops and recomputes.
#[diagnostic::on_unimplemented(
    message = "`#[recompute(selective)]` on `{Self}` drops nothing",
    label = "no attention core in this layer",
    note = "selective recompute drops the attention core of the layers below it; use it on attention, blocks or stacks of blocks, or use `#[recompute]` for full recompute"
)]
pub trait SelectiveRecomputable {}

#[doc(hidden)]
pub fn assert_selective<M: SelectiveRecomputable>() {}

/// Ties the shared weights of `model`, then materialises it for this rank
/// (see [`materialize`]): the model as a rank will train it.
pub fn build<M: Module>(mut model: M, cx: &Cx) -> Result<M> {
    model.tie_params()?;
    materialize(&model, cx)?;
    Ok(model)
}

/// Calls `f` on every parameter of `model` with its stable dotted name.
pub fn visit_params<M: Module>(model: &M, mut f: impl FnMut(ParamEntry<'_>) -> Result<()>) -> Result<()> {
    model.visit_params(&mut Visitor::new(&mut f))
}

/// Drops every accumulated gradient of `model` and the uses still waiting
/// for theirs: the start of a fresh step.
pub fn zero_grad<M: Module>(model: &M) -> Result<()> {
    for p in distinct_params(model)? {
        p.param.take_grad();
    }
    Ok(())
}

/// One parameter of a model with every name it is reached by: one name,
/// or several for a weight tied between layers.
#[derive(Clone, Debug)]
pub struct NamedParam {
    /// The names in visit order; the first is the parameter's own.
    pub names: Vec<String>,
    /// The parameter.
    pub param: Param,
}

impl NamedParam {
    /// The first name (a tied weight is stored and reported under it).
    pub fn name(&self) -> &str {
        &self.names[0]
    }

    /// Whether several layers share this parameter.
    pub fn is_tied(&self) -> bool {
        self.names.len() > 1
    }
}

/// Every distinct parameter of `model` once, in visit order, with all its names.
pub fn distinct_params<M: Module>(model: &M) -> Result<Vec<NamedParam>> {
    let mut out: Vec<NamedParam> = Vec::new();
    let mut index: std::collections::HashMap<ParamId, usize> = std::collections::HashMap::new();
    visit_params(model, |e| {
        match index.get(&e.param.id()) {
            Some(&i) => out[i].names.push(e.name.to_string()),
            None => {
                index.insert(e.param.id(), out.len());
                out.push(NamedParam { names: vec![e.name.to_string()], param: e.param.clone() });
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// Checks, on shapes alone, that `model` can be split over a tensor-parallel
/// group of `degree` ranks: the degree divides every dimension a parameter is
/// split along, and every layer's own constraint holds (attention heads over
/// the group, a static degree the model declares). The error names each
/// parameter or layer at fault. [`materialize`] runs it first; a trainer
/// runs it before it starts any rank.
pub fn check_tp_degree<M: Module>(model: &M, degree: usize) -> Result<()> {
    let mut problems = Vec::new();
    // Every degree is checked, one included: a model declaring a static
    // degree (`#[model(tp = N)]`) must run on a group of exactly that size.
    model.check_tp("", degree, &mut problems);
    visit_params(model, |e| {
        if let Some(dim) = e.split_dim {
            let size = e.param.global_shape().dims().get(dim).copied().unwrap_or(0);
            if degree > 1 && size % degree != 0 {
                problems.push(format!(
                    "`{}` ({:?}-parallel) has dimension {dim} of size {size}, which the tensor-parallel degree {degree} does not divide",
                    e.name, e.role
                ));
            }
        }
        Ok(())
    })?;
    if !problems.is_empty() {
        return Err(Error::indivisible(
            "materialize",
            format!("{}; choose a tensor-parallel degree that divides these sizes, or pad them", problems.join("; ")),
        ));
    }
    Ok(())
}

/// Gives every parameter of `model` this rank's shard, in the master dtype (f32).
///
/// First checks every sharded dimension (and every layer's own constraint,
/// such as head counts) against the tensor-parallel degree and reports all
/// that do not divide, naming the parameter or layer and both numbers, before
/// allocating anything.
///
/// When the context declares its pipeline layout
/// ([`Cx::with_pipeline_chunks`]), only the parameters of this rank's
/// pipeline stage get values; the others are marked
/// [remote](Param::is_remote) and take no memory here.
pub fn materialize<M: Module>(model: &M, cx: &Cx) -> Result<()> {
    let (rank, degree) = (cx.tp().rank(), cx.tp().size());
    check_tp_degree(model, degree)?;
    // Every part of the pipeline through which each parameter is reached
    // (a tied weight may be reached from the first and the last stage).
    let mut parts: std::collections::HashMap<ParamId, Vec<StagePart>> = std::collections::HashMap::new();
    visit_params(model, |e| {
        parts.entry(e.param.id()).or_default().push(e.stage);
        Ok(())
    })?;
    let stage = cx.groups().pp.rank();
    let layout = cx.pipeline_layout()?;
    let held = |p: &Param| match &layout {
        None => true,
        Some(l) => parts.get(&p.id()).is_none_or(|v| l.holders(v).contains(&stage)),
    };
    visit_params(model, |e| {
        let shard = match e.split_dim {
            Some(dim) if degree > 1 => Shard::Split { dim, rank, degree },
            _ => Shard::Full,
        };
        if held(e.param) {
            // Drawn in the master dtype, whatever the parameter is held in,
            // so a run in half precision starts from the f32 run's weights
            // rounded once.
            e.param.materialise(e.name, shard, cx.master_dtype(), cx.seed(), cx.device())?;
            let value = e.param.value()?;
            if value.dtype() != cx.param_dtype() {
                e.param.set_value(value.to_dtype(cx.param_dtype())?)?;
            }
            Ok(())
        } else {
            e.param.mark_remote(e.name, shard);
            Ok(())
        }
    })
}
