use crate::error::{Error, Result};
use std::fmt;

/// The dimensions of a tensor, outermost first. A shape of no dimensions is a scalar.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    /// A shape from its dimensions.
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements (1 for a scalar).
    pub fn elem_count(&self) -> usize {
        self.0.iter().product()
    }

    /// The size of dimension `dim`.
    pub fn dim(&self, op: &'static str, dim: usize) -> Result<usize> {
        self.0.get(dim).copied().ok_or_else(|| Error::shape(op, format!("dimension {dim} does not exist in a tensor of shape {self}")))
    }

    /// The last dimension (the "row" of row-wise ops); an error for scalars.
    pub fn last_dim(&self, op: &'static str) -> Result<usize> {
        self.0.last().copied().ok_or_else(|| Error::shape(op, "needs a tensor of at least one dimension, got a scalar".to_string()))
    }

    /// Row-major strides of a contiguous tensor of this shape.
    pub fn contiguous_strides(&self) -> Vec<usize> {
        let mut strides = vec![0; self.0.len()];
        let mut acc = 1;
        for (s, d) in strides.iter_mut().zip(&self.0).rev() {
            *s = acc;
            acc *= d;
        }
        strides
    }

    /// This shape with the last dimension replaced by `n`.
    pub fn with_last(&self, n: usize) -> Shape {
        let mut d = self.0.clone();
        if let Some(last) = d.last_mut() {
            *last = n;
        }
        Shape(d)
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}
impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}
impl From<&Shape> for Shape {
    fn from(s: &Shape) -> Self {
        s.clone()
    }
}
impl From<()> for Shape {
    fn from(_: ()) -> Self {
        Shape(vec![])
    }
}
impl From<usize> for Shape {
    fn from(n: usize) -> Self {
        Shape(vec![n])
    }
}
impl From<(usize, usize)> for Shape {
    fn from((a, b): (usize, usize)) -> Self {
        Shape(vec![a, b])
    }
}
impl From<(usize, usize, usize)> for Shape {
    fn from((a, b, c): (usize, usize, usize)) -> Self {
        Shape(vec![a, b, c])
    }
}
impl From<(usize, usize, usize, usize)> for Shape {
    fn from((a, b, c, d): (usize, usize, usize, usize)) -> Self {
        Shape(vec![a, b, c, d])
    }
}
