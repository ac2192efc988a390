//! The fused multi-tensor AdamW step on the device (`kernels/cuda/adamw.cu`).

use super::args::Grid;
use super::device::CudaDevice;
use super::launch::{check_arguments, config, Value};
pub(crate) use super::AdamWSlot;
use crate::error::{Error, Result};
use cudarc::driver::{DeviceRepr, PushKernelArg};

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

/// The kernel's `AdamWTensor`, field for field.
#[repr(C)]
#[derive(Clone, Copy)]
struct Entry {
    param: u64,
    grad: u64,
    m: u64,
    v: u64,
    /// The low-precision copy of the `_bf16` / `_f16` variants: none here.
    copy: u64,
    len: u64,
    hyper: Hyper,
}

// SAFETY: plain integer and f32 fields in C layout, as the kernel declares them.
unsafe impl DeviceRepr for Entry {}

/// Most tensors one launch takes: the grid's y dimension.
const MAX_TENSORS: usize = 65_535;

fn entry(slot: &AdamWSlot) -> Entry {
    let s = &slot.step;
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
    Entry { param: slot.param, grad: slot.grad, m: slot.m, v: slot.v, copy: 0, len: slot.len as u64, hyper }
}

/// One AdamW step in place on every slot's f32 tensors of `device`: one
/// launch per 65 535 tensors, whatever their sizes, instead of one per
/// tensor. The caller holds the tensors (and their guards) until the
/// launch is queued; the work runs in compute-stream order.
pub(crate) fn adamw_f32(device: &CudaDevice, slots: &[AdamWSlot]) -> Result<()> {
    let kernel = device.kernel("adamw", "adamw_f32")?;
    // The kernel's one parameter is the table's device pointer (its value
    // is known only per chunk; the check is of the kind).
    check_arguments(&kernel.params, &[Value::U64(0)]).map_err(|detail| Error::Cuda {
        ordinal: device.ordinal(),
        op: "launching the AdamW step",
        detail: format!("`adamw_f32`: {detail}"),
    })?;
    let f = &kernel.function;
    let stream = device.compute_stream();
    for chunk in slots.chunks(MAX_TENSORS) {
        let longest = chunk.iter().map(|s| s.len).max().unwrap_or(0);
        // Blocks for the longest tensor; a shorter one's extra blocks find
        // no element and return at once.
        let Some(mut cfg) = config(Grid::Items(longest)) else { continue };
        cfg.grid_dim.1 = chunk.len() as u32; // at most MAX_TENSORS
        let table: Vec<Entry> = chunk.iter().map(entry).collect();
        let table = stream.clone_htod(&table).map_err(|e| device.error("copying the AdamW tensor table to the device", e))?;
        device.counters().upload();
        let mut builder = stream.launch_builder(f);
        builder.arg(&table);
        // SAFETY: the argument is the kernel's `const AdamWTensor*`; every
        // entry's pointers address `len` live f32 elements on this device,
        // held by the caller's guards; the table is freed in stream order
        // after the kernel has read it.
        unsafe { builder.launch(cfg) }.map_err(|e| Error::Cuda {
            ordinal: device.ordinal(),
            op: "launching the AdamW step",
            detail: super::device::describe(&e),
        })?;
    }
    Ok(())
}
