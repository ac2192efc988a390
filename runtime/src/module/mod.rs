//! Modules: layers with typed layouts, a typed `Saved`, forward, backward and
//! a parameter visitor.
//!
//! Primitive layers (`Linear`, `LayerNorm`, attention, ...) implement
//! [`Module`] by hand. Models are structs of layers with `#[derive(Module)]`
//! and a `#[forward]` body, from which the macros generate the same trait.

mod call;
mod cx;
pub mod dsl;
mod layout;
mod param;
mod role;
mod visit;

pub use call::{call, call_backward, call_layers, call_layers_backward, call_recompute, call_recompute_backward, Feeds, Kept, KeptCall, Recompute};
pub use cx::{Cx, Groups, Hooks, RecomputeOverride};
pub use layout::{Act, Dispatched, Layout, PartialSum, Replicated, SameLayout, SplitHidden, SplitSeq};
pub use param::{Param, Shard};
pub use role::{Column, Plain, Role, RoleKind, Row, Vocab};
pub use visit::{ParamEntry, Visitor};

use crate::error::{Error, Result};

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
    /// layers (a [`Stack`](crate::nn::Stack)) rather than as a whole.
    const RECOMPUTES_PER_LAYER: bool = false;

    /// Computes the output and the state the backward needs.
    fn forward(&self, cx: &mut Cx, x: Act<Self::In>) -> Result<(Act<Self::Out>, Self::Saved)>;

    /// Returns the gradient of the input and delivers the parameters' gradients.
    fn backward(&self, cx: &mut Cx, saved: Self::Saved, dy: Act<Self::Out>) -> Result<Act<Self::In>>;

    /// Reports every parameter with its dotted name (relative to this layer).
    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()>;

    /// Reports, into `problems`, every way this layer (at `path`) cannot be
    /// split over a tensor-parallel group of `degree` ranks that its
    /// parameters' shapes do not already show (attention heads, say).
    fn check_tp(&self, path: &str, degree: usize, problems: &mut Vec<String>) {
        let _ = (path, degree, problems);
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
    visit_params(model, |e| {
        e.param.take_grad();
        Ok(())
    })
}

/// Gives every parameter of `model` this rank's shard, in the master dtype (f32).
///
/// First checks every sharded dimension (and every layer's own constraint,
/// such as head counts) against the tensor-parallel degree and reports all
/// that do not divide, naming the parameter or layer and both numbers, before
/// allocating anything.
pub fn materialize<M: Module>(model: &M, cx: &Cx) -> Result<()> {
    let (rank, degree) = (cx.tp().rank(), cx.tp().size());
    let mut problems = Vec::new();
    if degree > 1 {
        model.check_tp("", degree, &mut problems);
    }
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
        return Err(Error::invalid(
            "materialize",
            format!("{}; choose a tensor-parallel degree that divides these sizes, or pad them", problems.join("; ")),
        ));
    }
    visit_params(model, |e| {
        let shard = match e.split_dim {
            Some(dim) if degree > 1 => Shard::Split { dim, rank, degree },
            _ => Shard::Replicated,
        };
        e.param.materialise(e.name, shard, cx.master_dtype(), cx.seed(), cx.device())
    })
}
