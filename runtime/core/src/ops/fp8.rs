//! FP8 operands for training: E4M3 for the forward's activations and
//! weights, E5M2 for the gradients, each tensor scaled into its format's
//! range by delayed scaling ([`DelayedScaling`]).
//!
//! A product of FP8 operands is computed as tensor cores compute it: each
//! operand is replaced by its codes' values ([`fp8_values`]: `decode(encode(x
//! · s))`, unscaled, exact in any float dtype), the values are multiplied
//! with sums in f32, and the product is multiplied by `1 / (s_a · s_b)`.
//! On the CPU that is the emulation the tests hold the CUDA kernels to; the
//! formats and their rounding are [`tessera_kernels::cpu::fp8`]'s.

use super::{float_kernel, run1};
use crate::backend::cuda::args::{Arg, Grid};
use crate::backend::kernel::Out;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use std::collections::VecDeque;
use tessera_kernels::cpu::fp8 as k;
pub use tessera_kernels::cpu::fp8::Fp8Format;

float_kernel!(writes_all Fp8Values { format: Fp8Format, scale: f32 } |s, i, o| k::values(s.format, i[0], s.scale, o[0]); cuda |s, c| {
    let n = c.output_len(0);
    c.at_least(Arg::Input(0), n)?;
    let kernel = match s.format {
        Fp8Format::E4M3 => "fp8_values_e4m3",
        Fp8Format::E5M2 => "fp8_values_e5m2",
    };
    // SAFETY: the kernel reads and writes `n` elements: output 0's length, which input 0 has (checked).
    unsafe { c.launch("fp8", kernel, Grid::Items(n), &[Arg::Input(0), Arg::F32(s.scale), Arg::Output(0), Arg::U64(n)]) }
});

/// The values of `x`'s FP8 codes at `scale`, unscaled: `decode(encode(x ·
/// scale))` element by element, in `x`'s dtype (nearest code, ties to even,
/// saturating at the format's largest value; NaN stays NaN). Divide a
/// product of such values by the scales' product to undo the scaling.
pub fn fp8_values(x: &Tensor, format: Fp8Format, scale: f32) -> Result<Tensor> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(Error::invalid("fp8_values", format!("a scale of {scale}; scales are positive and finite (DelayedScaling keeps them so)")));
    }
    run1("fp8_values", &Fp8Values { format, scale }, &[x], x.shape().clone(), Out::Primary)
}

/// `alpha · (a · b)` for operands holding FP8 codes' values (as
/// [`fp8_values`] writes them): `a` of shape `[.., m, k]` in `a_format`, `b`
/// a `[k, n]` matrix in `b_format` (a weight read as `w.t()` costs no copy),
/// the result in `a`'s dtype. `alpha` undoes the operands' scales, `1 / (s_a
/// · s_b)`.
///
/// On the CPU, and on a GPU whose FP8 tensor cores cannot take the product,
/// this is exactly `scale(matmul(a, b), alpha)`: the emulation. On a GPU of
/// compute capability 8.9 or newer with every dimension a multiple of 16 and
/// not both operands E5M2, it is one cuBLASLt product of the code bytes on
/// the FP8 tensor cores, f32 accumulation, `alpha` applied before the
/// output's single rounding (so it agrees with the emulation to that
/// rounding and the order of the f32 sums).
pub fn matmul_fp8(a: &Tensor, a_format: Fp8Format, b: &Tensor, b_format: Fp8Format, alpha: f64) -> Result<Tensor> {
    const OP: &str = "matmul_fp8";
    if !(alpha.is_finite() && alpha > 0.0) {
        return Err(Error::invalid(OP, format!("alpha = {alpha}; it undoes positive finite scales, so it is positive and finite")));
    }
    if b.rank() != 2 || a.rank() < 2 || a.dims()[a.rank() - 1] != b.dims()[0] {
        return Err(Error::shape(OP, format!("{} · {}: the right operand is one [k, n] matrix and the left one ends in k", a.shape(), b.shape())));
    }
    let (k, n) = (b.dims()[0], b.dims()[1]);
    let m = a.elem_count() / k.max(1);
    if let (crate::Device::Cuda(dev), crate::Device::Cuda(_)) = (a.device(), b.device()) {
        if dev.fp8_gemm_fits((m, k, n), a_format, b_format, a.dtype()) && b.dtype() == a.dtype() {
            let (a_rows, bt) = (a.contiguous()?, b.t()?.contiguous()?);
            let (ga, gb) = (a_rows.read(), bt.read());
            let (a_range, b_range) = (a_rows.layout().contiguous_range().expect("contiguous"), bt.layout().contiguous_range().expect("contiguous"));
            let (crate::backend::Storage::Cuda(sa), crate::backend::Storage::Cuda(sb)) = (&*ga, &*gb) else {
                unreachable!("a tensor's storage lives on its device")
            };
            let out = dev.fp8_gemm((sa, a_range, a_format), (sb, b_range, b_format), (m, k, n), alpha as f32, a.dtype())?;
            super::flops::add(2.0 * (m * k * n) as f64);
            let mut dims = a.dims().to_vec();
            *dims.last_mut().expect("rank 2 or more") = n;
            return Ok(Tensor::from_storage(crate::backend::Storage::Cuda(out), dims.into(), a.device().clone()));
        }
    }
    super::scale(&super::matmul(a, b)?, alpha)
}

/// Delayed scaling of one tensor (Micikevicius et al., 2022; NVIDIA's
/// Transformer Engine): the scale a step quantizes with comes from the
/// largest magnitudes (amax) of the steps before it, so that quantizing
/// needs no pass over the tensor first. `scale = max / (amax_h · 2^margin)`
/// with `amax_h` the largest amax of the last `history` steps: the tensor's
/// recent largest value lands `margin` binades below the format's largest.
///
/// Before any amax is recorded the scale is 1, or what
/// [`start_from`](Self::start_from) set from the first step's own amax. An amax of zero leaves the
/// scale as it was (there is nothing to scale); a history whose amax is not
/// finite is an overflow the caller deals with (the loss scaler's step is
/// skipped), so [`record`](Self::record) refuses it and keeps the scale.
#[derive(Clone, Debug, PartialEq)]
pub struct DelayedScaling {
    format: Fp8Format,
    margin: i32,
    capacity: usize,
    history: VecDeque<f32>,
    scale: f32,
}

impl DelayedScaling {
    /// Scaling into `format` over the amaxes of the last `history` steps
    /// (at least 1; Transformer Engine's default is 1024, 16 is common),
    /// `margin` binades below the largest value.
    pub fn new(format: Fp8Format, history: usize, margin: i32) -> Result<Self> {
        if history == 0 {
            return Err(Error::invalid("DelayedScaling", "an amax history of 0 steps; keep at least 1 (16 is common)"));
        }
        if !(0..=16).contains(&margin) {
            return Err(Error::invalid("DelayedScaling", format!("a margin of {margin} binades; use 0 to 16 (0 is usual)")));
        }
        Ok(DelayedScaling { format, margin, capacity: history, history: VecDeque::with_capacity(history), scale: 1.0 })
    }

    /// The format.
    pub fn format(&self) -> Fp8Format {
        self.format
    }

    /// The scale to quantize with now.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// The amaxes recorded, oldest first.
    pub fn history(&self) -> impl Iterator<Item = f32> + '_ {
        self.history.iter().copied()
    }

    /// Sets the scale from `amax` without recording it (current scaling):
    /// for an operand's first step, which has no history to delay from.
    /// An amax of zero or one not finite leaves the scale as it was.
    pub fn start_from(&mut self, amax: f32) {
        if amax.is_finite() && amax > 0.0 {
            self.scale = self.scale_for(amax);
        }
    }

    /// `max / (amax · 2^margin)`, at most f32's largest value (for an amax
    /// of a denormal).
    fn scale_for(&self, amax: f32) -> f32 {
        let scale = f64::from(self.format.max()) / (f64::from(amax) * 2f64.powi(self.margin));
        scale.min(f64::from(f32::MAX)) as f32
    }

    /// Records a step's amax and computes the next scale from the history.
    /// Returns false, recording nothing, for an amax that is not finite.
    pub fn record(&mut self, amax: f32) -> bool {
        if !amax.is_finite() {
            return false;
        }
        if self.history.len() == self.capacity {
            self.history.pop_front();
        }
        self.history.push_back(amax.abs());
        let peak = self.history.iter().copied().fold(0.0f32, f32::max);
        if peak > 0.0 {
            self.scale = self.scale_for(peak);
        }
        true
    }

    /// Replaces the history (restoring a checkpoint), recomputing the scale.
    pub fn restore(&mut self, history: &[f32]) {
        self.history.clear();
        self.scale = 1.0;
        for &a in history.iter().rev().take(self.capacity).rev() {
            self.record(a);
        }
    }

    /// Replaces the history and the scale with a saved pair (restoring a
    /// checkpoint exactly, also a scale that no history set yet: one taken
    /// from an operand's first amax). A scale that is not finite and
    /// positive is refused.
    pub fn restore_with_scale(&mut self, history: &[f32], scale: f32) -> Result<()> {
        if !(scale.is_finite() && scale > 0.0) || history.iter().any(|a| !(a.is_finite() && *a >= 0.0)) {
            return Err(Error::invalid(
                "DelayedScaling::restore_with_scale",
                format!("scale {scale} with history {history:?}; a saved scaling has a finite scale > 0 and finite amaxes >= 0"),
            ));
        }
        self.restore(history);
        self.scale = scale;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Device;

    #[test]
    fn values_are_the_codes_values_in_the_tensors_dtype() {
        let dev = Device::cpu();
        let x = Tensor::from_vec(vec![1.0f32, 0.3, -500.0, 1e-9, f32::NAN, 0.0], [6], &dev).unwrap();
        let v = fp8_values(&x, Fp8Format::E4M3, 2.0).unwrap().to_vec::<f32>().unwrap();
        // 2 → 2; 0.6 → 0.625 (between 0.5625 and 0.625, nearer the latter); −1000 saturates; 2e-9 → 0.
        assert_eq!(&v[..4], &[2.0, 0.625, -448.0, 0.0]);
        assert!(v[4].is_nan() && v[5] == 0.0);
        let x64 = Tensor::from_vec(vec![3.0f64, -0.1], [2], &dev).unwrap();
        assert_eq!(fp8_values(&x64, Fp8Format::E5M2, 1.0).unwrap().to_vec::<f64>().unwrap(), vec![3.0, -0.09375]);
        for bad in [0.0, -1.0, f32::INFINITY, f32::NAN] {
            assert!(fp8_values(&x, Fp8Format::E4M3, bad).unwrap_err().to_string().contains("positive and finite"));
        }
    }

    #[test]
    fn the_scale_follows_the_largest_amax_of_the_history() {
        let mut s = DelayedScaling::new(Fp8Format::E4M3, 3, 0).unwrap();
        assert_eq!(s.scale(), 1.0);
        s.record(0.0);
        assert_eq!(s.scale(), 1.0, "nothing to scale yet");
        s.record(4.0);
        assert_eq!(s.scale(), 448.0 / 4.0);
        s.record(2.0);
        assert_eq!(s.scale(), 448.0 / 4.0, "the peak of the window");
        s.record(1.0);
        s.record(1.0);
        assert_eq!(s.scale(), 448.0 / 2.0, "4 left the window of 3");
        assert!(!s.record(f32::INFINITY) && !s.record(f32::NAN));
        assert_eq!(s.history().collect::<Vec<_>>(), vec![2.0, 1.0, 1.0]);
        let mut m = DelayedScaling::new(Fp8Format::E5M2, 4, 2).unwrap();
        m.record(8.0);
        assert_eq!(m.scale(), 57344.0 / 32.0);
        let mut f = DelayedScaling::new(Fp8Format::E4M3, 3, 0).unwrap();
        f.start_from(2.0);
        assert_eq!((f.scale(), f.history().count()), (224.0, 0));
        f.start_from(0.0);
        assert_eq!(f.scale(), 224.0);
        let mut r = DelayedScaling::new(Fp8Format::E4M3, 3, 0).unwrap();
        r.restore(&[9.0, 4.0, 2.0, 1.0]);
        assert_eq!((r.scale(), r.history().count()), (448.0 / 4.0, 3));
        // A saved first-use scale, with no history behind it, comes back as it was.
        r.restore_with_scale(&[], 224.0).unwrap();
        assert_eq!((r.scale(), r.history().count()), (224.0, 0));
        assert!(r.restore_with_scale(&[], f32::NAN).is_err() && r.restore_with_scale(&[-1.0], 2.0).is_err());
        assert!(DelayedScaling::new(Fp8Format::E4M3, 0, 0).is_err() && DelayedScaling::new(Fp8Format::E4M3, 4, 17).is_err());
    }
}
