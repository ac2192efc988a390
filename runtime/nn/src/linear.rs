//! The affine layer `y = x·Wᵀ + b` in its four tensor-parallel forms.

use super::param_value;
use crate::module::{
    Act, Activation, CollectiveKind, Column, Cx, Describe, Group, Module, PartialSum, Pass, Plain, Replicated, Row, Seq, SplitHidden, Visitor, Vocab,
};
use crate::module::{Operand, Param};
use tessera_core::ops::{self, QuantizedWeight};
use tessera_core::tensor::{Init, Tensor};
use tessera_core::{Error, Result};

/// A fully connected layer `y = x·Wᵀ + b` over the last dimension.
///
/// The weight has the global shape `[out_features, in_features]` (the layout
/// checkpoints of common model hubs use) and starts Normal(0, 0.02); the
/// optional bias `[out_features]` starts at zero. Inputs may have any rank of
/// at least two; the last dimension holds this rank's input features and is
/// replaced by its output features.
///
/// Roles (set by the parent's `#[shard(..)]`):
///
/// * `Plain`: `Replicated → Replicated`, nothing split.
/// * `Column`: `Replicated → SplitHidden`; the weight and bias are split along
///   the output features (dimension 0). The input gradient is a partial sum
///   over the group and is all-reduced in the backward (Megatron's `f`).
/// * `Row`: `SplitHidden → PartialSum`; the weight is split along the input
///   features (dimension 1), the bias is replicated and added on rank 0 only,
///   so the group sum contains it once. No communication in either pass; every
///   rank delivers the same bias gradient.
/// * `Vocab`: the vocab-parallel output head, `Replicated → SplitHidden` with
///   the logits split over the vocabulary; sharded and differentiated like
///   `Column`.
///
/// For inference the weight may be replaced by a quantized form (int8,
/// int4, W8A8; see [`quantize_linears`](crate::quantize_linears) and
/// [`Param::set_quantized`]): the forward then multiplies with
/// [`ops::quant_matmul`] in the activations' dtype, in every role and with
/// the vocab head's padding mask as before, and the backward is an error.
///
/// ```
/// use tessera::module::{materialize, Act, Cx, Module};
/// use tessera::nn::Linear;
/// use tessera::{Device, Tensor};
///
/// let dev = Device::cpu();
/// let cx = &mut Cx::new(dev.clone());
/// let proj = Linear::new(4, 3, true)?;
/// materialize(&proj, cx)?;
/// let x = Tensor::zeros([2, 5, 4], tessera::DType::F32, &dev)?;
/// let (y, saved) = <Linear as Module>::forward(&proj, cx, Act::new(x))?;
/// assert_eq!(y.tensor().dims(), &[2, 5, 3]);
/// let dx = <Linear as Module>::backward(&proj, cx, saved, y)?;
/// assert_eq!(dx.tensor().dims(), &[2, 5, 4]);
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Debug)]
pub struct Linear {
    in_features: usize,
    out_features: usize,
    /// Outputs past this index are padding: a vocab-parallel head masks
    /// them to −∞ (see [`Linear::with_valid_outputs`]).
    valid_outputs: usize,
    weight: Param,
    bias: Option<Param>,
}

/// What a [`Linear`] keeps for its backward: its input only (the same bytes
/// as the input activation, shared with it when the caller keeps it too).
/// The weight is re-read in the backward rather than kept. A column-parallel
/// layer under sequence parallelism keeps this rank's slice of the sequence,
/// not the gathered whole, and gathers it again in the backward: `tp` times
/// less memory for one more all-gather (Megatron-LM's choice too).
#[derive(Debug)]
pub struct LinearSaved {
    x: Tensor,
    /// Whether `x` is this rank's slice of the sequence, to be gathered
    /// again before the weight gradient.
    gather_again: bool,
}

impl LinearSaved {
    /// Bytes of activation memory held.
    pub fn bytes(&self) -> usize {
        super::bytes_of(&self.x)
    }
}

impl Linear {
    /// A layer from `in_features` to `out_features`, with a bias when `bias` is true.
    pub fn new(in_features: usize, out_features: usize, bias: bool) -> Result<Linear> {
        if in_features == 0 || out_features == 0 {
            return Err(Error::invalid("Linear::new", format!("in_features ({in_features}) and out_features ({out_features}) must both be positive")));
        }
        Ok(Linear {
            in_features,
            out_features,
            valid_outputs: out_features,
            weight: Param::new_quantizable([out_features, in_features], Init::Normal { mean: 0.0, std: 0.02 }),
            bias: bias.then(|| Param::new([out_features], Init::Normal { mean: 0.0, std: 0.0 })),
        })
    }

    /// Number of input features (global).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Number of output features (global).
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Marks the outputs from `valid` on as padding: as a vocab-parallel head
    /// (`#[shard(vocab)]`) the layer sets their logits to −∞, so they never
    /// win a softmax or a sample, take no probability in a cross-entropy and
    /// get no gradient from one. This is how a vocabulary is padded to a size
    /// the tensor-parallel degree divides (GPT-2's 50 257 to 50 304).
    pub fn with_valid_outputs(mut self, valid: usize) -> Result<Linear> {
        if valid == 0 || valid > self.out_features {
            return Err(Error::invalid(
                "Linear::with_valid_outputs",
                format!("{valid} valid outputs of {}; pass 1..={}", self.out_features, self.out_features),
            ));
        }
        self.valid_outputs = valid;
        Ok(self)
    }

    /// Outputs that are not padding (all of them unless
    /// [`with_valid_outputs`](Self::with_valid_outputs) said otherwise).
    pub fn valid_outputs(&self) -> usize {
        self.valid_outputs
    }

    /// `y` (this rank's `local` columns of the outputs, starting at `first`)
    /// with the padding columns set to −∞.
    fn mask_padding(&self, y: Tensor, first: usize) -> Result<Tensor> {
        let local = *y.dims().last().expect("a linear output has a last dimension");
        if first + local <= self.valid_outputs {
            return Ok(y);
        }
        let mask: Vec<f32> = (first..first + local).map(|c| if c < self.valid_outputs { 0.0 } else { f32::NEG_INFINITY }).collect();
        let mask = Tensor::from_vec(mask, [local], y.device())?.to_dtype(y.dtype())?;
        ops::add_bias(&y, &mask)
    }

    /// The weight, `[out_features, in_features]`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// The bias, `[out_features]`, if the layer has one.
    pub fn bias(&self) -> Option<&Param> {
        self.bias.as_ref()
    }

    /// Shares `p` as this layer's weight (weight tying, e.g. an output head
    /// tied to the token embedding, whose table is `[vocab, dim]` like a
    /// `Linear::new(dim, vocab, ..)` weight).
    pub fn tie_weight(&mut self, p: &Param) -> Result<()> {
        let want = self.weight.global_shape();
        if p.global_shape() != want {
            return Err(Error::shape(
                "Linear::tie_weight",
                format!(
                    "the parameter has global shape {} but this layer's weight is {want} ([out_features, in_features]); tie only parameters of equal shape",
                    p.global_shape()
                ),
            ));
        }
        self.weight = p.clone();
        Ok(())
    }

    /// `x·Wᵀ (+ b when `with_bias`)`, keeping the input.
    fn fwd(&self, cx: &Cx, x: Tensor, with_bias: bool) -> Result<(Tensor, LinearSaved)> {
        if let Some(q) = self.weight.quantized() {
            return self.fwd_quantized(cx, x, &q, with_bias);
        }
        let (x, w, bias) = self.operands(cx, x, with_bias)?;
        if let Some(fp8) = cx.fp8() {
            // E4M3 input and weight; the input is kept as it came, and
            // quantized again (to the same codes) for the weight gradient.
            let layer = self.fp8_layer()?;
            let (xq, sx) = fp8.quantize(cx, &layer, Operand::Input, &x)?;
            let (wq, sw) = fp8.quantize(cx, &layer, Operand::Weight, &w)?;
            let y = fp8_product(&xq, Operand::Input, &wq.t()?, Operand::Weight, sx, sw)?;
            let y = match bias {
                Some(b) => ops::add_bias(&y, &b)?,
                None => y,
            };
            return Ok((y, LinearSaved { x, gather_again: false }));
        }
        let y = if cx.decode().is_some() {
            // Serving: each row's bits independent of the step's other rows.
            ops::matmul_rows_nt(&x, &w, bias.as_ref())?
        } else {
            match bias {
                Some(b) => ops::matmul_bias(&x, &w.t()?, &b)?,
                None => ops::matmul(&x, &w.t()?)?,
            }
        };
        Ok((y, LinearSaved { x, gather_again: false }))
    }

    /// The input in the weight's dtype, the weight and the bias (`None`
    /// unless `with_bias`), each parameter read once.
    fn operands(&self, cx: &Cx, x: Tensor, with_bias: bool) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let w = cx.param(&self.weight)?;
        self.check_input(&x, w.dims()[1])?;
        let x = if x.dtype() == w.dtype() { x } else { x.to_dtype(w.dtype())? };
        // Every rank reads the bias so every rank's backward delivers its gradient.
        let bias = self.bias.as_ref().map(|b| cx.param(b)).transpose()?;
        Ok((x, w, bias.filter(|_| with_bias)))
    }

    /// The number of pieces to cut the sequence-parallel collectives beside
    /// this layer's products into ([`Cx::with_tp_overlap`]), for a training
    /// step with a float weight and an input of `[batch, seq, ..]`.
    fn overlap(&self, cx: &Cx, x: &Tensor) -> Option<usize> {
        cx.tp_overlap().filter(|_| self.weight.quantized().is_none() && cx.decode().is_none() && x.rank() >= 3)
    }

    /// The forward with a quantized weight (inference): `x·dequant(W)ᵀ (+ b)`
    /// in the compute dtype, from the codes. The weight records no use, as
    /// no gradient will come back for it.
    fn fwd_quantized(&self, cx: &Cx, x: Tensor, q: &QuantizedWeight, with_bias: bool) -> Result<(Tensor, LinearSaved)> {
        self.check_input(&x, q.in_features())?;
        let x = if x.dtype() == cx.compute_dtype() { x } else { x.to_dtype(cx.compute_dtype())? };
        let bias = self.bias.as_ref().map(|b| cx.param(b)).transpose()?;
        let bias = bias.filter(|_| with_bias);
        let y = if cx.decode().is_some() {
            // Serving: each row's bits independent of the step's other rows.
            ops::quant_matmul_rows(&x, q, bias.as_ref())?
        } else {
            ops::quant_matmul(&x, q, bias.as_ref())?
        };
        Ok((y, LinearSaved { x, gather_again: false }))
    }

    fn check_input(&self, x: &Tensor, in_local: usize) -> Result<()> {
        if x.rank() < 2 || x.dims().last() != Some(&in_local) {
            return Err(Error::shape(
                "Linear",
                format!(
                    "input of shape {} for a layer taking {in_local} input features on this rank ({} in total); pass a tensor of rank 2 or more whose last dimension is {in_local}",
                    x.shape(),
                    self.in_features
                ),
            ));
        }
        Ok(())
    }

    /// Delivers `dW` (and `db`) and returns this rank's `dX` (before any reduction).
    fn bwd(&self, cx: &Cx, saved: LinearSaved, dy: &Tensor) -> Result<Tensor> {
        let dx = self.input_grad(cx, dy)?;
        self.weight_grad(cx, &saved.x, dy)?;
        Ok(dx)
    }

    /// This rank's `dX = dY·W` (before any reduction).
    fn input_grad(&self, cx: &Cx, dy: &Tensor) -> Result<Tensor> {
        let w = self.backward_weight(cx)?;
        if let Some(fp8) = cx.fp8() {
            // An E5M2 gradient by the E4M3 weight of the forward.
            let layer = self.fp8_layer()?;
            let (dyq, sdy) = fp8.quantize(cx, &layer, Operand::Grad, dy)?;
            let w = if w.dtype() == dy.dtype() { w } else { w.to_dtype(dy.dtype())? };
            let (wq, sw) = fp8.quantize(cx, &layer, Operand::Weight, &w)?;
            return fp8_product(&dyq, Operand::Grad, &wq, Operand::Weight, sdy, sw);
        }
        ops::matmul(dy, &w)
    }

    /// The name this layer's FP8 scales go by: its weight's.
    fn fp8_layer(&self) -> Result<String> {
        self.weight.name().ok_or_else(|| {
            Error::state_mismatch("Linear", "FP8 keeps its scales by parameter name and this weight has none; build the model with `module::build`")
        })
    }

    /// Under FP8, what a product cut into pieces needs before its first
    /// piece: the weight's codes (once for every piece) and the scale of the
    /// operand `cut` that the pieces come from, taken from the `whole` of it
    /// as the uncut product takes it (the same calls in the same order on
    /// every rank).
    fn piece_fp8(&self, cx: &Cx, cut: Operand, whole: &Tensor, w: &Tensor) -> Result<Option<PieceFp8>> {
        let Some(fp8) = cx.fp8() else { return Ok(None) };
        let layer = self.fp8_layer()?;
        let scale = fp8.scale_for(cx, &layer, cut, whole)?;
        let (wq, sw) = fp8.quantize(cx, &layer, Operand::Weight, w)?;
        Ok(Some(PieceFp8 { layer, cut, scale, wq, sw }))
    }

    /// One piece's product with this rank's weight: `piece·Wᵀ (+ b)`, or,
    /// backward (`transposed` false), `piece·W`; under FP8 (`fp8`) from the
    /// piece's codes at the whole operand's scale.
    fn piece_product(&self, cx: &Cx, piece: &Tensor, w: &Tensor, transposed: bool, bias: Option<&Tensor>, fp8: Option<&PieceFp8>) -> Result<Tensor> {
        if let Some((p, state)) = fp8.zip(cx.fp8()) {
            let (q, s) = state.quantize_at(&p.layer, p.cut, piece, p.scale)?;
            let wq = if transposed { p.wq.t()? } else { p.wq.clone() };
            let y = fp8_product(&q, p.cut, &wq, Operand::Weight, s, p.sw)?;
            return match bias {
                Some(b) => ops::add_bias(&y, b),
                None => Ok(y),
            };
        }
        let w = if transposed { w.t()? } else { w.clone() };
        match bias {
            Some(b) => ops::matmul_bias(piece, &w, b),
            None => ops::matmul(piece, &w),
        }
    }

    /// The weight the input gradient multiplies by.
    fn backward_weight(&self, cx: &Cx) -> Result<Tensor> {
        if let Some(q) = self.weight.quantized() {
            return Err(Error::unsupported(
                "Linear",
                format!(
                    "`{}` holds a {} quantized weight, which is for inference only: its backward needs the float weight; train the model unquantized and quantize it afterwards",
                    self.weight.name().as_deref().unwrap_or("weight"),
                    q.format()
                ),
            ));
        }
        param_value(cx, &self.weight)
    }

    /// Delivers `dW = dYᵀ·X` (and `db`) for the input `x` the forward saw,
    /// or puts the computation aside for a split backward's weight half
    /// ([`Cx::weight_grad`]).
    fn weight_grad(&self, cx: &Cx, x: &Tensor, dy: &Tensor) -> Result<()> {
        let (weight, bias, x, dy) = (self.weight.clone(), self.bias.clone(), x.clone(), dy.clone());
        let fp8_layer = cx.fp8().map(|_| self.fp8_layer()).transpose()?;
        cx.weight_grad(move |cx| {
            let (n_in, n_out) = (x.dims()[x.rank() - 1], dy.dims()[dy.rank() - 1]);
            let rows = x.elem_count() / n_in;
            let dw = match (cx.fp8(), &fp8_layer) {
                // The E5M2 gradient by the E4M3 input of the forward.
                (Some(fp8), Some(layer)) => {
                    let (dyq, sdy) = fp8.quantize(cx, layer, Operand::Grad, &dy)?;
                    let (xq, sx) = fp8.quantize(cx, layer, Operand::Input, &x)?;
                    let xq = if xq.dtype() == dyq.dtype() { xq } else { xq.to_dtype(dyq.dtype())? };
                    fp8_product(&dyq.reshape([rows, n_out])?.t()?, Operand::Grad, &xq.reshape([rows, n_in])?, Operand::Input, sdy, sx)?
                }
                _ => ops::matmul(&dy.reshape([rows, n_out])?.t()?, &x.reshape([rows, n_in])?)?,
            };
            cx.grad(&weight, dw)?;
            if let Some(b) = &bias {
                cx.grad(b, ops::bias_grad(&dy)?)?;
            }
            Ok(())
        })
    }

    /// The costs of `x·Wᵀ` with this rank's `[n, k]` block of the weight:
    /// the input kept, `k`-wide in, `n`-wide out.
    fn describe_local(&self, d: &mut Describe, x: Activation, k: usize, n: usize) -> Result<Activation> {
        d.save(&x);
        self.describe_product(d, x, k, n)
    }

    /// [`describe_local`](Self::describe_local) less the input kept (for a
    /// caller that keeps something else).
    fn describe_product(&self, d: &mut Describe, x: Activation, k: usize, n: usize) -> Result<Activation> {
        if x.width != k {
            return Err(Error::shape(
                "Linear",
                format!("an input of {} features per token on a rank for a layer taking {k} there (of {} in all)", x.width, self.in_features),
            ));
        }
        d.matmul(&x, k, n);
        let y = d.output(n, x.tokens);
        if self.bias.is_some() {
            // The bias's gradient reads the output's gradient once more.
            d.traffic(0.0, y.bytes());
        }
        Ok(y)
    }

    /// `features` split over the tensor-parallel group, or the error the forward gives.
    fn split_over(d: &Describe, features: usize, what: &str) -> Result<usize> {
        let tp = d.tp();
        if !features.is_multiple_of(tp) {
            return Err(Error::indivisible(
                "Linear",
                format!("{features} {what} cannot be split over a tensor-parallel group of {tp}; choose a degree that divides it"),
            ));
        }
        Ok(features / tp)
    }

    /// A column-parallel (or vocabulary-parallel) layer's costs: the input
    /// gathered under sequence parallelism, its gradient reduced over the group.
    fn describe_column(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        let n = Self::split_over(d, self.out_features, "output features")?;
        if d.sequence_split() {
            // The slice is kept and gathered again in the backward, while
            // the input gradient's product runs.
            let whole = d.seq_convert::<Replicated>(x, Seq::Split, Seq::Whole);
            let input_grad_flops = 2.0 * (self.in_features * n) as f64 * whole.tokens;
            d.collective_beside(CollectiveKind::AllGather, Group::Tp, Pass::Backward, whole.bytes(), input_grad_flops);
            d.collective(CollectiveKind::ReduceScatter, Group::Tp, Pass::Backward, whole.bytes());
            d.save(&x);
            return self.describe_product(d, whole, self.in_features, n);
        }
        d.collective(CollectiveKind::AllReduce, Group::Tp, Pass::Backward, x.bytes());
        self.describe_local(d, x, self.in_features, n)
    }

    fn visit_split(&self, v: &mut Visitor<'_>, weight_dim: usize, bias_dim: Option<usize>) -> Result<()> {
        v.param("weight", &self.weight, Some(weight_dim))?;
        if let Some(b) = &self.bias {
            v.param("bias", b, bias_dim)?;
        }
        Ok(())
    }
}

/// What every piece of an FP8 product cut into pieces shares
/// ([`Linear::piece_fp8`]).
struct PieceFp8 {
    /// The layer's FP8 name.
    layer: String,
    /// The operand cut into pieces.
    cut: Operand,
    /// Its scale, from the whole.
    scale: f32,
    /// The weight's codes and scale.
    wq: Tensor,
    sw: f32,
}

/// `a · b` of FP8 operands (`a`'s and `b`'s codes' values, at scales `sa`
/// and `sb`), unscaled: the FP8 tensor cores where the device has them
/// ([`ops::matmul_fp8`]), else the emulation.
fn fp8_product(a: &Tensor, fa: Operand, b: &Tensor, fb: Operand, sa: f32, sb: f32) -> Result<Tensor> {
    ops::matmul_fp8(a, fa.format(), b, fb.format(), 1.0 / (f64::from(sa) * f64::from(sb)))
}

/// Each token on its own: under sequence parallelism it maps this rank's
/// slice of the tokens, and the weight's gradient (a sum over tokens) is
/// completed over the group by [`Cx::grad`].
impl Module<Plain> for Linear {
    type In = Replicated;
    type Out = Replicated;
    type Saved = LinearSaved;
    const SEQ_IN: Seq = Seq::Split;
    const SEQ_OUT: Seq = Seq::Split;

    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<Replicated>, LinearSaved)> {
        let (y, s) = self.fwd(cx, x.into_tensor(), true)?;
        Ok((Act::new(y), s))
    }

    fn backward(&self, cx: &mut Cx, saved: LinearSaved, dy: Act<Replicated>) -> Result<Act<Replicated>> {
        Ok(Act::new(self.bwd(cx, saved, dy.tensor())?))
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()> {
        self.visit_split(v, 0, Some(0))
    }

    fn describe(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        let (weight, bias) = (self.in_features * self.out_features, self.bias.as_ref().map(|_| self.out_features));
        d.replicated_grads(&std::iter::once(weight).chain(bias).collect::<Vec<_>>());
        self.describe_local(d, x, self.in_features, self.out_features)
    }
}

impl Module<Column> for Linear {
    type In = Replicated;
    type Out = SplitHidden;
    type Saved = LinearSaved;
    const SEQ_IN: Seq = Seq::Split;

    /// Under sequence parallelism the input is this rank's slice of the
    /// sequence: it is all-gathered first, and the input gradient (partial
    /// over the group) is reduce-scattered back to the slices.
    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<SplitHidden>, LinearSaved)> {
        let x = x.into_tensor();
        if !cx.sequence_split() {
            let (y, s) = self.fwd(cx, x, true)?;
            return Ok((Act::new(y), s));
        }
        if self.overlap(cx, &x).is_some() {
            // The own slice's product runs while the others' slices travel.
            // The slice is cast before it travels (the same values as
            // casting the gathered sequence) and kept as cast.
            let (x, w, bias) = self.operands(cx, x, true)?;
            // Under FP8 the input's scale comes from this rank's slice: over
            // the group, the amax of the gathered sequence.
            let fp8 = self.piece_fp8(cx, Operand::Input, &x, &w)?;
            let cx = &*cx;
            let (y, _) = crate::module::overlap::gather_map(cx, &x, false, |part| self.piece_product(cx, part, &w, true, bias.as_ref(), fp8.as_ref()))?;
            return Ok((Act::new(y), LinearSaved { x, gather_again: true }));
        }
        let (y, s) = self.fwd(cx, crate::module::seq::gather(cx, &x)?, true)?;
        // Keep the slice (the caller's own tensor where the dtypes agree,
        // else the cast slice), not the whole sequence.
        let x = if x.dtype() == s.x.dtype() { x } else { crate::module::seq::slice(cx, &s.x)? };
        Ok((Act::new(y), LinearSaved { x, gather_again: true }))
    }

    fn backward(&self, cx: &mut Cx, saved: LinearSaved, dy: Act<SplitHidden>) -> Result<Act<Replicated>> {
        if let Some(pieces) = self.overlap(cx, dy.tensor()).filter(|_| saved.gather_again) {
            // The slice travels first, then each piece of `dX = dY·W` as it
            // is computed; `dW` waits for the slice and runs while the last
            // pieces of `dX` travel.
            let x = cx.tp().all_gather_async(&saved.x, 1)?;
            let w = self.backward_weight(cx)?;
            let w = if cx.fp8().is_some() && w.dtype() != dy.tensor().dtype() { w.to_dtype(dy.tensor().dtype())? } else { w };
            let fp8 = self.piece_fp8(cx, Operand::Grad, dy.tensor(), &w)?;
            let dx = crate::module::overlap::map_reduce_scatter(cx, dy.tensor(), pieces, |piece| self.piece_product(cx, piece, &w, false, None, fp8.as_ref()))?;
            self.weight_grad(cx, &x.wait()?, dy.tensor())?;
            return Ok(Act::new(dx.wait()?));
        }
        let dx = if saved.gather_again {
            // The slice is gathered again while `dX = dY·W` runs, which
            // does not need it; the weight gradient waits for it.
            let x = cx.tp().all_gather_async(&saved.x, 1)?;
            let dx = self.input_grad(cx, dy.tensor())?;
            self.weight_grad(cx, &x.wait()?, dy.tensor())?;
            dx
        } else {
            self.bwd(cx, saved, dy.tensor())?
        };
        if cx.sequence_split() {
            Ok(Act::new(cx.tp().reduce_scatter_sum(&dx, 1)?))
        } else {
            Ok(Act::new(cx.tp().all_reduce_sum(&dx)?))
        }
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()> {
        self.visit_split(v, 0, Some(0))
    }

    fn describe(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        self.describe_column(d, x)
    }
}

impl Module<Row> for Linear {
    type In = SplitHidden;
    type Out = PartialSum;
    type Saved = LinearSaved;

    /// Under sequence parallelism with [`Cx::with_tp_overlap`], the output
    /// is computed slice by slice, each other rank's slice sent to it while
    /// the next is computed and this rank's own last; the `all_reduce` the
    /// caller applies to it sums this rank's slice.
    fn forward(&self, cx: &mut Cx, x: Act<SplitHidden>) -> Result<(Act<PartialSum>, LinearSaved)> {
        let first = cx.tp().rank() == 0;
        let x = x.into_tensor();
        if self.overlap(cx, &x).is_some() && x.dims()[1].is_multiple_of(cx.tp().size()) {
            let (x, w, bias) = self.operands(cx, x, first)?;
            let fp8 = self.piece_fp8(cx, Operand::Input, &x, &w)?;
            let sum = crate::module::overlap::map_scatter_sum(cx, &x, |part| self.piece_product(cx, part, &w, true, bias.as_ref(), fp8.as_ref()))?;
            let y = sum.summand()?;
            cx.start_reduction(crate::module::overlap::InFlight { value: y.clone(), sum });
            return Ok((Act::new(y), LinearSaved { x, gather_again: false }));
        }
        let (y, s) = self.fwd(cx, x, first)?;
        Ok((Act::new(y), s))
    }

    fn backward(&self, cx: &mut Cx, saved: LinearSaved, dy: Act<PartialSum>) -> Result<Act<SplitHidden>> {
        Ok(Act::new(self.bwd(cx, saved, dy.tensor())?))
    }

    /// Under sequence parallelism with [`Cx::with_tp_overlap`], `dy` is
    /// this rank's slice of the reduced output's gradient: `dX = dY·W` of
    /// that slice runs while the other slices are gathered, then theirs,
    /// and `dW` from the whole gradient. (Under FP8 the gradient's scale
    /// needs the whole gradient first, so it is gathered before.)
    fn backward_gathering(&self, cx: &mut Cx, saved: LinearSaved, dy: Act<Replicated>) -> Result<Act<SplitHidden>> {
        if self.overlap(cx, dy.tensor()).is_none() || cx.fp8().is_some() {
            let dy = crate::module::dsl::all_reduce_backward(cx, dy)?;
            return <Linear as Module<Row>>::backward(self, cx, saved, dy);
        }
        let w = self.backward_weight(cx)?;
        let (dx, dy) = crate::module::overlap::gather_map(cx, dy.tensor(), true, |part| self.piece_product(cx, part, &w, false, None, None))?;
        self.weight_grad(cx, &saved.x, &dy.expect("kept"))?;
        Ok(Act::new(dx))
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()> {
        self.visit_split(v, 1, None)
    }

    fn describe(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        let k = Self::split_over(d, self.in_features, "input features")?;
        self.describe_local(d, x, k, self.out_features)
    }
}

/// The vocab-parallel output head is a column-parallel product whose
/// columns are vocabulary entries: the same layouts and the same work.
impl Module<Vocab> for Linear {
    type In = Replicated;
    type Out = SplitHidden;
    type Saved = LinearSaved;
    const SEQ_IN: Seq = Seq::Split;

    /// In a serving step whose state names the rows to sample
    /// ([`Decode::logit_rows`](crate::module::Decode)), only those rows'
    /// logits are computed, `[1, rows, vocab]`.
    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<SplitHidden>, LinearSaved)> {
        let x = match cx.decode().and_then(|d| d.logit_rows.as_ref().map(|r| (d, r))) {
            Some((d, rows)) => {
                d.check_tokens("Linear (vocabulary head)", x.tensor())?;
                let x = x.into_tensor();
                let width = *x.dims().last().expect("checked rank");
                let table = x.reshape([d.batch.tokens(), width])?;
                let ids = Tensor::from_vec(rows.clone(), [1, rows.len()], cx.device())?;
                Act::new(ops::embedding(&table, &ids)?)
            }
            None => x,
        };
        // The head stays out of FP8: the logits keep the compute dtype's precision.
        let (y, saved) = cx.without_fp8(|cx| <Self as Module<Column>>::forward(self, cx, x))?;
        let y = y.into_tensor();
        let first = cx.tp().rank() * y.dims().last().copied().unwrap_or(0);
        Ok((Act::new(self.mask_padding(y, first)?), saved))
    }

    fn backward(&self, cx: &mut Cx, saved: LinearSaved, dy: Act<SplitHidden>) -> Result<Act<Replicated>> {
        cx.without_fp8(|cx| <Self as Module<Column>>::backward(self, cx, saved, dy))
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()> {
        <Self as Module<Column>>::visit_params(self, v)
    }

    fn describe(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        self.describe_column(d, x)
    }
}
