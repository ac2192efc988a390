//! Embedding lookup, plain and vocab-parallel.

use super::{float_kernel, run1, with_u32};
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::kernel::Out;
use crate::backend::Storage;
use crate::error::{Error, Result};
use crate::tensor::{DType, Shape, Tensor};
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

/// `acc += embedding_backward(ids, dout, ..)` in place, for a table
/// gradient gathered in parts (the rows of one part of the tokens, then of
/// the next): each of `acc`'s rows adds the upstream rows of its ids in
/// position order, as [`embedding_backward`] sums them.
///
/// `acc` is `[rows, dim]`, contiguous, `f32` or `f64`, and shares no
/// storage with `dout` (which is converted to `acc`'s dtype).
pub fn embedding_backward_accumulate(acc: &Tensor, ids: &Tensor, dout: &Tensor, vocab_start: usize, vocab_size: usize) -> Result<()> {
    const OP: &str = "embedding_backward_accumulate";
    let [rows, dim] = acc.dims() else {
        return Err(Error::shape(OP, format!("the accumulator {} must be a table gradient, [rows, dim]", acc.shape())));
    };
    let (rows, dim) = (*rows, *dim);
    check_range(OP, rows, vocab_start, vocab_size)?;
    if out_shape(ids, dim) != *dout.shape() {
        return Err(Error::shape(OP, format!("upstream gradient {} does not match ids {} with rows of {dim}", dout.shape(), ids.shape())));
    }
    if acc.shares_storage(dout) {
        return Err(Error::Aliased { op: OP, a: "accumulator", b: "upstream gradient" });
    }
    let Some(range) = acc.layout().contiguous_range() else {
        return Err(Error::placement(OP, "the accumulator must be contiguous; accumulate into a fresh `contiguous()` tensor"));
    };
    if !matches!(acc.dtype(), DType::F32 | DType::F64) {
        return Err(Error::DType { op: OP, expected: "f32 or f64 accumulator".into(), got: acc.dtype(), hint: "; accumulate gradients in full precision" });
    }
    let dout = if dout.dtype() == acc.dtype() { dout.contiguous()? } else { dout.to_dtype(acc.dtype())? };
    if matches!(acc.device(), crate::Device::Cuda(_)) {
        // The GPU sums each row in one block without atomics: the part's
        // gradient, then one in-place add.
        return super::accumulate(acc, &embedding_backward(ids, &dout, rows, vocab_start, vocab_size)?);
    }
    let dr = dout.layout().contiguous_range().expect("contiguous");
    with_u32(OP, "ids", ids, |id_slice| {
        check_ids(OP, id_slice, vocab_size, "; token ids must be smaller than the vocabulary size")?;
        let src = dout.read();
        let mut dst = acc.write();
        match (&mut *dst, &*src) {
            (Storage::Cpu(a), Storage::Cpu(d)) => match acc.dtype() {
                DType::F32 => scatter_add::<f32>(a, d, id_slice, dim, vocab_start, range, dr),
                _ => scatter_add::<f64>(a, d, id_slice, dim, vocab_start, range, dr),
            },
            _ => return Err(Error::DeviceMismatch { op: OP, lhs: acc.device().to_string(), rhs: dout.device().to_string() }),
        }
        Ok(())
    })
}

/// `acc[range] += ` the rows `d[dr]` of `ids` scatter-added (one dtype `T`).
fn scatter_add<T: tessera_kernels::Real + crate::tensor::Element>(
    acc: &mut crate::backend::cpu::CpuStorage,
    d: &crate::backend::cpu::CpuStorage,
    ids: &[u32],
    dim: usize,
    vocab_start: usize,
    range: std::ops::Range<usize>,
    dr: std::ops::Range<usize>,
) {
    let acc = &mut acc.as_mut_slice::<T>().expect("the accumulator's dtype")[range];
    k::embedding_backward(ids, &d.as_slice::<T>().expect("converted to the accumulator's dtype")[dr], acc.len() / dim, dim, vocab_start as u32, acc);
}

fn check_range(op: &'static str, rows: usize, vocab_start: usize, vocab_size: usize) -> Result<()> {
    if vocab_start + rows > vocab_size || vocab_size > u32::MAX as usize {
        return Err(Error::shape(op, format!("a shard of {rows} rows starting at {vocab_start} does not fit a vocabulary of {vocab_size}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Init;
    use crate::{Device, RngKey};

    /// A shard's table gradient accumulated slice by slice of the tokens
    /// equals the one of all tokens at once, in f32 and f64; a half or
    /// misshapen accumulator, or one aliasing the gradient, is refused.
    #[test]
    fn accumulating_slices_gives_the_whole_gradient() {
        let dev = Device::cpu();
        let (vocab, rows, start, dim, len) = (12, 5, 4, 3, 4);
        let ids: Vec<u32> = (0..2 * 3 * len as u32).map(|i| (i * 7 + 1) % vocab as u32).collect();
        let ids = Tensor::from_vec(ids, [2, 3 * len], &dev).unwrap();
        for dtype in [DType::F32, DType::F64] {
            let dout = Tensor::rand(Init::Normal { mean: 0.0, std: 1.0 }, RngKey::new(4, 0), [2, 3 * len, dim], dtype, &dev).unwrap();
            let whole = embedding_backward(&ids, &dout, rows, start, vocab).unwrap().to_f64_vec().unwrap();
            let slice = |t: &Tensor, r: usize| t.narrow(1, r * len, len).unwrap().contiguous().unwrap();
            let acc = embedding_backward(&slice(&ids, 1), &slice(&dout, 1), rows, start, vocab).unwrap();
            for r in [0, 2] {
                embedding_backward_accumulate(&acc, &slice(&ids, r), &slice(&dout, r), start, vocab).unwrap();
            }
            let got = acc.to_f64_vec().unwrap();
            assert!(whole.iter().any(|v| *v != 0.0));
            for (g, w) in got.iter().zip(&whole) {
                assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{dtype}: {got:?} against {whole:?}");
            }
        }
        let dout = Tensor::zeros([2, 3 * len, dim], DType::F32, &dev).unwrap();
        let refused = |acc: &Tensor, dout: &Tensor| embedding_backward_accumulate(acc, &ids, dout, start, vocab).unwrap_err().to_string();
        assert!(refused(&Tensor::zeros([rows, dim], DType::BF16, &dev).unwrap(), &dout).contains("f32 or f64"));
        assert!(refused(&Tensor::zeros([rows * dim], DType::F32, &dev).unwrap(), &dout).contains("[rows, dim]"));
        assert!(refused(&Tensor::zeros([rows, dim + 1], DType::F32, &dev).unwrap(), &dout).contains("does not match"));
        let shared = Tensor::zeros([2 * 3 * len * dim], DType::F32, &dev).unwrap();
        let acc = shared.narrow(0, 0, rows * dim).unwrap().reshape([rows, dim]).unwrap();
        assert!(refused(&acc, &shared.reshape([2, 3 * len, dim]).unwrap()).contains("accumulator"));
    }
}
