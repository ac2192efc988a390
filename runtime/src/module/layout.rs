//! Activation layouts as types: how a logical tensor lies on the tensor-parallel group.

use crate::tensor::Tensor;
use std::fmt;
use std::marker::PhantomData;

mod sealed {
    pub trait Sealed {}
}

/// A zero-sized marker naming how an activation is laid out on the
/// tensor-parallel (TP) group. Only the markers of this module implement it.
pub trait Layout: sealed::Sealed + Copy + Default + fmt::Debug + Send + Sync + 'static {
    /// The marker's name, for messages.
    const NAME: &'static str;
}

macro_rules! layouts {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
        pub struct $name;
        impl sealed::Sealed for $name {}
        impl Layout for $name {
            const NAME: &'static str = stringify!($name);
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

impl<L: Layout> fmt::Debug for Act<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Act<{}>({:?})", L::NAME, self.tensor)
    }
}

/// Layouts that combine elementwise (`+`, `*`, `swiglu`) with a value of layout `Rhs`.
///
/// Only equal layouts combine: a sum of two `PartialSum`s is still partial,
/// and a `Replicated` residual plus a `PartialSum` would add the residual once
/// per rank, so it is refused until the partial value is reduced.
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
