//! The fused AdamW update, one tensor at a time or many in one launch.

use crate::backend::cuda::adamw::{adamw_f32, AdamWSlot};
use crate::backend::{CpuStorage, Device, Storage};
use crate::error::{Error, Result};
use crate::tensor::{check_device, check_same_shape};
use crate::tensor::{DType, Element, Tensor};
use std::collections::HashMap;
use tessera_kernels::cpu::adamw::adamw_update as fused;
pub use tessera_kernels::desc::AdamWStep;
use tessera_kernels::Real;

const OP: &str = "adamw_update";

/// One tensor's part of [`adamw_update_many`]: its step (hyper-parameters
/// and update count), its parameter, gradient and moments, with the rules
/// of [`adamw_update`].
#[derive(Clone, Copy, Debug)]
pub struct AdamWTarget<'a> {
    /// Hyper-parameters and the update count of this tensor.
    pub step: AdamWStep,
    /// The f32 (or f64) master weights, updated in place.
    pub param: &'a Tensor,
    /// The gradient, of any float dtype.
    pub grad: &'a Tensor,
    /// The first moment, updated in place.
    pub m: &'a Tensor,
    /// The second moment, updated in place.
    pub v: &'a Tensor,
}

/// One AdamW step in place on `param` and its moments `m` and `v`.
///
/// `param`, `m` and `v` are the full-precision master copies (`f32`, or `f64`
/// in tests): contiguous, of one dtype and shape, and distinct tensors. `grad`
/// may be any float dtype; it is read in the parameter's precision.
pub fn adamw_update(step: &AdamWStep, param: &Tensor, grad: &Tensor, m: &Tensor, v: &Tensor) -> Result<()> {
    adamw_update_many(&[AdamWTarget { step: *step, param, grad, m, v }])
}

/// AdamW steps on many tensors, each as [`adamw_update`] would make it.
///
/// On the CPU the tensors are updated one after another. On a CUDA device
/// every tensor of that device is updated by one fused kernel launch (the
/// launch overhead of a model's hundreds of parameters, paid once). The
/// tensors written (parameters and moments) must be distinct from every
/// other tensor of the call.
pub fn adamw_update_many(targets: &[AdamWTarget<'_>]) -> Result<()> {
    let grads: Vec<Tensor> = targets.iter().map(check).collect::<Result<_>>()?;
    check_no_overlap(targets, &grads)?;
    let mut on_cuda: Vec<usize> = Vec::new();
    for (i, (t, grad)) in targets.iter().zip(&grads).enumerate() {
        match t.param.device() {
            Device::Cpu(_) => update_on_cpu(t, grad),
            Device::Cuda(_) => on_cuda.push(i),
        }
    }
    // One launch per device, over that device's tensors.
    while let Some(&first) = on_cuda.first() {
        let Device::Cuda(device) = targets[first].param.device() else { unreachable!("only CUDA targets are queued") };
        let (mine, rest): (Vec<usize>, Vec<usize>) = on_cuda.iter().partition(|&&i| matches!(targets[i].param.device(), Device::Cuda(d) if d.same(device)));
        on_cuda = rest;
        let reads: Vec<_> = mine.iter().map(|&i| grads[i].read()).collect();
        let writes: Vec<_> = mine.iter().map(|&i| [targets[i].param.write(), targets[i].m.write(), targets[i].v.write()]).collect();
        let mut slots = Vec::with_capacity(mine.len());
        for ((&i, g), [p, m, v]) in mine.iter().zip(&reads).zip(&writes) {
            let t = &targets[i];
            let at = |s: &Storage, tensor: &Tensor| match s {
                Storage::Cuda(s) => Ok(s.device_ptr_at(tensor.layout().offset())),
                Storage::Cpu(_) => {
                    Err(Error::placement(OP, "a host tensor among the device operands of one update; keep each parameter's gradient and moments on its device"))
                }
            };
            if t.param.dtype() != DType::F32 {
                return Err(Error::NotImplementedOnCuda { op: "adamw_update on f64 master weights" });
            }
            slots.push(AdamWSlot { step: t.step, param: at(p, t.param)?, grad: at(g, &grads[i])?, m: at(m, t.m)?, v: at(v, t.v)?, len: t.param.elem_count() });
        }
        adamw_f32(device, &slots)?;
    }
    Ok(())
}

/// Checks one target and returns its gradient as a contiguous tensor of the
/// parameter's dtype that shares no storage with what is written.
fn check(t: &AdamWTarget<'_>) -> Result<Tensor> {
    let AdamWTarget { step, param, grad, m, v } = *t;
    for (name, x) in [("gradient", grad), ("first moment", m), ("second moment", v)] {
        check_same_shape(OP, &format!("parameter and {name}"), param, x)?;
        check_device(OP, param, x)?;
    }
    if !matches!(param.dtype(), DType::F32 | DType::F64) || m.dtype() != param.dtype() || v.dtype() != param.dtype() {
        return Err(Error::DType {
            op: OP,
            expected: "f32 (or f64) master weights and moments of one dtype".into(),
            got: param.dtype(),
            hint: "; keep master weights and optimizer state in f32",
        });
    }
    let named = [("param", param), ("m", m), ("v", v)];
    for (i, (a, ta)) in named.iter().enumerate() {
        for (b, tb) in &named[i + 1..] {
            if ta.shares_storage(tb) {
                return Err(Error::Aliased { op: OP, a, b });
            }
        }
        if ta.layout().contiguous_range().is_none() {
            return Err(Error::placement(OP, format!("`{a}` must be contiguous")));
        }
    }
    if !(step.lr.is_finite() && step.lr >= 0.0 && step.step >= 1 && (0.0..1.0).contains(&step.beta1) && (0.0..1.0).contains(&step.beta2) && step.eps > 0.0) {
        return Err(Error::invalid(OP, format!("hyper-parameters out of range: {step:?}; need lr >= 0, 0 <= betas < 1, eps > 0, step >= 1")));
    }
    if grad.dtype() == param.dtype() && !grad.shares_storage(param) && !grad.shares_storage(m) && !grad.shares_storage(v) {
        grad.contiguous()
    } else {
        grad.to_dtype(param.dtype())
    }
}

/// Refuses a call where a tensor one target writes is also read or written
/// by another: the updates would race, and the locks would deadlock.
fn check_no_overlap(targets: &[AdamWTarget<'_>], grads: &[Tensor]) -> Result<()> {
    // Each storage: the first update that touches it, and whether any update writes it.
    let mut seen: HashMap<usize, (usize, bool)> = HashMap::new();
    for (j, (t, grad)) in targets.iter().zip(grads).enumerate() {
        for (x, writes) in [(t.param, true), (t.m, true), (t.v, true), (grad, false)] {
            let entry = seen.entry(x.storage_key()).or_insert((j, writes));
            let (i, written) = *entry;
            if i != j && (written || writes) {
                return Err(Error::invalid(
                    OP,
                    format!("updates {i} and {j} share a tensor that one of them writes; give every parameter its own tensors (update a tied parameter once)"),
                ));
            }
            entry.1 |= writes;
        }
    }
    Ok(())
}

/// The update of one target on the CPU.
fn update_on_cpu(t: &AdamWTarget<'_>, grad: &Tensor) {
    let ranges = [t.param, grad, t.m, t.v].map(|x| x.layout().contiguous_range().expect("checked contiguous"));
    let gg = grad.read();
    let (mut pg, mut mg, mut vg) = (t.param.write(), t.m.write(), t.v.write());
    let (Storage::Cpu(p), Storage::Cpu(m), Storage::Cpu(v), Storage::Cpu(g)) = (&mut *pg, &mut *mg, &mut *vg, &*gg) else {
        unreachable!("the operands' devices were checked to be the same")
    };
    fn go<T: Real + Element>(s: &AdamWStep, p: &mut CpuStorage, g: &CpuStorage, m: &mut CpuStorage, v: &mut CpuStorage, r: [std::ops::Range<usize>; 4]) {
        let [pr, gr, mr, vr] = r;
        fused(
            s,
            &mut p.as_mut_slice::<T>().unwrap()[pr],
            &g.as_slice::<T>().unwrap()[gr],
            &mut m.as_mut_slice::<T>().unwrap()[mr],
            &mut v.as_mut_slice::<T>().unwrap()[vr],
        );
    }
    if t.param.dtype() == DType::F64 {
        go::<f64>(&t.step, p, g, m, v, ranges)
    } else {
        go::<f32>(&t.step, p, g, m, v, ranges)
    }
}
