//! The CUDA launches several ops share: each describes, for a `.cu` kernel,
//! which operands go where. Written against the kernels' parameter lists in
//! `kernels/cuda/` (which every launch is also checked against), and each
//! checks the operands' lengths its kernel relies on before launching.

use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::cuda::CudaCall;
use crate::error::Result;

/// `kernel(x, out, n)` over every element: one input, one output of its size.
pub(crate) fn unary(c: &mut CudaCall, source: &'static str, kernel: &str) -> Result<()> {
    let n = c.output_len(0);
    c.at_least(Arg::Input(0), n)?;
    // SAFETY: the kernel reads and writes `n` elements: output 0's length, which input 0 has (checked).
    unsafe { c.launch(source, kernel, Grid::Items(n), &[Arg::Input(0), Arg::Output(0), Arg::U64(n)]) }
}

/// `kernel(x, out, n)` writing `x[0]` to every element of the output: a
/// one-element input spread over the output's size.
pub(crate) fn broadcast(c: &mut CudaCall, source: &'static str, kernel: &str) -> Result<()> {
    let n = c.output_len(0);
    c.at_least(Arg::Input(0), 1)?;
    // SAFETY: the kernel reads element 0 of input 0 (which has one, checked)
    // and writes `n` elements: output 0's length.
    unsafe { c.launch(source, kernel, Grid::Items(n), &[Arg::Input(0), Arg::Output(0), Arg::U64(n)]) }
}

/// `kernel(a, b, out, n)` over every element: two inputs of the output's size.
pub(crate) fn binary(c: &mut CudaCall, source: &'static str, kernel: &str) -> Result<()> {
    let n = c.output_len(0);
    c.at_least(Arg::Input(0), n)?;
    c.at_least(Arg::Input(1), n)?;
    // SAFETY: the kernel reads and writes `n` elements: output 0's length, which both inputs have (checked).
    unsafe { c.launch(source, kernel, Grid::Items(n), &[Arg::Input(0), Arg::Input(1), Arg::Output(0), Arg::U64(n)]) }
}

/// `kernel(x, out, rows, cols)` with one block per row: input 0 seen as
/// `[rows, cols]`, one f32 per row written to output 0 (a scalar when
/// `rows` is 1).
pub(crate) fn row_reduce(c: &mut CudaCall, kernel: &str, rows: usize, cols: usize) -> Result<()> {
    c.at_least(Arg::Input(0), rows * cols)?;
    c.at_least(Arg::Output(0), rows)?;
    // SAFETY: the kernel reads `rows * cols` elements and writes `rows` (both checked).
    unsafe { c.launch("reduce", kernel, Grid::Rows { rows, cols }, &[Arg::Input(0), Arg::Output(0), Arg::U64(rows), Arg::U64(cols)]) }
}

/// `kernel(x, y, rows, cols)` with one block per row: input 0 and output 0
/// seen as `[rows, cols]` (softmax).
pub(crate) fn rows_unary(c: &mut CudaCall, source: &'static str, kernel: &str, cols: usize) -> Result<()> {
    let rows = c.output_len(0) / cols.max(1);
    c.at_least(Arg::Input(0), rows * cols)?;
    // SAFETY: the kernel reads and writes `rows * cols` elements: at most output 0's length, and input 0's (checked).
    unsafe { c.launch(source, kernel, Grid::Rows { rows, cols }, &[Arg::Input(0), Arg::Output(0), Arg::U64(rows), Arg::U64(cols)]) }
}

/// `kernel(a, b, out, rows, cols)` with one block per row: inputs 0 and 1
/// and output 0 seen as `[rows, cols]` (softmax backwards).
pub(crate) fn rows_binary(c: &mut CudaCall, source: &'static str, kernel: &str, cols: usize) -> Result<()> {
    let rows = c.output_len(0) / cols.max(1);
    c.at_least(Arg::Input(0), rows * cols)?;
    c.at_least(Arg::Input(1), rows * cols)?;
    // SAFETY: the kernel reads and writes `rows * cols` elements: at most output 0's length, and both inputs' (checked).
    unsafe { c.launch(source, kernel, Grid::Rows { rows, cols }, &[Arg::Input(0), Arg::Input(1), Arg::Output(0), Arg::U64(rows), Arg::U64(cols)]) }
}
