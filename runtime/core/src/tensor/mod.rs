//! Tensors: a shared storage on a device, a dtype, and a layout that views it.

mod check;
mod concat;
mod create;
mod dtype;
mod layout;
mod shape;
mod view;

pub use crate::with_elem;
pub use check::{check_device, check_float, check_same_shape};
pub use create::Init;
pub use dtype::{DType, Element};
pub use layout::Layout;
pub use shape::Shape;

use crate::backend::{CpuDevice, CpuStorage, Device, Storage};
use crate::error::{Error, Result};
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::fmt;
use std::sync::Arc;

/// An n-dimensional array of one dtype on one device.
///
/// Cloning a tensor is cheap and shares its storage; views (reshape,
/// transpose, narrow) share it too. Operations return new tensors; the few
/// in-place updates (optimizer steps, gradient accumulation) say so in their
/// names and refuse operands that alias each other.
#[derive(Clone)]
pub struct Tensor {
    storage: Arc<RwLock<Storage>>,
    layout: Layout,
    dtype: DType,
    device: Device,
}

impl Tensor {
    /// A contiguous tensor of `shape` over `storage`, which lives on `device`.
    pub fn from_storage(storage: Storage, shape: Shape, device: Device) -> Tensor {
        let dtype = match &storage {
            Storage::Cpu(s) => s.dtype(),
            Storage::Cuda(s) => s.dtype(),
        };
        Tensor { storage: Arc::new(RwLock::new(storage)), layout: Layout::contiguous(shape), dtype, device }
    }

    /// A contiguous tensor of `shape` over `storage`, which lives on `dev`.
    pub fn from_cpu(storage: CpuStorage, shape: impl Into<Shape>, dev: &CpuDevice) -> Tensor {
        Self::from_storage(Storage::Cpu(storage), shape.into(), Device::Cpu(dev.clone()))
    }

    pub(crate) fn with_layout(&self, layout: Layout) -> Tensor {
        Tensor { storage: self.storage.clone(), layout, dtype: self.dtype, device: self.device.clone() }
    }

    /// The dimensions.
    pub fn shape(&self) -> &Shape {
        self.layout.shape()
    }

    /// The dimensions as a slice.
    pub fn dims(&self) -> &[usize] {
        self.layout.shape().dims()
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape().rank()
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.shape().elem_count()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device holding the elements.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Shape, strides and offset into the storage.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Whether the elements are stored row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// Whether two tensors share one storage (one is a view of the other, or both of a third).
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    /// A key equal for two tensors exactly when they share one storage
    /// ([`shares_storage`](Self::shares_storage)), for finding shared
    /// storage among many tensors in one pass.
    pub(crate) fn storage_key(&self) -> usize {
        Arc::as_ptr(&self.storage) as *const () as usize
    }

    /// The storage, locked for reading.
    pub fn read(&self) -> RwLockReadGuard<'_, Storage> {
        self.storage.read()
    }

    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, Storage> {
        self.storage.write()
    }

    /// A copy of this tensor on `device` (same dtype, shape and values,
    /// contiguous), through host memory. Waits for queued work on the source.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        with_elem!(self.dtype, T => Tensor::from_vec(self.to_vec::<T>()?, self.shape().clone(), device))
    }

    /// The elements as a host vector of `T`, which must be this tensor's
    /// element type. Waits for queued work on the device.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::DType {
                op: "to_vec",
                expected: T::DTYPE.to_string(),
                got: self.dtype,
                hint: "; read it as its own dtype, or convert first with `to_dtype`",
            });
        }
        let t = self.contiguous()?;
        let range = t.layout.contiguous_range().expect("contiguous");
        let guard = t.read();
        match &*guard {
            Storage::Cpu(s) => Ok(s.as_slice::<T>().expect("dtype checked")[range].to_vec()),
            Storage::Cuda(s) => {
                let bytes = s.to_host_bytes()?;
                let size = std::mem::size_of::<T>();
                let mut out = vec![T::zeroed(); range.len()];
                bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(&bytes[range.start * size..range.end * size]);
                Ok(out)
            }
        }
    }

    /// The elements converted to `f64`, whatever the dtype (exact for every dtype but none wider).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        self.to_dtype(DType::F64)?.to_vec::<f64>()
    }

    /// The elements converted to `f32`.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        self.to_dtype(DType::F32)?.to_vec::<f32>()
    }

    /// The value of a one-element tensor, as `f64`.
    pub fn to_scalar(&self) -> Result<f64> {
        if self.elem_count() != 1 {
            return Err(Error::shape("to_scalar", format!("needs exactly one element, the tensor has shape {}", self.shape())));
        }
        Ok(self.to_f64_vec()?[0])
    }

    /// A copy converted to `dtype` (a new tensor even when the dtype is unchanged).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let t = self.contiguous()?;
        let range = t.layout.contiguous_range().expect("contiguous");
        let guard = t.read();
        let out = match (&*guard, &self.device) {
            (Storage::Cpu(s), Device::Cpu(dev)) => Storage::Cpu(crate::backend::cpu::convert(dev, s, range, dtype)),
            (Storage::Cuda(s), Device::Cuda(_)) => Storage::Cuda(s.to_dtype(range, dtype)?),
            _ => unreachable!("a tensor's storage lives on its device"),
        };
        Ok(Tensor::from_storage(out, self.shape().clone(), self.device.clone()))
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({}, {}, {})", self.shape(), self.dtype, self.device)
    }
}
