//! Views share storage and change only the layout; `contiguous` gathers.

use super::{Layout, Shape, Tensor};
use crate::backend::{CpuStorage, Device, Storage};
use crate::error::{Error, Result};
use tessera_kernels::cpu::copy::copy_strided;

impl Tensor {
    /// The same elements with another shape of equal element count. A view when
    /// the tensor is contiguous, a gathered copy otherwise.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.elem_count() != self.elem_count() {
            return Err(Error::shape(
                "reshape",
                format!("cannot reshape {} ({} elements) into {} ({} elements)", self.shape(), self.elem_count(), shape, shape.elem_count()),
            ));
        }
        let t = self.contiguous()?;
        let offset = t.layout.offset();
        Ok(t.with_layout(Layout::contiguous_at(shape, offset)))
    }

    /// A view with dimensions `d0` and `d1` swapped.
    pub fn transpose(&self, d0: usize, d1: usize) -> Result<Tensor> {
        let rank = self.rank();
        if d0 >= rank || d1 >= rank {
            return Err(Error::shape("transpose", format!("dimensions {d0} and {d1} do not both exist in shape {}", self.shape())));
        }
        let mut dims = self.dims().to_vec();
        let mut strides = self.layout.strides().to_vec();
        dims.swap(d0, d1);
        strides.swap(d0, d1);
        Ok(self.with_layout(Layout::new(Shape::new(dims), strides, self.layout.offset())))
    }

    /// The transpose of the last two dimensions (a view).
    pub fn t(&self) -> Result<Tensor> {
        let r = self.rank();
        if r < 2 {
            return Err(Error::shape("t", format!("needs at least two dimensions, got shape {}", self.shape())));
        }
        self.transpose(r - 2, r - 1)
    }

    /// A view of `len` entries of dimension `dim` starting at `start`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        let size = self.shape().dim("narrow", dim)?;
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::shape("narrow", format!("range {start}..{} is outside dimension {dim} of size {size} (shape {})", start + len, self.shape())));
        }
        let mut dims = self.dims().to_vec();
        dims[dim] = len;
        let offset = self.layout.offset() + start * self.layout.strides()[dim];
        Ok(self.with_layout(Layout::new(Shape::new(dims), self.layout.strides().to_vec(), offset)))
    }

    /// This tensor if already contiguous, else a row-major copy.
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        let guard = self.read();
        let out = match (&*guard, &self.device) {
            (Storage::Cpu(s), Device::Cpu(dev)) => {
                let n = self.elem_count();
                let l = &self.layout;
                macro_rules! gather {
                    ($v:ident, $src:expr) => {{
                        let mut dst = dev.buffer_zeros(n);
                        copy_strided($src, l.shape().dims(), l.strides(), l.offset(), &mut dst);
                        CpuStorage::$v(dst)
                    }};
                }
                match s {
                    CpuStorage::F32(b) => gather!(F32, b),
                    CpuStorage::F64(b) => gather!(F64, b),
                    CpuStorage::BF16(b) => gather!(BF16, b),
                    CpuStorage::F16(b) => gather!(F16, b),
                    CpuStorage::I32(b) => gather!(I32, b),
                    CpuStorage::U32(b) => gather!(U32, b),
                }
            }
            (Storage::Cuda(s), Device::Cuda(_)) => {
                let out = s.gather(&self.layout)?;
                return Ok(Tensor::from_storage(Storage::Cuda(out), self.shape().clone(), self.device.clone()));
            }
            _ => unreachable!("a tensor's storage lives on its device"),
        };
        Ok(Tensor::from_storage(Storage::Cpu(out), self.shape().clone(), self.device.clone()))
    }
}
