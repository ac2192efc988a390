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
    /// A shape the kernel fixes itself (the attention kernels check their
    /// block size and shared memory): `blocks` one-dimensional blocks of
    /// `threads` threads with `shared_bytes` of dynamic shared memory, which
    /// the launch allows the kernel first when it exceeds the default 48 KiB.
    Fixed { blocks: u32, threads: u32, shared_bytes: u32 },
}

/// One kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
// An argument list is a handful of values built per launch: boxing the one
// large variant would cost an allocation for no saving.
#[allow(clippy::large_enum_variant)]
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
    /// A `u32` (flags, seeds' halves).
    U32(u32),
    /// The device pointer of the op's `i`-th f32 scratch buffer (see
    /// `CudaCall::scratch_f32`).
    Scratch(usize),
    /// The attention kernels' argument struct, by value.
    Attn(tessera_kernels::cuda::attention::AttnParams),
}
