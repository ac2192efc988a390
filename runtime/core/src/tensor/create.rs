//! Creating tensors: zeros, host data, constants and counter-based random draws.

use super::{DType, Element, Shape, Tensor};
use crate::backend::{CpuDevice, CpuStorage, Device, Storage};
use crate::error::{Error, Result};
use tessera_kernels::rng::{fill_normal, fill_uniform, RngKey};

/// A random distribution to initialise a tensor from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with the given mean and standard deviation.
    Normal {
        /// The mean.
        mean: f64,
        /// The standard deviation.
        std: f64,
    },
    /// Uniform in `[lo, hi)`.
    Uniform {
        /// The lower bound (included).
        lo: f64,
        /// The upper bound (excluded).
        hi: f64,
    },
}

impl Tensor {
    /// A tensor of zeros.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        let storage = device.zeros_storage(dtype, shape.elem_count())?;
        Ok(Tensor::from_storage(storage, shape, device.clone()))
    }

    /// A tensor of zeros with the shape, dtype and device of `self`.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.shape().clone(), self.dtype(), self.device())
    }

    /// A tensor holding `data` (row-major), whose length must match `shape`.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        if data.len() != shape.elem_count() {
            return Err(Error::shape("from_vec", format!("{} elements given for shape {} which holds {}", data.len(), shape, shape.elem_count())));
        }
        match device {
            Device::Cpu(dev) => Ok(Tensor::from_cpu(CpuStorage::from_buffer(dev.buffer(data)), shape, dev)),
            Device::Cuda(d) => {
                let storage = d.upload(T::DTYPE, data.len(), bytemuck::cast_slice(&data))?;
                Ok(Tensor::from_storage(Storage::Cuda(storage), shape, device.clone()))
            }
        }
    }

    /// A tensor holding a copy of `data`. On a CPU device the copy is one
    /// the device allocates, so a large one lives in the device's arena if
    /// it has one (see [`CpuDevice::use_arena`]); [`from_vec`](Self::from_vec)
    /// keeps the vector's own allocation instead.
    pub fn from_slice<T: Element>(data: &[T], shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        match device {
            Device::Cpu(dev) if data.len() == shape.elem_count() => {
                let mut b = dev.buffer_for_overwrite::<T>(data.len());
                b.copy_from_slice(data);
                Ok(Tensor::from_cpu(CpuStorage::from_buffer(b), shape, dev))
            }
            _ => Self::from_vec(data.to_vec(), shape, device),
        }
    }

    /// A tensor whose every element is `value` (converted to `dtype`).
    pub fn full(value: f64, shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        let t = Tensor::from_vec(vec![value; shape.elem_count()], shape, device)?;
        if dtype == DType::F64 {
            Ok(t)
        } else {
            t.to_dtype(dtype)
        }
    }

    /// A tensor drawn from `init` with the counter-based generator `key`.
    ///
    /// Element `i` (row-major) depends only on `(key, i)`: the same key always
    /// gives the same tensor, on any device and with any number of threads.
    pub fn rand(init: Init, key: RngKey, shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        let starts = vec![0; shape.rank()];
        Self::rand_slice(init, key, &shape, &starts, shape.clone(), dtype, device)
    }

    /// The block of a random global tensor that starts at `starts` and has
    /// shape `local`: exactly the elements `rand(init, key, global, ..)` holds
    /// there. This is how each rank initialises its shard of a parameter
    /// without drawing (or communicating) the whole.
    pub fn rand_slice(init: Init, key: RngKey, global: &Shape, starts: &[usize], local: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        let local = local.into();
        check_block(global, starts, &local)?;
        if !dtype.is_float() {
            return Err(Error::DType { op: "rand", expected: "a float dtype".into(), got: dtype, hint: "" });
        }
        let dev = match device {
            Device::Cpu(dev) => dev,
            // Drawn on the host and uploaded: initialisation happens once,
            // and the values are then exactly the CPU's, element for element.
            Device::Cuda(_) => return Self::rand_slice(init, key, global, starts, local, dtype, &Device::cpu())?.to_device(device),
        };
        let storage = if dtype == DType::F64 {
            CpuStorage::F64(draw_block::<f64>(dev, init, key, global, starts, &local))
        } else {
            let f = CpuStorage::F32(draw_block::<f32>(dev, init, key, global, starts, &local));
            if dtype == DType::F32 {
                f
            } else {
                crate::backend::cpu::convert(dev, &f, 0..local.elem_count(), dtype)
            }
        };
        Ok(Tensor::from_storage(Storage::Cpu(storage), local, device.clone()))
    }
}

fn check_block(global: &Shape, starts: &[usize], local: &Shape) -> Result<()> {
    if starts.len() != global.rank() || local.rank() != global.rank() {
        return Err(Error::shape(
            "rand_slice",
            format!("global shape {global}, starts {starts:?} and local shape {local} must have the same number of dimensions"),
        ));
    }
    for (d, ((&g, &s), &l)) in global.dims().iter().zip(starts).zip(local.dims()).enumerate() {
        if s + l > g {
            return Err(Error::shape("rand_slice", format!("dimension {d}: block {s}..{} exceeds the global size {g}", s + l)));
        }
    }
    Ok(())
}

fn draw_block<T: tessera_kernels::Real + bytemuck::Pod>(
    dev: &CpuDevice,
    init: Init,
    key: RngKey,
    global: &Shape,
    starts: &[usize],
    local: &Shape,
) -> crate::backend::cpu::Buffer<T> {
    let mut out = dev.buffer_zeros::<T>(local.elem_count());
    let fill = |start: u64, run: &mut [T]| match init {
        Init::Normal { mean, std } => fill_normal(key, start, T::lit(mean), T::lit(std), run),
        Init::Uniform { lo, hi } => fill_uniform(key, start, T::lit(lo), T::lit(hi), run),
    };
    if local == global || local.elem_count() == 0 {
        fill(0, &mut out);
        return out;
    }
    // Each run along the last dimension is contiguous in the global tensor too.
    let rank = global.rank();
    let inner = local.dims()[rank - 1];
    let gstrides = global.contiguous_strides();
    for (row, run) in out.chunks_mut(inner).enumerate() {
        let mut rem = row;
        let mut at = starts[rank - 1];
        for d in (0..rank - 1).rev() {
            let l = local.dims()[d];
            at += (starts[d] + rem % l) * gstrides[d];
            rem /= l;
        }
        fill(at as u64, run);
    }
    out
}
