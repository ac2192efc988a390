//! Everything a derived model does with a column- or row-parallel field,
//! behind one generic function, [`sharded`] (whose doc says why).

use super::dsl::{all_reduce_backward, relabel};
use super::{
    call, call_backward, call_backward_gathering, call_recompute, call_recompute_backward, describe_call, seq_convert, seq_convert_backward, Act, Activation,
    Cx, Describe, Kept, Layout, Module, Recompute, Role, Seq, Visitor,
};
use std::any::Any;
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};

/// A sub-module's saved state with its type erased (a sharded field's, see
/// [`sharded`]); the backward restores the type.
pub struct Erased(Box<dyn Any + Send>);

impl std::fmt::Debug for Erased {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Erased")
    }
}

/// The field, shared or unique (tying needs it mutable).
pub enum LayerRef<'a, L> {
    /// A shared borrow of the field.
    Shared(&'a L),
    /// A mutable borrow of the field (needed to tie its weights).
    Unique(&'a mut L),
}

impl<L> LayerRef<'_, L> {
    fn get(&self) -> &L {
        match self {
            LayerRef::Shared(l) => l,
            LayerRef::Unique(l) => l,
        }
    }
}

/// What to do with a sharded field.
pub enum ShardedOp<'a, 'v> {
    /// Its forward on `x` (in sequence form `from`) as sub-module `name`,
    /// recomputing as `recompute` says.
    Forward {
        /// This rank's context.
        cx: &'a mut Cx,
        /// The field's name, by which its parent calls it.
        name: &'a str,
        /// The input.
        x: Tensor,
        /// The sequence form `x` is in.
        from: Seq,
        /// How to recompute the field, or `None` to keep its activations.
        recompute: Option<Recompute>,
    },
    /// Its backward: `saved` is what the forward returned; the input
    /// gradient comes back in form `from`.
    Backward {
        /// This rank's context.
        cx: &'a mut Cx,
        /// The field's name, by which its parent calls it.
        name: &'a str,
        /// What the forward returned as its saved state.
        saved: Erased,
        /// The gradient of the output.
        dy: Tensor,
        /// The sequence form the input gradient is returned in.
        from: Seq,
        /// Whether `dy` is the gradient of the `all_reduce` the output was
        /// passed to, whose backward the layer runs itself
        /// ([`Module::backward_gathering`]).
        gathering: bool,
    },
    /// Its parameters, to a visitor already inside the field's path.
    Visit(&'a mut Visitor<'v>),
    /// Its tensor-parallel constraints at `path`.
    CheckTp {
        /// The field's dotted path.
        path: &'a str,
        /// Ranks in the tensor-parallel group.
        degree: usize,
        /// Where each problem found is added.
        problems: &'a mut Vec<String>,
    },
    /// Ties the weights its own `#[tied]` fields share (needs [`LayerRef::Unique`]).
    TieParams,
    /// Its costs, called as sub-module `name` on `x` (in sequence form
    /// `from`), recomputing as `recompute` says.
    Describe {
        /// The walk.
        d: &'a mut Describe,
        /// The field's name.
        name: &'a str,
        /// The input.
        x: Activation,
        /// The sequence form `x` is in.
        from: Seq,
        /// How the field recomputes.
        recompute: Option<Recompute>,
    },
}

/// What [`sharded`] returns, by operation.
pub enum ShardedOut {
    /// The output and the saved state.
    Forward(Tensor, Erased),
    /// The input gradient.
    Backward(Tensor),
    /// The output of a description.
    Described(Activation),
    /// Nothing (visiting, checking, tying).
    Done,
}

impl ShardedOut {
    /// The forward's output (as layout `O`) and saved state.
    pub fn into_forward<O: Layout>(self) -> (Act<O>, Erased) {
        match self {
            ShardedOut::Forward(t, s) => (Act::new(t), s),
            _ => unreachable!("a forward returns its output"),
        }
    }

    /// The description's output.
    pub fn into_described(self) -> Activation {
        match self {
            ShardedOut::Described(a) => a,
            _ => unreachable!("a description returns its output"),
        }
    }

    /// The backward's input gradient, as layout `I`.
    pub fn into_backward<I: Layout>(self) -> Act<I> {
        match self {
            ShardedOut::Backward(t) => Act::new(t),
            _ => unreachable!("a backward returns its input gradient"),
        }
    }
}

/// Runs `op` on the field `layer` in role `R`, whose layouts the role fixes
/// (`I -> O`).
///
/// The generated code reaches such a field only through this function,
/// whose bound `L: Module<R, In = .., Out = ..>` says what the role requires.
/// A layer without that role (`#[shard(column)]` on a norm) then fails that
/// one bound: every use reports the same error at the same place (the
/// attribute), which rustc shows once, and nothing else of the model depends
/// on the bound. The layouts the role implies are known without it, and the
/// field's saved state is kept as [`Erased`], so the model's `Module` impl
/// holds whatever the field is, and a parent using the model adds no error
/// of its own.
pub fn sharded<R: Role, L, I: Layout, O: Layout>(mut layer: LayerRef<'_, L>, op: ShardedOp<'_, '_>) -> Result<ShardedOut>
where
    L: Module<R, In = I, Out = O>,
    L::Saved: 'static,
{
    Ok(match op {
        ShardedOp::Forward { cx, name, x, from, recompute } => {
            let x = seq_convert::<I>(cx, Act::new(x), from, L::SEQ_IN)?;
            match recompute {
                Some(mode) => {
                    let (y, kept) = call_recompute::<R, L, I>(layer.get(), cx, name, x, mode)?;
                    ShardedOut::Forward(y.into_tensor(), Erased(Box::new(kept)))
                }
                None => {
                    let (y, saved) = call::<R, L, I>(layer.get(), cx, name, x)?;
                    ShardedOut::Forward(y.into_tensor(), Erased(Box::new(saved)))
                }
            }
        }
        ShardedOp::Backward { cx, name, saved, dy, from, gathering } => {
            let saved = saved.0;
            let dx = match saved.downcast::<Kept<L::Saved, I>>() {
                Ok(kept) => {
                    // The recomputing path takes the output's gradient whole.
                    let dy = if gathering { relabel(all_reduce_backward(cx, Act::new(dy))?) } else { Act::new(dy) };
                    call_recompute_backward::<R, L>(layer.get(), cx, name, *kept, dy)?
                }
                Err(saved) => match saved.downcast::<L::Saved>() {
                    Ok(saved) if gathering => call_backward_gathering::<R, L>(layer.get(), cx, name, *saved, Act::new(dy))?,
                    Ok(saved) => call_backward::<R, L>(layer.get(), cx, name, *saved, Act::new(dy))?,
                    Err(_) => {
                        return Err(Error::state_mismatch(
                            "backward",
                            format!("`{name}` was given another layer's saved state; pass each backward what its forward returned"),
                        ))
                    }
                },
            };
            ShardedOut::Backward(seq_convert_backward::<I>(cx, dx, from, L::SEQ_IN)?.into_tensor())
        }
        ShardedOp::Visit(v) => {
            layer.get().visit_params(v)?;
            ShardedOut::Done
        }
        ShardedOp::CheckTp { path, degree, problems } => {
            layer.get().check_tp(path, degree, problems);
            ShardedOut::Done
        }
        ShardedOp::Describe { d, name, x, from, recompute } => {
            let x = d.seq_convert::<I>(x, from, L::SEQ_IN);
            ShardedOut::Described(describe_call::<R, L>(layer.get(), d, name, x, recompute)?)
        }
        ShardedOp::TieParams => {
            match &mut layer {
                LayerRef::Unique(l) => l.tie_params()?,
                LayerRef::Shared(_) => return Err(Error::unsupported("tie_params", "tying weights needs the layer mutably")),
            }
            ShardedOut::Done
        }
    })
}
