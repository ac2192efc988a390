//! Joining tensors end to end (gradient buckets, packed transfers).

use super::{Shape, Tensor};
use crate::backend::{CpuStorage, CudaStorage, Device, Storage};
use crate::error::{Error, Result};

impl Tensor {
    /// The elements of every part, in order, as one 1-D tensor. All parts
    /// must share dtype and device; views are read in their logical order.
    pub fn concat_flat(parts: &[&Tensor]) -> Result<Tensor> {
        const OP: &str = "concat_flat";
        let first = parts.first().ok_or_else(|| Error::invalid(OP, "no tensors to join; pass at least one"))?;
        for p in parts {
            if p.dtype() != first.dtype() {
                return Err(Error::DType { op: OP, expected: first.dtype().to_string(), got: p.dtype(), hint: "; convert the parts to one dtype first" });
            }
            super::check_device(OP, first, p)?;
        }
        let total: usize = parts.iter().map(|p| p.elem_count()).sum();
        let contiguous: Vec<Tensor> = parts.iter().map(|p| p.contiguous()).collect::<Result<_>>()?;
        let guards: Vec<_> = contiguous.iter().map(|t| t.read()).collect();
        let dev = match first.device() {
            Device::Cpu(dev) => dev,
            Device::Cuda(d) => {
                let parts = guards
                    .iter()
                    .zip(&contiguous)
                    .map(|(g, t)| match &**g {
                        Storage::Cuda(s) => Ok((s, t.layout().contiguous_range().expect("contiguous"))),
                        Storage::Cpu(_) => Err(Error::placement(OP, "a host part among device parts; move every part to one device first")),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let storage = CudaStorage::concat(d, first.dtype(), &parts)?;
                return Ok(Tensor::from_storage(Storage::Cuda(storage), Shape::new(vec![total]), first.device().clone()));
            }
        };
        macro_rules! join {
            ($v:ident, $t:ty) => {{
                let mut out: Vec<$t> = Vec::with_capacity(total);
                for (g, t) in guards.iter().zip(&contiguous) {
                    let range = t.layout().contiguous_range().expect("contiguous");
                    match &**g {
                        Storage::Cpu(CpuStorage::$v(b)) => out.extend_from_slice(&b[range]),
                        Storage::Cpu(_) => unreachable!("dtypes checked"),
                        Storage::Cuda(s) => return s.unsupported(OP),
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
        Ok(Tensor::from_cpu(storage, Shape::new(vec![total]), dev))
    }
}
