//! Embedding lookup, plain and vocab-parallel.

use super::{float_kernel, run1, with_u32};
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::kernel::Out;
use crate::error::{Error, Result};
use crate::tensor::{Shape, Tensor};
use tessera_kernels::cpu::embedding as k;

float_kernel!(EmbedFwd<'a> { ids: &'a [u32], rows: usize, dim: usize, start: u32 } |s, i, o| {
    k::embedding_forward(i[0], s.rows, s.dim, s.start, s.ids, o[0])
}; cuda |s, c| {
    let n = s.ids.len();
    let ids = Arg::Scratch(c.upload_u32(s.ids)?);
    let args = [Arg::Input(0), ids, Arg::Output(0), Arg::U64(n), Arg::U64(s.rows), Arg::U64(s.dim), Arg::U64(s.start as usize)];
    c.at_least(Arg::Input(0), s.rows * s.dim)?;
    c.at_least(Arg::Output(0), n * s.dim)?;
    // SAFETY: the kernel writes `n * dim` elements and reads `n` ids (uploaded) and table rows
    // below `rows` (ids outside `start..start + rows` give zeros); the lengths are checked.
    unsafe { c.launch("embedding", "embedding", Grid::Items(n * s.dim), &args) }
});
float_kernel!(EmbedBack<'a> { ids: &'a [u32], rows: usize, dim: usize, start: u32 } |s, i, o| {
    k::embedding_backward(s.ids, i[0], s.rows, s.dim, s.start, o[0])
}; cuda |s, c| {
    // The positions of each table row, in order (as the CPU sums them),
    // built here and uploaded: one block per row sums them without atomics.
    let (offsets, order) = positions_by_row(s.ids, s.rows, s.start)?;
    let (offsets, order) = (Arg::Scratch(c.upload_u32(&offsets)?), Arg::Scratch(c.upload_u32(&order)?));
    let args = [Arg::Input(0), offsets, order, Arg::Output(0), Arg::U64(s.rows), Arg::U64(s.dim)];
    c.at_least(Arg::Input(0), s.ids.len() * s.dim)?;
    c.at_least(Arg::Output(0), s.rows * s.dim)?;
    // SAFETY: `offsets` has `rows + 1` entries and `order` lists positions below `ids.len()`
    // (built above from the ids); the kernel reads those positions' rows of the upstream
    // gradient and writes `rows * dim` elements (both lengths checked).
    unsafe { c.launch("embedding", "embedding_backward", Grid::Rows { rows: s.rows, cols: s.dim }, &args) }
});

/// For a table of `rows` rows holding entries `start..`: `offsets` (`rows + 1`)
/// and `order` such that `order[offsets[r]..offsets[r + 1]]` are the
/// positions of `ids` that name row `r`, in increasing order.
fn positions_by_row(ids: &[u32], rows: usize, start: u32) -> Result<(Vec<u32>, Vec<u32>)> {
    if ids.len() > u32::MAX as usize {
        return Err(Error::unsupported("embedding_backward", format!("{} ids exceed the GPU kernel's u32 positions; split the batch", ids.len())));
    }
    let local = |id: u32| id.checked_sub(start).map(|r| r as usize).filter(|&r| r < rows);
    let mut offsets = vec![0u32; rows + 1];
    for r in ids.iter().filter_map(|&id| local(id)) {
        offsets[r + 1] += 1;
    }
    for r in 0..rows {
        offsets[r + 1] += offsets[r];
    }
    let mut next: Vec<u32> = offsets[..rows].to_vec();
    let mut order = vec![0u32; offsets[rows] as usize];
    for (i, r) in ids.iter().enumerate().filter_map(|(i, &id)| local(id).map(|r| (i, r))) {
        order[next[r] as usize] = i as u32;
        next[r] += 1;
    }
    Ok((offsets, order))
}

fn table_dims(op: &'static str, table: &Tensor) -> Result<(usize, usize)> {
    match table.dims() {
        &[rows, dim] => Ok((rows, dim)),
        _ => Err(Error::shape(op, format!("the table must be [rows, dim], got {}", table.shape()))),
    }
}

fn check_ids(op: &'static str, ids: &[u32], bound: usize, hint: &'static str) -> Result<()> {
    match ids.iter().position(|&id| id as usize >= bound) {
        Some(position) => Err(Error::IndexOutOfRange { op, index: ids[position] as u64, position, bound: bound as u64, hint }),
        None => Ok(()),
    }
}

fn out_shape(ids: &Tensor, dim: usize) -> Shape {
    let mut d = ids.dims().to_vec();
    d.push(dim);
    Shape::new(d)
}

/// Looks up the rows of `table` (`[vocab, dim]`) for the `u32` token `ids`
/// (any shape); the result has shape `[..ids, dim]`.
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (rows, _) = table_dims("embedding", table)?;
    embedding_shard(table, ids, 0, rows)
}

/// Vocab-parallel lookup: `table` holds rows `vocab_start..vocab_start + rows`
/// of a `vocab_size`-row embedding; ids outside that range give zero rows, so
/// summing the results of every shard gives the full lookup.
pub fn embedding_shard(table: &Tensor, ids: &Tensor, vocab_start: usize, vocab_size: usize) -> Result<Tensor> {
    const OP: &str = "embedding";
    let (rows, dim) = table_dims(OP, table)?;
    check_range(OP, rows, vocab_start, vocab_size)?;
    with_u32(OP, "ids", ids, |id_slice| {
        check_ids(OP, id_slice, vocab_size, "; token ids must be smaller than the vocabulary size")?;
        let kernel = EmbedFwd { ids: id_slice, rows, dim, start: vocab_start as u32 };
        run1(OP, &kernel, &[table], out_shape(ids, dim), Out::Primary)
    })
}

/// Backward of [`embedding`]/[`embedding_shard`]: the gradient of the table
/// (`[rows, dim]`), the upstream rows scatter-added at their ids.
pub fn embedding_backward(ids: &Tensor, dout: &Tensor, rows: usize, vocab_start: usize, vocab_size: usize) -> Result<Tensor> {
    const OP: &str = "embedding_backward";
    check_range(OP, rows, vocab_start, vocab_size)?;
    let dim = dout.shape().last_dim(OP)?;
    if out_shape(ids, dim) != *dout.shape() {
        return Err(Error::shape(OP, format!("upstream gradient {} does not match ids {} with rows of {dim}", dout.shape(), ids.shape())));
    }
    with_u32(OP, "ids", ids, |id_slice| {
        check_ids(OP, id_slice, vocab_size, "; token ids must be smaller than the vocabulary size")?;
        let kernel = EmbedBack { ids: id_slice, rows, dim, start: vocab_start as u32 };
        run1(OP, &kernel, &[dout], [rows, dim].into(), Out::Primary)
    })
}

fn check_range(op: &'static str, rows: usize, vocab_start: usize, vocab_size: usize) -> Result<()> {
    if vocab_start + rows > vocab_size || vocab_size > u32::MAX as usize {
        return Err(Error::shape(op, format!("a shard of {rows} rows starting at {vocab_start} does not fit a vocabulary of {vocab_size}")));
    }
    Ok(())
}
