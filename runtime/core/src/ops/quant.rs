//! Quantized weights for inference: a linear layer's weight
//! `[out_features, in_features]` quantized once ([`quantize`]) and
//! multiplied from its codes ([`quant_matmul`]) without ever being
//! dequantized in memory.
//!
//! Formats ([`QuantFormat`], all symmetric): int8 with one scale per output
//! channel, int4 with one scale per group of input features (128 by
//! default; the group must be even and divide the input features), and
//! W8A8, the int8 weight with the activations quantized to int8 per row
//! when the product runs. Their layouts and error bounds are those of
//! [`tessera_kernels::cpu::quant`]: a weight-only product is within
//! `Σ_k |x_k| · s/2` of the f32 product (each `k` with its scale), W8A8
//! adds `Σ_k (sx/2) · |dequant(W)[n, k]|` for the activations' rounding.
//!
//! Quantizing runs on the host (the weight is copied there from a GPU and
//! the codes uploaded back: it happens once, when a model is loaded), so a
//! weight quantizes to the same codes on every device. The products run
//! where the operands are: the CPU kernels (rayon over output channels,
//! AVX2 where the CPU has it), or the CUDA kernels of `quant.cu` on a GPU.
//! There is no backward: a quantized weight is for inference only.

use crate::backend::{CpuStorage, Device, Storage};
use crate::error::{Error, Result};
use crate::tensor::{check_device, check_float, DType, Element, Layout, Shape, Tensor};
use std::fmt;
use tessera_kernels::cpu::quant::int4::{self, Int4Weight};
use tessera_kernels::cpu::quant::int8::{self, Int8Weight};
use tessera_kernels::cpu::quant::w8a8;
pub use tessera_kernels::desc::QuantFormat;

/// A weight `[out_features, in_features]` in a quantized format, its codes
/// and scales on one device: what [`quant_matmul`] multiplies.
///
/// The codes are bytes, packed four to a `u32` element of [`codes`](Self::codes)
/// (tensors have no byte dtype; the kernels read the words' bytes in memory
/// order, which is the order the quantizer wrote them in on any host). The
/// scales are f32: `[out_features]` for int8 and W8A8, `[out_features,
/// in_features / group_size]` for int4. Cloning shares both tensors.
#[derive(Clone)]
pub struct QuantizedWeight {
    format: QuantFormat,
    out_features: usize,
    in_features: usize,
    codes: Tensor,
    scales: Tensor,
}

impl QuantizedWeight {
    /// The format.
    pub fn format(&self) -> QuantFormat {
        self.format
    }

    /// The shape of the weight it stands for, `[out_features, in_features]`.
    pub fn shape(&self) -> Shape {
        Shape::new([self.out_features, self.in_features])
    }

    /// Rows of the weight: output features.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Columns of the weight: input features.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// The device holding the codes and scales.
    pub fn device(&self) -> &Device {
        self.codes.device()
    }

    /// The codes, bytes packed four to a `u32` (see the type's documentation).
    pub fn codes(&self) -> &Tensor {
        &self.codes
    }

    /// The f32 scales.
    pub fn scales(&self) -> &Tensor {
        &self.scales
    }

    /// The bytes a product streams: codes and scales (an f32 weight of the
    /// same shape is `4 · out_features · in_features`).
    pub fn bytes(&self) -> usize {
        self.format.code_bytes(self.out_features, self.in_features) + 4 * self.scales.elem_count()
    }

    /// The f32 weight the codes stand for (`code · scale`), `[out_features,
    /// in_features]` on the weight's device: for tests and for inspecting a
    /// quantized model; products never make it.
    pub fn dequantize(&self) -> Result<Tensor> {
        let (n, k) = (self.out_features, self.in_features);
        let words = self.codes.to_vec::<u32>()?;
        let scales = self.scales.to_vec::<f32>()?;
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        let mut out = vec![0f32; n * k];
        match self.format {
            QuantFormat::Int8 | QuantFormat::W8A8 => {
                int8::dequantize(&Int8Weight { q: bytemuck::cast_slice(&bytes[..n * k]), scales: &scales, n, k }, &mut out)
            }
            QuantFormat::Int4 { group_size } => {
                int4::dequantize(&Int4Weight { packed: &bytes[..n * k / 2], scales: &scales, n, k, group: group_size }, &mut out)
            }
        }
        Tensor::from_vec(out, [n, k], self.device())
    }

    /// A copy on `device` (codes and scales copied through host memory).
    pub fn to_device(&self, device: &Device) -> Result<QuantizedWeight> {
        Ok(QuantizedWeight { codes: self.codes.to_device(device)?, scales: self.scales.to_device(device)?, ..self.clone() })
    }
}

impl fmt::Debug for QuantizedWeight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "QuantizedWeight({}, [{}, {}], {})", self.format, self.out_features, self.in_features, self.device())
    }
}

/// Checks, before any work, that a weight with `in_features` input
/// features can be quantized to `format` ([`quantize`] checks the same):
/// an int4 group size that is even and divides them, and no more than W8A8
/// sums exactly. The error says what to choose instead.
pub fn check_quant_format(format: QuantFormat, in_features: usize) -> Result<()> {
    check_format("quantize", format, in_features)
}

fn check_format(op: &'static str, format: QuantFormat, k: usize) -> Result<()> {
    match format {
        QuantFormat::Int4 { group_size } if group_size < 2 || !group_size.is_multiple_of(2) => Err(Error::invalid(
            op,
            format!(
                "the int4 group size must be even and at least 2 (two codes share a byte), got {group_size}; {} is the usual choice",
                QuantFormat::INT4_GROUP
            ),
        )),
        QuantFormat::Int4 { group_size } if !k.is_multiple_of(group_size) => {
            let fix = match (2..=group_size.min(k)).rev().find(|&g| g.is_multiple_of(2) && k.is_multiple_of(g)) {
                Some(g) => format!("choose a group size that divides it, such as `QuantFormat::Int4 {{ group_size: {g} }}`, or quantize this weight to int8"),
                None => "int4 needs an even number of input features; quantize this weight to int8".into(),
            };
            Err(Error::indivisible(op, format!("{k} input features are not a multiple of the int4 group size {group_size}; {fix}")))
        }
        QuantFormat::W8A8 if k > w8a8::MAX_K => Err(Error::unsupported(
            op,
            format!("W8A8 sums {k} products of int8 codes in i32, which can overflow beyond {} input features; quantize this weight to int8", w8a8::MAX_K),
        )),
        _ => Ok(()),
    }
}

/// Runs `f` on the elements of `t` as f32 in host memory: borrowed for a
/// contiguous f32 tensor on a CPU, converted or copied otherwise.
fn with_host_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    if t.dtype() == DType::F32 && matches!(t.device(), Device::Cpu(_)) {
        let t = t.contiguous()?;
        let g = t.read();
        return f(cpu_slice::<f32>(&g, t.layout()));
    }
    f(&t.to_f32_vec()?)
}

/// The elements of a contiguous CPU tensor whose storage holds `T`.
fn cpu_slice<'a, T: Element>(s: &'a Storage, layout: &Layout) -> &'a [T] {
    let range = layout.contiguous_range().expect("made contiguous by the caller");
    match s {
        Storage::Cpu(s) => &s.as_slice::<T>().expect("dtype checked by the caller")[range],
        Storage::Cuda(_) => unreachable!("the caller matched a CPU device"),
    }
}

/// Quantizes the weight `w` (`[out_features, in_features]`, any float
/// dtype) to `format`, on `w`'s device.
///
/// Errors: a weight that is not a float matrix, an int4 group size that is
/// odd or does not divide the input features (the message suggests one
/// that does), W8A8 on more input features than its i32 sums take, and a
/// weight holding NaN or an infinity (naming the element).
///
/// ```
/// use tessera::ops::{self, QuantFormat};
/// use tessera::{Device, Tensor};
///
/// let dev = Device::cpu();
/// let w = Tensor::from_vec(vec![0.5f32, -1.0, 0.25, 2.0], [2, 2], &dev)?;
/// let q = ops::quantize(&w, QuantFormat::Int8)?;
/// let x = Tensor::from_vec(vec![1.0f32, 1.0], [1, 2], &dev)?;
/// let y = ops::quant_matmul(&x, &q, None)?.to_vec::<f32>()?;
/// assert!((y[0] - (-0.5)).abs() < 1e-2 && (y[1] - 2.25).abs() < 1e-2);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn quantize(w: &Tensor, format: QuantFormat) -> Result<QuantizedWeight> {
    const OP: &str = "quantize";
    check_float(OP, w)?;
    let (n, k) = match *w.dims() {
        [n, k] => (n, k),
        _ => return Err(Error::shape(OP, format!("a weight to quantize is a matrix [out_features, in_features], got shape {}", w.shape()))),
    };
    check_format(OP, format, k)?;
    let code_bytes = format.code_bytes(n, k);
    let mut words = vec![0u32; code_bytes.div_ceil(4)];
    let mut scales = vec![0f32; format.scale_count(n, k)];
    with_host_f32(w, |values| {
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(Error::non_finite(
                OP,
                format!("weight element [{}, {}] is {}; a weight holding NaN or infinities cannot be quantized", i / k, i % k, values[i]),
            ));
        }
        let codes = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut words)[..code_bytes];
        match format {
            QuantFormat::Int8 | QuantFormat::W8A8 => int8::quantize(values, n, k, bytemuck::cast_slice_mut(codes), &mut scales),
            QuantFormat::Int4 { group_size } => int4::quantize(values, n, k, group_size, codes, &mut scales),
        }
        Ok(())
    })?;
    let scale_shape = match format {
        QuantFormat::Int4 { group_size } => Shape::new([n, k / group_size]),
        _ => Shape::new([n]),
    };
    let words_len = words.len();
    Ok(QuantizedWeight {
        format,
        out_features: n,
        in_features: k,
        codes: Tensor::from_vec(words, [words_len], w.device())?,
        scales: Tensor::from_vec(scales, scale_shape, w.device())?,
    })
}

/// `x · dequant(W)ᵀ (+ bias)`: the linear layer's forward with a quantized
/// weight. `x` is `[..., in_features]` in f32, bf16 or f16, `bias` (if any)
/// is `[out_features]`; the result is `[..., out_features]` in `x`'s dtype.
///
/// On a CPU the activations are widened to f32 (one copy of `x`, small
/// next to the weight when decoding) and the result rounded back to `x`'s
/// dtype; on a GPU the kernels read and write `x`'s dtype and take the bias
/// in it (converted if it differs). See [`tessera_kernels::cpu::quant`] for the error
/// bounds. There is no backward: the op is for inference.
pub fn quant_matmul(x: &Tensor, w: &QuantizedWeight, bias: Option<&Tensor>) -> Result<Tensor> {
    quant_product("quant_matmul", x, w, bias, false)
}

/// [`quant_matmul`] computed so that every row of the result depends on its
/// row of `x` alone: the same bits whether the row is multiplied alone or
/// among any number of others. Serving uses it so a request decodes the
/// same tokens alone or in a batch. On a CPU, int8 and int4 run their
/// decode loops at every row count rather than the prefill tile
/// ([`int8::matmul_rows`]), which is slower from
/// [`TILE_MIN_ROWS`](tessera_kernels::cpu::quant::TILE_MIN_ROWS) rows on;
/// W8A8 is row-invariant either way. On a GPU the kernels sum each row on
/// its own already (one warp per output channel, one partial sum per row in
/// every lane), so this is the same launch as [`quant_matmul`].
pub fn quant_matmul_rows(x: &Tensor, w: &QuantizedWeight, bias: Option<&Tensor>) -> Result<Tensor> {
    quant_product("quant_matmul_rows", x, w, bias, true)
}

/// The quantized product, row-invariant on the CPU when `invariant`.
fn quant_product(op: &'static str, x: &Tensor, w: &QuantizedWeight, bias: Option<&Tensor>, invariant: bool) -> Result<Tensor> {
    let (n, k) = (w.out_features, w.in_features);
    if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::DType { op, expected: "f32, bf16 or f16 activations".into(), got: x.dtype(), hint: "; convert them with `to_dtype(DType::F32)`" });
    }
    check_device(op, x, &w.codes)?;
    if x.dims().last() != Some(&k) {
        return Err(Error::shape(
            op,
            format!("activations of shape {} for a {} weight [{n}, {k}]; their last dimension must be the {k} input features", x.shape(), w.format),
        ));
    }
    if let Some(b) = bias {
        check_float(op, b)?;
        check_device(op, x, b)?;
        if b.dims() != [n] {
            return Err(Error::shape(op, format!("bias of shape {} for a weight of {n} output features; the bias must be [{n}]", b.shape())));
        }
    }
    let rows: usize = x.dims()[..x.rank() - 1].iter().product();
    super::flops::add(2.0 * (rows * k * n) as f64);
    let out_shape = x.shape().with_last(n);
    match x.device() {
        Device::Cpu(dev) => {
            let x32 = if x.dtype() == DType::F32 { x.contiguous()? } else { x.to_dtype(DType::F32)? };
            let b32 = bias.map(|b| if b.dtype() == DType::F32 { b.contiguous() } else { b.to_dtype(DType::F32) }).transpose()?;
            let mut out = dev.buffer_for_overwrite::<f32>(rows * n);
            {
                let (xg, cg, sg) = (x32.read(), w.codes.read(), w.scales.read());
                let bg = b32.as_ref().map(|b| b.read());
                let xs = cpu_slice::<f32>(&xg, x32.layout());
                let bytes: &[u8] = bytemuck::cast_slice(cpu_slice::<u32>(&cg, w.codes.layout()));
                let scales = cpu_slice::<f32>(&sg, w.scales.layout());
                let bs = bg.as_ref().zip(b32.as_ref()).map(|(g, b)| cpu_slice::<f32>(g, b.layout()));
                match w.format {
                    QuantFormat::Int8 => {
                        let w = Int8Weight { q: bytemuck::cast_slice(&bytes[..n * k]), scales, n, k };
                        let product = if invariant { int8::matmul_rows } else { int8::matmul };
                        product(xs, rows, &w, bs, &mut out)
                    }
                    QuantFormat::W8A8 => w8a8::matmul(xs, rows, &Int8Weight { q: bytemuck::cast_slice(&bytes[..n * k]), scales, n, k }, bs, &mut out),
                    QuantFormat::Int4 { group_size } => {
                        let w = Int4Weight { packed: &bytes[..n * k / 2], scales, n, k, group: group_size };
                        let product = if invariant { int4::matmul_rows } else { int4::matmul };
                        product(xs, rows, &w, bs, &mut out)
                    }
                }
            }
            let y = Tensor::from_cpu(CpuStorage::F32(out), out_shape, dev);
            if x.dtype() == DType::F32 {
                Ok(y)
            } else {
                y.to_dtype(x.dtype())
            }
        }
        Device::Cuda(_) => {
            let xc = x.contiguous()?;
            let bc = bias.map(|b| if b.dtype() == x.dtype() { b.contiguous() } else { b.to_dtype(x.dtype()) }).transpose()?;
            let (xg, cg, sg) = (xc.read(), w.codes.read(), w.scales.read());
            let bg = bc.as_ref().map(|b| b.read());
            let range = |t: &Tensor| t.layout().contiguous_range().expect("contiguous");
            let y = match (&*xg, &*cg, &*sg) {
                (Storage::Cuda(xs), Storage::Cuda(cs), Storage::Cuda(ss)) => {
                    let bs = match (bg.as_deref(), bc.as_ref()) {
                        (Some(Storage::Cuda(b)), Some(t)) => Some((b, range(t))),
                        (None, _) => None,
                        _ => return Err(Error::DeviceMismatch { op, lhs: x.device().to_string(), rhs: "cpu".into() }),
                    };
                    xs.quant_matmul(range(&xc), (cs, range(&w.codes)), (ss, range(&w.scales)), bs, w.format, (rows, n, k))?
                }
                _ => return Err(Error::DeviceMismatch { op, lhs: x.device().to_string(), rhs: "cpu".into() }),
            };
            Ok(Tensor::from_storage(Storage::Cuda(y), out_shape, x.device().clone()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Init, RngKey};

    /// A seeded `[-1, 1)` f32 tensor of `dims` on `dev`.
    fn uniform<const N: usize>(dims: [usize; N], seed: u64, dev: &Device) -> Tensor {
        Tensor::rand(Init::Uniform { lo: -1.0, hi: 1.0 }, RngKey::new(seed, 0), dims, DType::F32, dev).unwrap()
    }

    /// The op on tensors gives the kernels' result, for every format and
    /// activation dtype, batched leading dimensions included; the bias is
    /// added, and half-precision activations give the f32 result rounded.
    #[test]
    fn the_op_matches_the_dequantized_product_for_every_format_and_dtype() {
        let dev = Device::cpu();
        let (n, k) = (12, 64);
        let w = uniform([n, k], 1, &dev);
        let b = uniform([n], 2, &dev);
        let x = uniform([2, 3, k], 3, &dev);
        for format in [QuantFormat::Int8, QuantFormat::Int4 { group_size: 32 }, QuantFormat::W8A8] {
            let q = quantize(&w, format).unwrap();
            assert_eq!((q.format(), q.shape(), q.bytes()), (format, Shape::new([n, k]), format.code_bytes(n, k) + 4 * format.scale_count(n, k)));
            let deq = q.dequantize().unwrap();
            let want = crate::ops::matmul_bias(&x, &deq.t().unwrap(), &b).unwrap().to_vec::<f32>().unwrap();
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let y = quant_matmul(&x.to_dtype(dtype).unwrap(), &q, Some(&b)).unwrap();
                assert_eq!((y.dims(), y.dtype()), (&[2, 3, n][..], dtype));
                let y = y.to_f32_vec().unwrap();
                // W8A8 also rounds the activations: one step of the row's scale on each of k products.
                let tol = match (format, dtype) {
                    (QuantFormat::W8A8, _) => 0.05,
                    (_, DType::F32) => 1e-5,
                    _ => 2e-2,
                };
                for (i, (a, e)) in y.iter().zip(&want).enumerate() {
                    assert!((a - e).abs() <= tol * (1.0 + e.abs()), "{format} {dtype}: output {i} is {a}, expected {e}");
                }
            }
        }
    }

    /// `quant_matmul_rows` gives each row the bits it gets alone, above the
    /// prefill tile's row count too, in every format and activation dtype,
    /// and the product `quant_matmul` gives up to rounding.
    #[test]
    fn the_row_invariant_product_gives_a_row_its_bits_alone() {
        let dev = Device::cpu();
        let (m, n, k) = (20, 9, 72);
        let w = uniform([n, k], 4, &dev);
        let b = uniform([n], 5, &dev);
        let x = uniform([m, k], 6, &dev);
        for format in [QuantFormat::Int8, QuantFormat::Int4 { group_size: 24 }, QuantFormat::Int4 { group_size: 36 }, QuantFormat::W8A8] {
            let q = quantize(&w, format).unwrap();
            for dtype in [DType::F32, DType::BF16] {
                let x = x.to_dtype(dtype).unwrap();
                let y = quant_matmul_rows(&x, &q, Some(&b)).unwrap();
                let fast = quant_matmul(&x, &q, Some(&b)).unwrap().to_f32_vec().unwrap();
                for r in 0..m {
                    let alone = quant_matmul_rows(&x.narrow(0, r, 1).unwrap(), &q, Some(&b)).unwrap();
                    let (a, t) = (alone.to_f32_vec().unwrap(), y.narrow(0, r, 1).unwrap().to_f32_vec().unwrap());
                    assert!(a.iter().zip(&t).all(|(a, t)| a.to_bits() == t.to_bits()), "{format} {dtype}: row {r} alone {a:?}, batched {t:?}");
                }
                let y = y.to_f32_vec().unwrap();
                let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                assert!(y.iter().zip(&fast).all(|(a, e)| (a - e).abs() <= tol * (1.0 + e.abs())), "{format} {dtype}: the two products differ");
            }
        }
    }

    #[test]
    fn bad_operands_are_refused_with_the_fix() {
        let dev = Device::cpu();
        let w = uniform([4, 96], 1, &dev);
        let err = |r: Result<QuantizedWeight>| r.unwrap_err().to_string();
        let e = err(quantize(&w, QuantFormat::int4()));
        assert!(e.contains("96 input features are not a multiple of the int4 group size 128") && e.contains("group_size: 96"), "{e}");
        let e = err(quantize(&w, QuantFormat::Int4 { group_size: 7 }));
        assert!(e.contains("must be even"), "{e}");
        let odd = Tensor::zeros([2, 5], DType::F32, &dev).unwrap();
        let e = err(quantize(&odd, QuantFormat::Int4 { group_size: 4 }));
        assert!(e.contains("int4 needs an even number of input features"), "{e}");
        let e = err(quantize(&Tensor::zeros([3], DType::F32, &dev).unwrap(), QuantFormat::Int8));
        assert!(e.contains("[out_features, in_features]"), "{e}");
        let e = err(quantize(&Tensor::zeros([2, 2], DType::U32, &dev).unwrap(), QuantFormat::Int8));
        assert!(e.contains("expected dtype"), "{e}");
        let mut bad = uniform([8], 2, &dev).to_vec::<f32>().unwrap();
        bad[5] = f32::NAN;
        let e = err(quantize(&Tensor::from_vec(bad, [2, 4], &dev).unwrap(), QuantFormat::Int8));
        assert!(e.contains("[1, 1] is NaN"), "{e}");

        let q = quantize(&w, QuantFormat::Int8).unwrap();
        let e = quant_matmul(&Tensor::zeros([2, 95], DType::F32, &dev).unwrap(), &q, None).unwrap_err().to_string();
        assert!(e.contains("last dimension must be the 96 input features"), "{e}");
        let x = Tensor::zeros([2, 96], DType::F32, &dev).unwrap();
        let e = quant_matmul(&x, &q, Some(&Tensor::zeros([5], DType::F32, &dev).unwrap())).unwrap_err().to_string();
        assert!(e.contains("the bias must be [4]"), "{e}");
        let e = quant_matmul(&x.to_dtype(DType::F64).unwrap(), &q, None).unwrap_err().to_string();
        assert!(e.contains("f32, bf16 or f16"), "{e}");
        let e = quant_matmul(&Tensor::zeros([2, 96], DType::F32, &Device::cpu()).unwrap(), &q, None).unwrap_err().to_string();
        assert!(e.contains("different devices"), "{e}");
    }
}
