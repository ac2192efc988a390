//! The checks every operation makes of its operands before any kernel
//! runs, each failure a typed error that names the operation and the fix.

use super::Tensor;
use crate::error::{Error, Result};

/// Refuses a tensor whose dtype is not a float (f32, f64, bf16, f16).
pub fn check_float(op: &'static str, t: &Tensor) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(Error::DType { op, expected: "a float dtype (f32, f64, bf16, f16)".into(), got: t.dtype(), hint: "" })
    }
}

/// Refuses two tensors on different devices, naming both.
pub fn check_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device().same(b.device()) {
        Ok(())
    } else {
        Err(Error::DeviceMismatch { op, lhs: a.device().to_string(), rhs: b.device().to_string() })
    }
}

/// Refuses two tensors of different shapes; `what` names the pair in the message.
pub fn check_same_shape(op: &'static str, what: &str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.shape() == b.shape() {
        Ok(())
    } else {
        Err(Error::shape(op, format!("{what}: {} vs {}; both must have the same shape", a.shape(), b.shape())))
    }
}
