//! Activation layouts as types: how a logical tensor lies on the tensor-parallel group.

use std::fmt;
use std::marker::PhantomData;
use tessera_core::tensor::Tensor;

mod sealed {
    pub trait Sealed {}
}

/// A zero-sized marker naming how an activation is laid out on the
/// tensor-parallel (TP) group. Only the markers of this module implement it.
pub trait Layout: sealed::Sealed + Copy + Default + fmt::Debug + Send + Sync + 'static {
    /// The marker's name, for messages.
    const NAME: &'static str;
    /// Whether this is [`Replicated`]: the one layout whose values sequence
    /// parallelism may hold as a slice of the sequence (see [`Seq`]).
    const IS_REPLICATED: bool;
}

macro_rules! layouts {
    (@replicated Replicated) => { true };
    (@replicated $other:ident) => { false };
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
        pub struct $name;
        impl sealed::Sealed for $name {}
        impl Layout for $name {
            const NAME: &'static str = stringify!($name);
            const IS_REPLICATED: bool = layouts!(@replicated $name);
        }
    )*};
}

layouts! {
    /// Every TP rank holds the whole tensor.
    Replicated,
    /// Each TP rank holds a slice of the last dimension (hidden units, heads, vocabulary).
    SplitHidden,
    /// Each TP rank holds a slice of the sequence dimension (sequence parallelism).
    SplitSeq,
    /// Each TP rank holds a full-shape tensor; the value is the sum over the group.
    PartialSum,
    /// Each rank holds the tokens routed to its experts (expert parallelism).
    Dispatched,
}

/// An activation: a tensor plus the layout it has on the tensor-parallel group.
///
/// The layout is a type, so a forward body that feeds a `PartialSum` where a
/// `Replicated` value is needed does not compile.
pub struct Act<L: Layout> {
    tensor: Tensor,
    _layout: PhantomData<L>,
}

impl<L: Layout> Act<L> {
    /// Declares that `tensor` has layout `L`. Hand-written modules use this at
    /// their boundary; generated code never needs to.
    pub fn new(tensor: Tensor) -> Self {
        Act { tensor, _layout: PhantomData }
    }

    /// The tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// The tensor, giving up the layout.
    pub fn into_tensor(self) -> Tensor {
        self.tensor
    }
}

impl<L: Layout> Clone for Act<L> {
    fn clone(&self) -> Self {
        Act::new(self.tensor.clone())
    }
}

/// `Act<Replicated>`, as layouts are named everywhere.
impl<L: Layout> fmt::Debug for Act<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Act<{}>({:?})", L::NAME, self.tensor)
    }
}

/// Layouts that combine elementwise (`+`, `*`, `swiglu`) with a value of layout `Rhs`.
///
/// Only equal layouts combine: a sum of two `PartialSum`s is still partial,
/// and a `Replicated` residual plus a `PartialSum` would add the residual once
/// per rank, so it is refused until the partial value is reduced. (`*` and
/// `swiglu` also need [`Pointwise`].)
#[diagnostic::on_unimplemented(
    message = "cannot combine an activation of layout `{Self}` with one of layout `{Rhs}` elementwise",
    label = "`{Self}` and `{Rhs}` differ",
    note = "reduce a `PartialSum` first (`all_reduce(..)`, or `reduce_scatter(..)` with sequence parallelism), or gather a split value, so both sides have the same layout"
)]
pub trait SameLayout<Rhs: Layout>: Layout {}

// One impl per layout rather than a blanket `impl<L> SameLayout<L> for L`:
// with a single impl, type inference would equate the two layouts before
// checking the bound and report a bare type mismatch instead of the message.
macro_rules! same_layout {
    ($($l:ident),*) => {$( impl SameLayout<$l> for $l {} )*};
}
same_layout!(Replicated, SplitHidden, SplitSeq, PartialSum, Dispatched);

/// Layouts a nonlinear elementwise function (`gelu`, `silu`, `swiglu`, `*`)
/// may be applied to: every layout whose ranks hold actual values, that is
/// all but [`PartialSum`].
///
/// A `PartialSum` is a value only once summed over the group, and
/// `gelu(a) + gelu(b) ≠ gelu(a + b)`, `(a₁ + a₂)·(b₁ + b₂) ≠ a₁·b₁ + a₂·b₂`:
/// a partial sum goes only through linear operations (a sum with another
/// `PartialSum`, the reductions).
#[diagnostic::on_unimplemented(
    message = "a nonlinear function or a product of a `{Self}` value: the sum over the group of the results is not the function of the sum",
    label = "this value is `{Self}`",
    note = "a `PartialSum` admits only linear operations (`+` with another `PartialSum`, `all_reduce`, `reduce_scatter`); reduce it first, e.g. `gelu(all_reduce(x))`"
)]
pub trait Pointwise: Layout {}
impl Pointwise for Replicated {}
impl Pointwise for SplitHidden {}
impl Pointwise for SplitSeq {}
impl Pointwise for Dispatched {}

/// How a [`Replicated`] value lies along the sequence when sequence
/// parallelism is on (see [`Cx::with_sequence_parallel`](super::Cx::with_sequence_parallel)).
///
/// Without sequence parallelism every `Replicated` value is whole on every
/// rank. With it, the residual stream is split along the sequence (dim 1):
/// each rank of the tensor-parallel group holds its slice. Which values are
/// split is decided at compile time, from what each layer declares it takes
/// ([`Module::SEQ_IN`](super::Module::SEQ_IN)) and returns
/// ([`Module::SEQ_OUT`](super::Module::SEQ_OUT)); the generated code gathers or
/// slices where a value's form differs from what its consumer takes, so a model
/// that compiles computes the same function either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Seq {
    /// Every rank holds the whole sequence (always correct; the default).
    Whole,
    /// Each rank holds its slice of the sequence (dim 1): per-token layers
    /// run on `1/tp` of the tokens.
    Split,
}

impl Seq {
    /// The form of `a ∘ b` for an elementwise `∘`: split when either side is
    /// (slicing the whole side is free; gathering the split one is not).
    pub const fn join(a: Seq, b: Seq) -> Seq {
        match (a, b) {
            (Seq::Whole, Seq::Whole) => Seq::Whole,
            _ => Seq::Split,
        }
    }

    /// The form a value must have for all of `consumers`: whole when any
    /// takes it whole, else split.
    pub const fn for_all(consumers: &[Seq]) -> Seq {
        let mut i = 0;
        while i < consumers.len() {
            if matches!(consumers[i], Seq::Whole) {
                return Seq::Whole;
            }
            i += 1;
        }
        Seq::Split
    }
}
