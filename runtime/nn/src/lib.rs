//! Primitive layers with hand-written backward passes.
//!
//! Its place: this crate holds Tessera's module system ([`module`]: the
//! `Module` trait, layouts, the per-rank context `Cx`, parameters) and the
//! layers written in it. It imports the tensor core and `tessera-dist` (a `Cx`
//! carries the rank's communicators); the parallel engines and the trainer
//! build on it. Users reach it as `tessera::nn` and `tessera::module`.
//!
//! Each layer implements [`Module<R>`](crate::module::Module) for every role
//! `R` it supports, with the activation layouts that role implies:
//!
//! | layer | roles | input → output |
//! |---|---|---|
//! | [`Linear`] | `Plain`, `Column`, `Row`, `Vocab` | `Replicated → Replicated`, `Replicated → SplitHidden`, `SplitHidden → PartialSum`, `Replicated → SplitHidden` |
//! | [`Embedding`] | `Plain`, `Vocab` | `Replicated → Replicated`, `Replicated → PartialSum` |
//! | [`LayerNorm`], [`RmsNorm`], [`Dropout`], [`Moe`] | `Plain` | `Replicated → Replicated` |
//! | [`CausalAttention`] | `Plain` | `SplitHidden → SplitHidden` (heads split) |
//! | [`Stack`] | `Plain` | the layer's own layout |
//! | [`PositionEmbedding`] | `Plain` | `Replicated → Replicated` (adds learned position rows) |
//!
//! For inference, [`quantize_linears`] replaces every linear layer's weight
//! of a materialised model by an int8, int4 or W8A8 form in place; the
//! layers then multiply from the codes ([`tessera_core::ops::quant_matmul`]).
//!
//! Forwards read parameters with [`Cx::param`](crate::module::Cx::param)
//! (which counts the use and casts to the compute dtype); backwards re-read
//! them without counting (so a ZeRO-3 gather before the backward is honoured
//! and no weight copy lives in the saved state) and deliver each gradient once
//! with [`Cx::grad`](crate::module::Cx::grad).

pub mod module;

mod attention;
mod dropout;
mod embedding;
mod linear;
mod loss;
mod moe;
mod norm;
mod position;
mod quant;
mod ring_attention;
mod rows;
mod stack;

pub use attention::{AttentionSaved, CausalAttention};
pub use dropout::{Dropout, DropoutSaved};
pub use embedding::{Embedding, EmbeddingSaved};
pub use linear::{Linear, LinearSaved};
pub use loss::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward, VocabParallelCeSaved};
pub use moe::{Moe, MoeSaved, MoeStats};
pub use norm::{LayerNorm, NormState, RmsNorm};
pub use position::{PositionEmbedding, PositionEmbeddingSaved};
pub use quant::{quantize_linears, QuantizeReport};
pub use stack::Stack;

use crate::module::{Cx, Param};
use tessera_core::tensor::Tensor;
use tessera_core::Result;

/// A parameter's value in the compute dtype, for a backward: unlike
/// [`Cx::param`] it records no use (the forward already did).
fn param_value(cx: &Cx, p: &Param) -> Result<Tensor> {
    let v = p.value()?;
    if v.dtype() == cx.compute_dtype() || !v.dtype().is_float() {
        Ok(v)
    } else {
        v.to_dtype(cx.compute_dtype())
    }
}

/// Bytes held by the elements of `t` (its whole storage view, as a count of
/// its own elements).
fn bytes_of(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

use crate::module::{Recomputable, SelectiveRecomputable, Tie};

macro_rules! tie_by_weight {
    ($($t:ty),*) => {$(
        impl Tie for $t {
            fn weight(&self) -> &Param {
                <$t>::weight(self)
            }
            fn tie_weight(&mut self, p: &Param) -> Result<()> {
                <$t>::tie_weight(self, p)
            }
        }
    )*};
}
tie_by_weight!(Linear, Embedding);

// Every layer that keeps activations for its backward; `Dropout` keeps only
// its random key, so recomputing it saves nothing.
impl Recomputable for Linear {}
impl Recomputable for Embedding {}
impl Recomputable for LayerNorm {}
impl Recomputable for RmsNorm {}
impl Recomputable for CausalAttention {}
impl Recomputable for Moe {}
impl<M> Recomputable for Stack<M> {}

impl SelectiveRecomputable for CausalAttention {}
impl<M: SelectiveRecomputable> SelectiveRecomputable for Stack<M> {}
