use super::Shape;

/// How a tensor's logical elements map onto its storage: shape, strides (in
/// elements) and the offset of the first element. Views (reshape, transpose,
/// narrow) change the layout and share the storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Shape,
    strides: Vec<usize>,
    offset: usize,
}

impl Layout {
    /// The layout of a contiguous, row-major tensor starting at `offset`.
    pub fn contiguous_at(shape: Shape, offset: usize) -> Self {
        let strides = shape.contiguous_strides();
        Layout { shape, strides, offset }
    }

    /// The layout of a contiguous, row-major tensor.
    pub fn contiguous(shape: Shape) -> Self {
        Self::contiguous_at(shape, 0)
    }

    pub(crate) fn new(shape: Shape, strides: Vec<usize>, offset: usize) -> Self {
        Layout { shape, strides, offset }
    }

    /// The dimensions.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The stride of each dimension, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The position of the first element in the storage.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Whether the elements are stored row-major without gaps (dimensions of
    /// size 1 may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&d, &s) in self.shape.dims().iter().zip(&self.strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected *= d;
        }
        true
    }

    /// The storage range `[offset, offset + elem_count)` when contiguous.
    pub fn contiguous_range(&self) -> Option<std::ops::Range<usize>> {
        self.is_contiguous().then(|| self.offset..self.offset + self.shape.elem_count())
    }
}
