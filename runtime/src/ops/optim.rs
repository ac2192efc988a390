//! The fused AdamW update.

use super::{check_device, check_same_shape};
use crate::backend::Storage;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
pub use tessera_kernels::cpu::adamw::AdamWStep;
use tessera_kernels::cpu::adamw::adamw_update as fused;
use tessera_kernels::Real;

/// One AdamW step in place on `param` and its moments `m` and `v`.
///
/// `param`, `m` and `v` are the full-precision master copies (`f32`, or `f64`
/// in tests): contiguous, of one dtype and shape, and distinct tensors. `grad`
/// may be any float dtype; it is read in the parameter's precision.
pub fn adamw_update(step: &AdamWStep, param: &Tensor, grad: &Tensor, m: &Tensor, v: &Tensor) -> Result<()> {
    const OP: &str = "adamw_update";
    for (name, t) in [("gradient", grad), ("first moment", m), ("second moment", v)] {
        check_same_shape(OP, &format!("parameter and {name}"), param, t)?;
        check_device(OP, param, t)?;
    }
    if !matches!(param.dtype(), DType::F32 | DType::F64) || m.dtype() != param.dtype() || v.dtype() != param.dtype() {
        return Err(Error::DType { op: OP, expected: "f32 (or f64) master weights and moments of one dtype".into(), got: param.dtype(), hint: "; keep master weights and optimizer state in f32" });
    }
    let named = [("param", param), ("m", m), ("v", v)];
    for (i, (a, ta)) in named.iter().enumerate() {
        for (b, tb) in &named[i + 1..] {
            if ta.shares_storage(tb) {
                return Err(Error::Aliased { op: OP, a, b });
            }
        }
        if ta.layout().contiguous_range().is_none() {
            return Err(Error::invalid(OP, format!("`{a}` must be contiguous")));
        }
    }
    if !(step.lr.is_finite() && step.lr >= 0.0 && step.step >= 1 && (0.0..1.0).contains(&step.beta1) && (0.0..1.0).contains(&step.beta2) && step.eps > 0.0) {
        return Err(Error::invalid(OP, format!("hyper-parameters out of range: {step:?}; need lr >= 0, 0 <= betas < 1, eps > 0, step >= 1")));
    }
    let grad = if grad.dtype() == param.dtype() && !grad.shares_storage(param) && !grad.shares_storage(m) && !grad.shares_storage(v) {
        grad.contiguous()?
    } else {
        grad.to_dtype(param.dtype())?
    };
    let gr = grad.layout().contiguous_range().expect("contiguous");
    let (pr, mr, vr) = (param.layout().contiguous_range().unwrap(), m.layout().contiguous_range().unwrap(), v.layout().contiguous_range().unwrap());
    let gg = grad.read();
    let (mut pg, mut mg, mut vg) = (param.write(), m.write(), v.write());
    match (&mut *pg, &mut *mg, &mut *vg, &*gg) {
        (Storage::Cpu(p), Storage::Cpu(ms), Storage::Cpu(vs), Storage::Cpu(g)) => {
            fn go<T: Real + crate::tensor::Element>(s: &AdamWStep, p: &mut crate::backend::CpuStorage, g: &crate::backend::CpuStorage, m: &mut crate::backend::CpuStorage, v: &mut crate::backend::CpuStorage, r: [std::ops::Range<usize>; 4]) {
                let [pr, gr, mr, vr] = r;
                fused(s, &mut p.as_mut_slice::<T>().unwrap()[pr], &g.as_slice::<T>().unwrap()[gr], &mut m.as_mut_slice::<T>().unwrap()[mr], &mut v.as_mut_slice::<T>().unwrap()[vr]);
            }
            let ranges = [pr, gr, mr, vr];
            if param.dtype() == DType::F64 {
                go::<f64>(step, p, g, ms, vs, ranges)
            } else {
                go::<f32>(step, p, g, ms, vs, ranges)
            }
        }
        (Storage::Cuda(p), Storage::Cuda(ms), Storage::Cuda(vs), Storage::Cuda(g)) => {
            if param.dtype() != DType::F32 {
                return Err(Error::NotImplementedOnCuda { op: "adamw_update on f64 master weights" });
            }
            let len = pr.len();
            crate::backend::cuda::adamw::adamw_f32(step, (p, pr.start), (g, gr.start), (ms, mr.start), (vs, vr.start), len)?
        }
        _ => unreachable!("the operands' devices were checked to be the same"),
    }
    Ok(())
}
