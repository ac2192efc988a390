//! The differentiable functions a `#[forward]` body may call, on typed
//! activations, each with the backward the generated code pairs it with.
//!
//! The backward of each follows from one invariant on gradients: the
//! gradient of a `Replicated`, `SplitHidden` or `SplitSeq` value is complete
//! (never a partial sum) on every rank, for the part of the value the rank
//! holds; the gradient of a `PartialSum` value is the complete gradient of
//! the sum, the same on every rank.
//!
//! | function | forward | backward |
//! |---|---|---|
//! | `x + y` | equal layouts (`PartialSum + PartialSum` stays partial) | the gradient to both |
//! | `x * y` | equal layouts, not `PartialSum` | the gradient times the other |
//! | `gelu`, `silu` | any layout but `PartialSum`, elementwise | elementwise |
//! | `swiglu(gate, up)` | equal layouts, not `PartialSum` | elementwise |
//! | `all_reduce` | `PartialSum -> Replicated` | identity (Megatron's g) |
//! | `reduce_scatter` | `PartialSum -> SplitSeq` (over the sequence, dim 1) | all-gather |
//! | `all_gather` | `SplitSeq -> Replicated` | this rank's slice, no communication |

use super::{Act, Cx, Layout, PartialSum, Pointwise, Replicated, SameLayout, SplitSeq};
use tessera_core::ops;
use tessera_core::tensor::{DType, Tensor};
use tessera_core::Result;

/// What an elementwise DSL function keeps: its input(s), layout-erased.
#[derive(Debug)]
pub struct Inputs(pub Vec<Tensor>);

/// `a + b`.
pub fn add<A: SameLayout<B>, B: Layout>(a: Act<A>, b: Act<B>) -> Result<Act<A>> {
    Ok(Act::new(ops::add(a.tensor(), b.tensor())?))
}

/// Gradients of `a + b`: the upstream gradient, once per operand.
pub fn add_backward<A: Layout, B: Layout>(g: Act<A>) -> (Act<A>, Act<B>) {
    let t = g.tensor().clone();
    (g, Act::new(t))
}

/// `a * b` elementwise.
pub fn mul<A: SameLayout<B> + Pointwise, B: Layout>(a: Act<A>, b: Act<B>) -> Result<(Act<A>, Inputs)> {
    let y = ops::mul(a.tensor(), b.tensor())?;
    Ok((Act::new(y), Inputs(vec![a.into_tensor(), b.into_tensor()])))
}

/// Gradients of `a * b`.
pub fn mul_backward<A: Layout, B: Layout>(saved: Inputs, g: Act<A>) -> Result<(Act<A>, Act<B>)> {
    let (da, db) = ops::mul_backward(&saved.0[0], &saved.0[1], g.tensor())?;
    Ok((Act::new(da), Act::new(db)))
}

/// GELU (tanh form).
pub fn gelu<L: Pointwise>(x: Act<L>) -> Result<(Act<L>, Inputs)> {
    Ok((Act::new(ops::gelu(x.tensor())?), Inputs(vec![x.into_tensor()])))
}

/// Backward of [`gelu`].
pub fn gelu_backward<L: Layout>(saved: Inputs, g: Act<L>) -> Result<Act<L>> {
    Ok(Act::new(ops::gelu_backward(&saved.0[0], g.tensor())?))
}

/// SiLU.
pub fn silu<L: Pointwise>(x: Act<L>) -> Result<(Act<L>, Inputs)> {
    Ok((Act::new(ops::silu(x.tensor())?), Inputs(vec![x.into_tensor()])))
}

/// Backward of [`silu`].
pub fn silu_backward<L: Layout>(saved: Inputs, g: Act<L>) -> Result<Act<L>> {
    Ok(Act::new(ops::silu_backward(&saved.0[0], g.tensor())?))
}

/// `silu(gate) * up`.
pub fn swiglu<A: SameLayout<B> + Pointwise, B: Layout>(gate: Act<A>, up: Act<B>) -> Result<(Act<A>, Inputs)> {
    let y = ops::swiglu(gate.tensor(), up.tensor())?;
    Ok((Act::new(y), Inputs(vec![gate.into_tensor(), up.into_tensor()])))
}

/// Gradients of [`swiglu`].
pub fn swiglu_backward<A: Layout, B: Layout>(saved: Inputs, g: Act<A>) -> Result<(Act<A>, Act<B>)> {
    let (dg, du) = ops::swiglu_backward(&saved.0[0], &saved.0[1], g.tensor())?;
    Ok((Act::new(dg), Act::new(du)))
}

/// Layouts `all_reduce` and `reduce_scatter` take: only `PartialSum`.
#[diagnostic::on_unimplemented(
    message = "`all_reduce` and `reduce_scatter` take a `PartialSum` value, but this one is `{Self}`",
    label = "not a partial sum",
    note = "only the output of a row-parallel layer (or a vocab-parallel embedding) needs reducing; remove the reduction here"
)]
pub trait Reducible: Layout {}
impl Reducible for PartialSum {}

/// Layouts `all_gather` takes: only `SplitSeq`.
#[diagnostic::on_unimplemented(
    message = "`all_gather` takes a `SplitSeq` value, but this one is `{Self}`",
    label = "not split over the sequence",
    note = "`all_gather` undoes `reduce_scatter` in sequence-parallel blocks"
)]
pub trait Gatherable: Layout {}
impl Gatherable for SplitSeq {}

/// Casts an activation to `dtype` (no copy when it already has it or is not float).
pub fn cast<L: Layout>(x: Act<L>, dtype: DType) -> Result<Act<L>> {
    if x.tensor().dtype() == dtype || !x.tensor().dtype().is_float() {
        Ok(x)
    } else {
        Ok(Act::new(x.tensor().to_dtype(dtype)?))
    }
}

/// The dtype a `#[precision(..)]` region computes in when entered from
/// `outer`: the requested one, except that an f64 run (gradient checks) stays
/// f64 throughout.
pub fn region_dtype(outer: DType, requested: DType) -> DType {
    if outer == DType::F64 {
        DType::F64
    } else {
        requested
    }
}

/// Sums a partial value over the tensor-parallel group. Under sequence
/// parallelism ([`Cx::sequence_split`]) each rank keeps only its slice of the
/// sequence (dim 1): a reduce-scatter, half the traffic of an all-reduce.
pub fn all_reduce<L: Reducible>(cx: &mut Cx, x: Act<L>) -> Result<Act<Replicated>> {
    if cx.sequence_split() {
        if let Some(running) = cx.take_reduction(x.tensor()) {
            // Started slice by slice by the row-parallel layer that made `x`.
            return Ok(Act::new(running.sum.wait()?));
        }
        Ok(Act::new(cx.tp().reduce_scatter_sum(x.tensor(), 1)?))
    } else {
        Ok(Act::new(cx.tp().all_reduce_sum(x.tensor())?))
    }
}

/// Backward of [`all_reduce`]: the identity (each rank's partial input
/// contributed to the sum with weight one), or, under sequence parallelism,
/// the all-gather of the slices' gradients.
pub fn all_reduce_backward(cx: &mut Cx, g: Act<Replicated>) -> Result<Act<PartialSum>> {
    if cx.sequence_split() {
        Ok(Act::new(cx.tp().all_gather(g.tensor(), 1)?))
    } else {
        Ok(Act::new(g.into_tensor()))
    }
}

/// Sums a partial value over the group and keeps this rank's slice of the sequence (dim 1).
pub fn reduce_scatter<L: Reducible>(cx: &mut Cx, x: Act<L>) -> Result<Act<SplitSeq>> {
    if let Some(running) = cx.take_reduction(x.tensor()) {
        // Started slice by slice by the row-parallel layer that made `x`.
        return Ok(Act::new(running.sum.wait()?));
    }
    Ok(Act::new(cx.tp().reduce_scatter_sum(x.tensor(), 1)?))
}

/// Backward of [`reduce_scatter`]: all-gather the slices' gradients.
pub fn reduce_scatter_backward(cx: &mut Cx, g: Act<SplitSeq>) -> Result<Act<PartialSum>> {
    Ok(Act::new(cx.tp().all_gather(g.tensor(), 1)?))
}

/// Gathers the sequence slices (dim 1) of every rank.
pub fn all_gather<L: Gatherable>(cx: &mut Cx, x: Act<L>) -> Result<Act<Replicated>> {
    Ok(Act::new(cx.tp().all_gather(x.tensor(), 1)?))
}

/// Backward of [`all_gather`]: the gradient of the gathered `Replicated`
/// value is already complete on every rank, so each keeps its slice of the
/// sequence; no communication. (A reduce-scatter here would count every
/// gradient once per rank: the column-parallel layer that usually follows
/// already completes its input gradient.)
pub fn all_gather_backward(cx: &mut Cx, g: Act<Replicated>) -> Result<Act<SplitSeq>> {
    let (rank, tp) = (cx.tp().rank(), cx.tp().size());
    let t = g.tensor();
    if t.rank() < 2 || !t.dims()[1].is_multiple_of(tp) {
        return Err(tessera_core::Error::shape(
            "all_gather_backward",
            format!("a gradient of shape {} cannot be split over dimension 1 into {tp} slices", t.shape()),
        ));
    }
    let part = t.dims()[1] / tp;
    Ok(Act::new(t.narrow(1, rank * part, part)?.contiguous()?))
}

/// Re-types a gradient whose layout the forward already checked (the
/// generated backward uses it so that a layout error is reported once, in
/// the forward, rather than again in the backward).
pub fn relabel<A: Layout, B: Layout>(g: Act<A>) -> Act<B> {
    Act::new(g.into_tensor())
}

/// The layouts a forward whose signature returns `To` may end with: only `To`.
#[diagnostic::on_unimplemented(
    message = "the forward ends with a value of layout `{Self}`, but its signature returns `{To}`",
    label = "this is `{Self}`",
    note = "reduce a `PartialSum` with `all_reduce(..)` before returning it, or change the declared output layout"
)]
pub trait Returns<To: Layout>: Layout {}
impl<L: Layout> Returns<L> for L {}

/// The forward's output, checked against the declared layout.
pub fn returns<To: Layout, L: Returns<To>>(x: Act<L>) -> Act<To> {
    Act::new(x.into_tensor())
}

/// Adds `g` into a gradient slot (values used more than once get the sum of their uses' gradients).
pub fn accumulate<L: Layout>(slot: &mut Option<Act<L>>, g: Act<L>) -> Result<()> {
    *slot = Some(match slot.take() {
        None => g,
        Some(acc) => Act::new(ops::add(acc.tensor(), g.tensor())?),
    });
    Ok(())
}

/// Makes `layer` (field `field` of `model`) share the weight of `with`
/// (field `partner`); an error naming both fields when the shapes differ.
pub fn tie<A: super::Tie, B: super::Tie>(layer: &mut A, with: &B, model: &str, field: &str, partner: &str) -> Result<()> {
    let w = with.weight().clone();
    layer.tie_weight(&w).map_err(|e| e.context(format!("`{model}.{field}` is `#[tied({partner})]` to `{model}.{partner}`, but")))
}
