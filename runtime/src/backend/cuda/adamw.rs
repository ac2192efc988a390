//! The fused AdamW step on the device (`kernels/cuda/adamw.cu`).

use super::launch::config;
use super::args::Grid;
use super::storage::CudaStorage;
use crate::error::{Error, Result};
use cudarc::driver::{DeviceRepr, PushKernelArg};
use tessera_kernels::cpu::adamw::AdamWStep;

/// The kernel's `AdamWHyper`, field for field.
#[repr(C)]
#[derive(Clone, Copy)]
struct Hyper {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    grad_scale: f32,
    bias_correction1: f32,
    bias_correction2: f32,
}

// SAFETY: plain f32 fields in C layout, as the kernel declares them.
unsafe impl DeviceRepr for Hyper {}

/// One AdamW step in place on `len` f32 elements of the parameter, its
/// moments and its (f32) gradient, each starting at the given element.
pub(crate) fn adamw_f32(s: &AdamWStep, param: (&CudaStorage, usize), grad: (&CudaStorage, usize), m: (&CudaStorage, usize), v: (&CudaStorage, usize), len: usize) -> Result<()> {
    let device = param.0.device();
    let Some(mut cfg) = config(Grid::Items(len)) else { return Ok(()) };
    cfg.grid_dim.1 = 1; // one tensor
    // Bias corrections in f64 on the host, as the CPU kernel computes them.
    let hyper = Hyper {
        lr: s.lr as f32,
        beta1: s.beta1 as f32,
        beta2: s.beta2 as f32,
        eps: s.eps as f32,
        weight_decay: s.weight_decay as f32,
        grad_scale: s.grad_scale as f32,
        bias_correction1: (1.0 - s.beta1.powf(s.step as f64)) as f32,
        bias_correction2: (1.0 - s.beta2.powf(s.step as f64)) as f32,
    };
    // The kernel's AdamWTensor: param, grad, m, v, the low-precision copy (none), len.
    let at = |(st, i): (&CudaStorage, usize)| st.device_ptr_at(i);
    let tensor = [at(param), at(grad), at(m), at(v), 0, len as u64];
    let stream = device.compute_stream();
    let table = stream.clone_htod(&tensor).map_err(|e| device.error("copying the AdamW tensor table to the device", e))?;
    let f = device.function("adamw", "adamw_f32")?;
    let mut builder = stream.launch_builder(&f);
    builder.arg(&table).arg(&hyper);
    // SAFETY: the arguments are the kernel's (const AdamWTensor*, AdamWHyper);
    // the table's pointers address `len` live f32 elements each, held by the
    // caller's write guards; the table is freed in stream order after the kernel.
    unsafe { builder.launch(cfg) }.map_err(|e| Error::Cuda { ordinal: device.ordinal(), op: "launching the AdamW step", detail: super::device::describe(&e) })?;
    Ok(())
}
