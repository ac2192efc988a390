//! Joining tensors end to end (gradient buckets, packed transfers) and along
//! a dimension (sequence chunks).

use super::{Shape, Tensor};
use crate::backend::{CpuStorage, CudaStorage, Device, Storage};
use crate::error::{Error, Result};
use std::ops::Range;

impl Tensor {
    /// The elements of every part, in order, as one 1-D tensor. All parts
    /// must share dtype and device; views are read in their logical order.
    pub fn concat_flat(parts: &[&Tensor]) -> Result<Tensor> {
        const OP: &str = "concat_flat";
        check_parts(OP, parts)?;
        let contiguous: Vec<Tensor> = parts.iter().map(|p| p.contiguous()).collect::<Result<_>>()?;
        let pieces: Vec<(usize, Range<usize>)> = contiguous.iter().enumerate().map(|(i, t)| (i, t.layout().contiguous_range().expect("contiguous"))).collect();
        let total = pieces.iter().map(|(_, r)| r.len()).sum();
        join(OP, &contiguous, &pieces, Shape::new(vec![total]))
    }

    /// The parts joined along `dim`: every part has the rank and the
    /// dimensions of the first except `dim`, whose lengths add up. All parts
    /// share dtype and device.
    ///
    /// A part whose elements from `dim` on are contiguous (a contiguous
    /// tensor, or a [`narrow`](Self::narrow) of one along `dim` or an outer
    /// dimension) is read where it lies, without a copy of its own.
    pub fn concat(parts: &[&Tensor], dim: usize) -> Result<Tensor> {
        const OP: &str = "concat";
        check_parts(OP, parts)?;
        let first = parts[0];
        let rank = first.rank();
        if dim >= rank {
            return Err(Error::shape(OP, format!("dimension {dim} of tensors of rank {rank}; join along a dimension below {rank}")));
        }
        for p in parts {
            let same = p.rank() == rank && p.dims().iter().zip(first.dims()).enumerate().all(|(d, (a, b))| d == dim || a == b);
            if !same {
                return Err(Error::shape(
                    OP,
                    format!("parts of shapes {} and {} differ outside dimension {dim}; only that dimension may differ", first.shape(), p.shape()),
                ));
            }
        }
        // Parts whose trailing block (dimensions `dim..`) is strided are copied once.
        let readable: Vec<Tensor> = parts.iter().map(|p| if inner_contiguous(p, dim) { Ok((*p).clone()) } else { p.contiguous() }).collect::<Result<_>>()?;
        let outer: usize = first.dims()[..dim].iter().product();
        let mut pieces = Vec::with_capacity(outer * parts.len());
        for o in 0..outer {
            for (i, p) in readable.iter().enumerate() {
                let block: usize = p.dims()[dim..].iter().product();
                let start = block_start(p, dim, o);
                pieces.push((i, start..start + block));
            }
        }
        let mut dims = first.dims().to_vec();
        dims[dim] = parts.iter().map(|p| p.dims()[dim]).sum();
        join(OP, &readable, &pieces, Shape::new(dims))
    }
}

fn check_parts(op: &'static str, parts: &[&Tensor]) -> Result<()> {
    let first = parts.first().ok_or_else(|| Error::invalid(op, "no tensors to join; pass at least one"))?;
    for p in parts {
        if p.dtype() != first.dtype() {
            return Err(Error::DType { op, expected: first.dtype().to_string(), got: p.dtype(), hint: "; convert the parts to one dtype first" });
        }
        super::check_device(op, first, p)?;
    }
    Ok(())
}

/// Whether the dimensions `dim..` of `t` are laid out row-major without gaps.
fn inner_contiguous(t: &Tensor, dim: usize) -> bool {
    let mut expected = 1;
    for (&d, &s) in t.dims()[dim..].iter().zip(&t.layout().strides()[dim..]).rev() {
        if d != 1 && s != expected {
            return false;
        }
        expected *= d;
    }
    true
}

/// Where the `o`-th block of dimensions `dim..` (in row-major order of the
/// outer dimensions) starts in `t`'s storage.
fn block_start(t: &Tensor, dim: usize, mut o: usize) -> usize {
    let (dims, strides) = (t.dims(), t.layout().strides());
    let mut at = t.layout().offset();
    for d in (0..dim).rev() {
        at += (o % dims[d]) * strides[d];
        o /= dims[d];
    }
    at
}

/// A tensor of `shape` made of the storage ranges `pieces` (a source index
/// into `sources` and a range of its storage), in order.
fn join(op: &'static str, sources: &[Tensor], pieces: &[(usize, Range<usize>)], shape: Shape) -> Result<Tensor> {
    let first = &sources[0];
    let guards: Vec<_> = sources.iter().map(|t| t.read()).collect();
    let dev = match first.device() {
        Device::Cpu(dev) => dev,
        Device::Cuda(d) => {
            let parts = pieces
                .iter()
                .map(|(i, r)| match &*guards[*i] {
                    Storage::Cuda(s) => Ok((s, r.clone())),
                    Storage::Cpu(_) => Err(Error::placement(op, "a host part among device parts; move every part to one device first")),
                })
                .collect::<Result<Vec<(&CudaStorage, Range<usize>)>>>()?;
            let storage = CudaStorage::concat(d, first.dtype(), &parts)?;
            return Ok(Tensor::from_storage(Storage::Cuda(storage), shape, first.device().clone()));
        }
    };
    let total = shape.elem_count();
    macro_rules! join {
        ($v:ident, $t:ty) => {{
            let mut out: Vec<$t> = Vec::with_capacity(total);
            for (i, range) in pieces {
                match &*guards[*i] {
                    Storage::Cpu(CpuStorage::$v(b)) => out.extend_from_slice(&b[range.clone()]),
                    Storage::Cpu(_) => unreachable!("dtypes checked"),
                    Storage::Cuda(s) => return s.unsupported(op),
                }
            }
            CpuStorage::$v(dev.buffer(out))
        }};
    }
    let storage = match first.dtype() {
        super::DType::F32 => join!(F32, f32),
        super::DType::F64 => join!(F64, f64),
        super::DType::BF16 => join!(BF16, half::bf16),
        super::DType::F16 => join!(F16, half::f16),
        super::DType::I32 => join!(I32, i32),
        super::DType::U32 => join!(U32, u32),
    };
    Ok(Tensor::from_cpu(storage, shape, dev))
}
