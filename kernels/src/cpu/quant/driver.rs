//! The parallel frame every quantized product shares: tasks over blocks of
//! output channels (rows of the weight), each computing its channels for
//! every row of `x`, then the bias.
//!
//! A task writes its block "transposed", `out[(j - first) * m + row]`, so
//! that its outputs are one contiguous chunk whatever `m` is; for `m = 1`
//! (decode) that is already `y`'s layout, otherwise one pass transposes into
//! `y` (cheap: `m·n` values against `m·n·k` products).

use rayon::prelude::*;
use std::cell::Cell;
use std::ops::Range;

/// Bytes of weights a task streams at least: enough to pay for taking a
/// task from the pool (a few microseconds), few enough that a 4096-wide
/// layer still makes hundreds of tasks to balance over the threads.
const TASK_BYTES: usize = 32 << 10;

/// Below this many multiply-adds the whole product runs on the calling
/// thread: waking the pool would cost more than it saves.
const PAR_MIN_MACS: usize = 1 << 18;

/// The sizes of a product, as the frame needs them.
#[derive(Clone, Copy, Debug)]
pub(super) struct Frame {
    /// Rows of `x` (and of `y`).
    pub m: usize,
    /// Output channels: rows of the weight, columns of `y`.
    pub n: usize,
    /// The depth: input features.
    pub k: usize,
    /// What one output channel streams (its quantized bytes and scales):
    /// it sizes the tasks.
    pub row_bytes: usize,
    /// Every block's start and length (but the last's) is a multiple of
    /// this: the inner loops' row count.
    pub rows_multiple: usize,
}

/// Runs `block(rows, out)` over blocks of the output channels and writes
/// `y[r, j] = out_j[r] (+ bias[j])` (`y` is `[m, n]`). `block` must write
/// all `rows.len() * m` values of `out`.
pub(super) fn for_output_blocks(f: Frame, bias: Option<&[f32]>, y: &mut [f32], block: impl Fn(Range<usize>, &mut [f32]) + Sync) {
    let Frame { m, n, k, row_bytes, rows_multiple } = f;
    if m == 0 || n == 0 {
        return;
    }
    let per_task = TASK_BYTES.div_ceil(row_bytes.max(1)).next_multiple_of(rows_multiple).max(rows_multiple);
    let parallel = m * n * k >= PAR_MIN_MACS && n > per_task;
    let add_bias = |first: usize, out: &mut [f32]| {
        if let Some(b) = bias {
            for (o, &b) in out.iter_mut().zip(&b[first..]) {
                *o += b;
            }
        }
    };
    if m == 1 {
        // Decode: the transposed layout is y's own; the bias goes in while
        // the block's outputs are in cache.
        let task = |(t, out): (usize, &mut [f32])| {
            let first = t * per_task;
            block(first..first + out.len(), out);
            add_bias(first, out);
        };
        if parallel {
            y.par_chunks_mut(per_task).enumerate().for_each(task);
        } else {
            task((0, y));
        }
        return;
    }
    let mut t = vec![0f32; n * m];
    let task = |(i, out): (usize, &mut [f32])| {
        let first = i * per_task;
        block(first..first + out.len() / m, out);
    };
    if parallel {
        t.par_chunks_mut(per_task * m).enumerate().for_each(task);
    } else {
        task((0, &mut t));
    }
    let row = |(r, y_row): (usize, &mut [f32])| {
        for (j, o) in y_row.iter_mut().enumerate() {
            *o = t[j * m + r];
        }
        add_bias(0, y_row);
    };
    if parallel {
        y.par_chunks_mut(n).enumerate().for_each(row);
    } else {
        y.chunks_mut(n).enumerate().for_each(row);
    }
}

thread_local! {
    /// The f32 tile a prefill task dequantizes its block into, kept per
    /// thread so repeated products neither allocate nor page-fault.
    static TILE: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Runs `f` on this thread's tile of `len` floats (contents unspecified).
/// A nested use on the same thread (rayon work stealing inside `f`) finds
/// the slot empty and allocates its own.
pub(super) fn with_tile(len: usize, f: impl FnOnce(&mut [f32])) {
    let mut v = TILE.with(Cell::take);
    if v.len() < len {
        v.resize(len, 0.0);
    }
    f(&mut v[..len]);
    TILE.with(|c| c.set(v));
}
