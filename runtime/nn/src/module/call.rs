//! Calling a sub-module from generated code: path and hooks around it,
//! typed layout checks with readable errors, and recompute.

use super::{Act, Cx, Layout, Module, Pipelined, RecomputeOverride, Replicated, Role, Seq};
use tessera_core::Result;

/// Layouts that can be fed to a layer taking `To`: only `To` itself.
///
/// Every sub-module call in a forward body goes through this bound, so a
/// layout mistake is reported with what the layer takes and what it got.
#[diagnostic::on_unimplemented(
    message = "this layer takes input of layout `{To}`, but the value given has layout `{Self}`",
    label = "expects `{To}`, got `{Self}`",
    note = "a row-parallel layer takes the `SplitHidden` output of a column-parallel layer; norms, plain layers and column-parallel layers take `Replicated` values; reduce a `PartialSum` with `all_reduce(..)` before using it"
)]
pub trait Feeds<To: Layout>: Layout {}
impl<L: Layout> Feeds<L> for L {}

/// Whether `M` reads a slice of the tokens under sequence parallelism.
fn reads_token_slice<R: Role, M: Module<R>>() -> bool {
    <M::In as Layout>::IS_REPLICATED && M::SEQ_IN == Seq::Split
}

/// `x` as the input of a layer taking `To`: only a `To` value fits (the
/// layout check of a call whose layer is reached through [`sharded`](super::sharded)).
#[doc(hidden)]
pub fn fed<To: Layout, L: Feeds<To>>(x: Act<L>) -> Act<To> {
    Act::new(x.into_tensor())
}

/// Runs `m.forward` as the sub-module `name`, with hooks around it.
pub fn call<R: Role, M: Module<R>, L: Feeds<M::In>>(m: &M, cx: &mut Cx, name: &str, x: Act<L>) -> Result<(Act<M::Out>, M::Saved)> {
    cx.enter(name);
    let outer = cx.set_token_slice(reads_token_slice::<R, M>());
    let r = (|| {
        cx.each_hook(|h, p| h.before_forward(p))?;
        let r = m.forward(cx, Act::new(x.into_tensor()))?;
        cx.each_hook(|h, p| h.after_forward(p))?;
        Ok(r)
    })();
    cx.set_token_slice(outer);
    cx.exit();
    r
}

/// Runs `m.backward` as the sub-module `name`, with hooks around it. The
/// gradients it delivers for parameters replicated over the tensor-parallel
/// group are summed over the group when it read a slice of the tokens (see
/// [`Cx::grad`]).
pub fn call_backward<R: Role, M: Module<R>>(m: &M, cx: &mut Cx, name: &str, saved: M::Saved, dy: Act<M::Out>) -> Result<Act<M::In>> {
    as_sub_module_backward::<R, M>(cx, name, |cx| m.backward(cx, saved, dy))
}

/// [`call_backward`] for a sub-module whose output its caller passed
/// straight to `all_reduce`: `dy` is the gradient of the reduced value,
/// and the sub-module runs the `all_reduce`'s backward itself
/// ([`Module::backward_gathering`]).
pub fn call_backward_gathering<R: Role, M: Module<R>>(m: &M, cx: &mut Cx, name: &str, saved: M::Saved, dy: Act<Replicated>) -> Result<Act<M::In>> {
    as_sub_module_backward::<R, M>(cx, name, |cx| m.backward_gathering(cx, saved, dy))
}

/// Runs `backward`, a backward of `M`, as the sub-module `name`: in its
/// path, reading the token slice `M` reads, with the hooks around it.
fn as_sub_module_backward<R: Role, M: Module<R>>(cx: &mut Cx, name: &str, backward: impl FnOnce(&mut Cx) -> Result<Act<M::In>>) -> Result<Act<M::In>> {
    cx.enter(name);
    let outer = cx.set_token_slice(reads_token_slice::<R, M>());
    let r = (|| {
        cx.each_hook(|h, p| h.before_backward(p))?;
        let r = backward(cx)?;
        cx.each_hook(|h, p| h.after_backward(p))?;
        Ok(r)
    })();
    cx.set_token_slice(outer);
    cx.exit();
    r
}

/// Runs the body of a generated backward. A model's whole backward (called
/// with no sub-module entered) collects the gradients of replicated
/// parameters that sum over the tensor-parallel group under sequence
/// parallelism and sums them at its end, in one all-reduce (see
/// [`Cx::grad`]); a sub-module's backward runs as it is.
#[doc(hidden)]
pub fn backward_root<T>(cx: &mut Cx, body: impl FnOnce(&mut Cx) -> Result<T>) -> Result<T> {
    let collecting = cx.at_root() && cx.collect_replicated_sums();
    let r = body(cx);
    if collecting {
        cx.finish_replicated_sums(r.is_ok())?;
    }
    r
}

/// What a sub-module call keeps between forward and backward when it may recompute.
pub enum Kept<S, L: Layout> {
    /// Everything the forward saved (recompute off for this call).
    Saved(S),
    /// Only the input; the forward runs again during the backward.
    Input(Act<L>),
}

/// What [`call_recompute`] returns: the output and what was kept of the call.
pub type KeptCall<R, M> = (Act<<M as Module<R>>::Out>, Kept<<M as Module<R>>::Saved, <M as Module<R>>::In>);

/// How a field declared recompute: `#[recompute]` (full) or `#[recompute(selective)]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    /// Keep only the sub-module's input; rerun its whole forward in backward.
    Full,
    /// Keep everything except what is large and cheap to recompute (the
    /// attention core); layers read this through [`Cx::selective_recompute`].
    Selective,
}

/// Like [`call`], for a field declaring `declared` recompute (subject to the
/// context's run-time override).
pub fn call_recompute<R: Role, M: Module<R>, L: Feeds<M::In>>(m: &M, cx: &mut Cx, name: &str, x: Act<L>, declared: Recompute) -> Result<KeptCall<R, M>> {
    let effective = match cx.recompute_override() {
        RecomputeOverride::AsDeclared => Some(declared),
        RecomputeOverride::Off => None,
        RecomputeOverride::Full => Some(Recompute::Full),
    };
    let x: Act<M::In> = Act::new(x.into_tensor());
    if M::RECOMPUTES_PER_LAYER {
        cx.set_layer_recompute(effective);
        let r = call::<R, M, M::In>(m, cx, name, x);
        cx.set_layer_recompute(None);
        let (y, saved) = r?;
        return Ok((y, Kept::Saved(saved)));
    }
    match effective {
        Some(Recompute::Full) => {
            let input = match cx.activation_host() {
                Some(host) => Act::new(x.tensor().to_device(host)?),
                None => x.clone(),
            };
            let (y, saved) = call::<R, M, M::In>(m, cx, name, x)?;
            drop(saved);
            Ok((y, Kept::Input(input)))
        }
        Some(Recompute::Selective) => {
            let outer = cx.set_selective_recompute(true);
            let r = call::<R, M, M::In>(m, cx, name, x);
            cx.set_selective_recompute(outer);
            let (y, saved) = r?;
            Ok((y, Kept::Saved(saved)))
        }
        None => {
            let (y, saved) = call::<R, M, M::In>(m, cx, name, x)?;
            Ok((y, Kept::Saved(saved)))
        }
    }
}

/// Backward of [`call_recompute`]: reruns the forward first when only the input was kept.
pub fn call_recompute_backward<R: Role, M: Module<R>>(m: &M, cx: &mut Cx, name: &str, kept: Kept<M::Saved, M::In>, dy: Act<M::Out>) -> Result<Act<M::In>> {
    let saved = match kept {
        Kept::Saved(s) => s,
        Kept::Input(x) => {
            // An offloaded input comes back (unless a prefetch brought it).
            let x = if x.tensor().device().same(cx.device()) { x } else { Act::new(x.tensor().to_device(cx.device())?) };
            let outer = cx.set_recomputing(true);
            let r = call::<R, M, M::In>(m, cx, name, x);
            cx.set_recomputing(outer);
            r?.1
        }
    };
    call_backward::<R, M>(m, cx, name, saved, dy)
}

/// Runs `layers` of the pipelined sub-module `name` (a pipeline stage's
/// share), applying the field's declared recompute per layer.
pub fn call_layers<M: Pipelined>(
    m: &M,
    cx: &mut Cx,
    name: &str,
    layers: std::ops::Range<usize>,
    x: Act<M::In>,
    declared: Option<Recompute>,
) -> Result<(Act<M::Out>, M::Saved)> {
    let effective = match (cx.recompute_override(), declared) {
        (RecomputeOverride::Off, _) | (_, None) => None,
        (RecomputeOverride::Full, Some(_)) => Some(Recompute::Full),
        (RecomputeOverride::AsDeclared, d) => d,
    };
    cx.enter(name);
    cx.set_layer_recompute(effective);
    let r = m.forward_layers(cx, layers, x);
    cx.set_layer_recompute(None);
    cx.exit();
    r
}

/// Backward of [`call_layers`].
pub fn call_layers_backward<M: Pipelined>(
    m: &M,
    cx: &mut Cx,
    name: &str,
    layers: std::ops::Range<usize>,
    saved: M::Saved,
    dy: Act<M::Out>,
) -> Result<Act<M::In>> {
    cx.enter(name);
    let r = m.backward_layers(cx, layers, saved, dy);
    cx.exit();
    r
}
