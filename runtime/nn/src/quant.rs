//! Quantizing a materialised model's linear layers for inference, in
//! place, without changing the model's structs.

use crate::module::{distinct_params, Cx, Module};
use tessera_core::ops::{self, QuantFormat};
use tessera_core::{Error, Result};

/// What [`quantize_linears`] did, per parameter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuantizeReport {
    /// The weights quantized, by name, in visit order.
    pub quantized: Vec<String>,
    /// Weights left in their float dtype, each with why: a matrix shared by
    /// several layers (a head tied to the embedding), a linear layer's
    /// weight another pipeline stage holds or one quantized before.
    pub skipped: Vec<(String, String)>,
    /// Bytes the quantized weights' values held on this rank.
    pub bytes_before: usize,
    /// Bytes their quantized forms hold (codes and scales).
    pub bytes_after: usize,
}

/// Replaces the weight of every [`Linear`](crate::Linear) of the
/// materialised `model` by its quantized form in `format`, on `cx`'s
/// device, for inference: each layer's forward then multiplies with
/// [`quant_matmul`](tessera_core::ops::quant_matmul), its backward is an
/// error, and the f32 values are freed as each weight is quantized.
///
/// - Every tensor-parallel role works (plain, column, row, vocab): each
///   rank quantizes its own shard, so an int4 group must divide the
///   shard's input features (a row-parallel layer's `in_features / tp`).
///   A vocab-parallel head still masks its padding outputs.
/// - A weight shared by several layers (an output head tied to the token
///   embedding) is skipped and stays in its float dtype: the embedding
///   looks rows up in it, which a quantized form cannot serve, and keeping
///   both forms would cost more memory than the f32 alone.
/// - Parameters of other layers (embeddings, norms, a mixture of experts'
///   own matrices) are left as they are; so is a weight held by another
///   pipeline stage.
///
/// Every weight is checked against `format` first (an int4 group that
/// does not divide its input features is an error naming each such weight,
/// before anything changes). A weight holding NaN or an infinity is an
/// error naming it, raised when it is reached; the weights before it are
/// quantized by then.
///
/// ```
/// use tessera::module::{materialize, Act, Cx, Module};
/// use tessera::nn::{quantize_linears, Linear};
/// use tessera::ops::QuantFormat;
/// use tessera::{DType, Device, Tensor};
///
/// let cx = &mut Cx::new(Device::cpu());
/// let proj = Linear::new(256, 64, true)?;
/// materialize(&proj, cx)?;
/// let report = quantize_linears(&proj, cx, QuantFormat::int4())?;
/// assert_eq!(report.quantized, ["weight"]);
/// cx.set_training(false);
/// let x = Tensor::zeros([1, 256], DType::F32, cx.device())?;
/// let (y, _) = <Linear as Module>::forward(&proj, cx, Act::new(x))?;
/// assert_eq!(y.tensor().dims(), &[1, 64]);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn quantize_linears<M: Module>(model: &M, cx: &Cx, format: QuantFormat) -> Result<QuantizeReport> {
    const OP: &str = "quantize_linears";
    let mut report = QuantizeReport::default();
    let mut todo = Vec::new();
    let mut problems = Vec::new();
    for p in distinct_params(model)? {
        let name = p.name().to_string();
        if p.is_tied() && p.param.global_shape().rank() == 2 {
            let why = format!("shared with `{}`: the layers sharing a weight read its values, so it stays in its float dtype", p.names[1..].join("`, `"));
            report.skipped.push((name, why));
        } else if !p.param.is_quantizable() || p.is_tied() {
            continue;
        } else if p.param.is_remote() {
            report.skipped.push((name, "held by another pipeline stage".into()));
        } else if let Some(q) = p.param.quantized() {
            report.skipped.push((name, format!("already quantized ({})", q.format())));
        } else {
            let k = p.param.local_shape().dims().get(1).copied().unwrap_or(0);
            match ops::check_quant_format(format, k) {
                Ok(()) => todo.push((name, p.param)),
                Err(e) => problems.push(format!("`{name}`: {}", e.root())),
            }
        }
    }
    if !problems.is_empty() {
        return Err(Error::invalid(OP, format!("{format} does not fit every linear layer on this rank, nothing was quantized:\n{}", problems.join("\n"))));
    }
    for (name, param) in todo {
        let value = param.value().map_err(|e| e.context(format!("{OP}: the model must be materialised first")))?;
        let mut q = ops::quantize(&value, format).map_err(|e| e.context(format!("{OP}: quantizing `{name}`")))?;
        if !q.device().same(cx.device()) {
            q = q.to_device(cx.device())?;
        }
        report.bytes_before += value.elem_count() * value.dtype().size_in_bytes();
        report.bytes_after += q.bytes();
        drop(value);
        param.set_quantized(q)?;
        report.quantized.push(name);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::module::{materialize, Act, Module};
    use crate::Linear;
    use tessera_core::tensor::{DType, Tensor};
    use tessera_core::{Device, RngKey};

    fn rand(shape: &[usize], seed: u64, dev: &Device) -> Tensor {
        Tensor::rand(tessera_core::Init::Normal { mean: 0.0, std: 1.0 }, RngKey::new(seed, 1), shape.to_vec(), DType::F32, dev).unwrap()
    }

    /// A layer's forward after quantizing: the product with the dequantized
    /// weight (up to f32 rounding), and within the format's bound of the f32
    /// layer's output (`Σ_k |x_k| · s/2`, each `k` with its scale; W8A8 adds
    /// the activations' rounding). The f32 values are freed, the backward
    /// refuses, and reading the value says why.
    #[test]
    fn a_quantized_linear_stays_within_the_bound_of_the_f32_one() {
        let (n, k) = (24, 256);
        for format in [QuantFormat::Int8, QuantFormat::Int4 { group_size: 64 }, QuantFormat::W8A8] {
            let dev = Device::cpu();
            let cx = &mut Cx::new(dev.clone()).with_seed(3);
            let layer = Linear::new(k, n, true).unwrap();
            materialize(&layer, cx).unwrap();
            layer.bias().unwrap().set_value(rand(&[n], 9, &dev)).unwrap();
            let x = rand(&[2, 3, k], 4, &dev);
            let (y32, _) = <Linear as Module>::forward(&layer, cx, Act::new(x.clone())).unwrap();
            let before = dev.memory_stats().in_use;
            let report = quantize_linears(&layer, cx, format).unwrap();
            assert_eq!(report.quantized, ["weight"]);
            assert_eq!((report.bytes_before, report.bytes_after), (4 * n * k, format.code_bytes(n, k) + 4 * format.scale_count(n, k)));
            let after = dev.memory_stats().in_use;
            assert_eq!(before - after, report.bytes_before - report.bytes_after, "{format}: the f32 weight is freed");

            let q = layer.weight().quantized().unwrap();
            let (yq, saved) = <Linear as Module>::forward(&layer, cx, Act::new(x.clone())).unwrap();
            let (yq, y32) = (yq.tensor().to_vec::<f32>().unwrap(), y32.tensor().to_vec::<f32>().unwrap());
            let (deq, scales) = (q.dequantize().unwrap().to_vec::<f32>().unwrap(), q.scales().to_vec::<f32>().unwrap());
            let (xs, b) = (x.to_vec::<f32>().unwrap(), layer.bias().unwrap().value().unwrap().to_vec::<f32>().unwrap());
            for (r, xr) in xs.chunks(k).enumerate() {
                let sx = xr.iter().fold(0f64, |m, v| m.max(v.abs() as f64)) / 127.0;
                for j in 0..n {
                    let scale = |kk: usize| match format {
                        QuantFormat::Int4 { group_size } => scales[j * (k / group_size) + kk / group_size] as f64,
                        _ => scales[j] as f64,
                    };
                    let (mut exact_deq, mut bound) = (b[j] as f64, 1e-4);
                    for kk in 0..k {
                        let (xv, dv) = (xr[kk] as f64, deq[j * k + kk] as f64);
                        exact_deq += xv * dv;
                        bound += xv.abs() * scale(kk) / 2.0;
                        if format == QuantFormat::W8A8 {
                            bound += sx / 2.0 * dv.abs();
                        }
                    }
                    let got = yq[r * n + j] as f64;
                    if format != QuantFormat::W8A8 {
                        assert!((got - exact_deq).abs() <= 1e-4 * (1.0 + exact_deq.abs()), "{format} output [{r}, {j}]: {got} vs {exact_deq}");
                    }
                    let f32_out = y32[r * n + j] as f64;
                    assert!((got - f32_out).abs() <= bound * 1.0001, "{format} output [{r}, {j}]: {got} vs the f32 layer's {f32_out}, bound {bound}");
                }
            }
            let e = <Linear as Module>::backward(&layer, cx, saved, Act::new(Tensor::zeros([2, 3, n], DType::F32, &dev).unwrap())).unwrap_err().to_string();
            assert!(e.contains("quantized weight, which is for inference only"), "{e}");
            let e = layer.weight().value().unwrap_err().to_string();
            assert!(e.contains("holds only its") && e.contains("quantized form"), "{e}");
            // A second pass changes nothing and says why.
            let again = quantize_linears(&layer, cx, format).unwrap();
            assert!(again.quantized.is_empty() && again.skipped[0].1.contains("already quantized"), "{again:?}");
        }
    }

    #[test]
    fn half_precision_activations_give_half_precision_outputs() {
        let dev = Device::cpu();
        let cx = &mut Cx::new(dev.clone()).with_dtype(DType::BF16);
        let layer = Linear::new(64, 8, false).unwrap();
        materialize(&layer, cx).unwrap();
        let x = rand(&[3, 64], 5, &dev);
        let (y32, _) = <Linear as Module>::forward(&layer, cx, Act::new(x.clone())).unwrap();
        quantize_linears(&layer, cx, QuantFormat::Int8).unwrap();
        let (y, _) = <Linear as Module>::forward(&layer, cx, Act::new(x)).unwrap();
        assert_eq!(y.tensor().dtype(), DType::BF16);
        let (a, b) = (y.tensor().to_f32_vec().unwrap(), y32.tensor().to_f32_vec().unwrap());
        for (a, b) in a.iter().zip(&b) {
            assert!((a - b).abs() <= 0.03 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }

    #[test]
    fn a_format_that_does_not_fit_changes_nothing_and_names_the_weight() {
        let cx = &Cx::new(Device::cpu());
        let layer = Linear::new(96, 8, false).unwrap();
        let e = quantize_linears(&layer, cx, QuantFormat::int4()).unwrap_err().to_string();
        assert!(e.contains("`weight`") && e.contains("not a multiple of the int4 group size 128") && e.contains("nothing was quantized"), "{e}");
        let unmaterialised = quantize_linears(&layer, cx, QuantFormat::Int8).unwrap_err().to_string();
        assert!(unmaterialised.contains("materialised first"), "{unmaterialised}");
        materialize(&layer, cx).unwrap();
        assert!(quantize_linears(&layer, cx, QuantFormat::int4()).is_err());
        assert!(!layer.weight().is_quantized() && layer.weight().value().is_ok());
    }
}
