//! How an op's CUDA implementation describes a launch: the grid shape and
//! the kernel's arguments, named by role rather than by pointer, so the same
//! description compiles with and without the CUDA backend.

/// The shape of a launch, chosen from the data; the block and grid sizes
/// follow from it (see `launch.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Grid {
    /// A grid-stride loop over `n` independent items (elements, or columns).
    Items(usize),
    /// One block per row of a row-major `[rows, cols]` matrix, the block's
    /// threads striding over the row (reductions and norms).
    Rows { rows: usize, cols: usize },
}

/// One kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Arg {
    /// The device pointer of the op's `i`-th input, at its first element;
    /// the input must have the primary input's dtype.
    Input(usize),
    /// The same for an input of f32 statistics (a norm's saved mean or rstd).
    Stats(usize),
    /// The device pointer of the op's `i`-th output.
    Output(usize),
    /// A null pointer (an optional operand that is absent).
    Null,
    /// A `u64` (lengths and dimensions).
    U64(usize),
    /// An `f32` (scales, epsilons).
    F32(f32),
}
