//! Learned absolute position embedding, added to the activations (GPT-2's `wpe`).

use crate::module::{Act, Activation, Cx, Describe, Module, Param, Plain, Replicated, Seq, Visitor};
use tessera_core::ops;
use tessera_core::tensor::{Init, Tensor};
use tessera_core::{Error, Result};

/// A table of `max_positions` learned rows of `dim` values; the forward adds
/// row `p` to the activation of the token at position `p`.
///
/// The table has the global shape `[max_positions, dim]` and starts
/// Normal(0, 0.02). `Replicated → Replicated` on `[batch, seq, dim]`
/// activations; positions are `0..seq`. The table is replicated over the
/// tensor-parallel group. Under sequence parallelism each rank holds a slice
/// of the sequence, so rank `r` adds the rows of positions
/// `r·seq_local .. (r+1)·seq_local`, and the table's gradient (each rank's
/// rows) is summed over the group. Under context parallelism a rank's
/// tokens are its chunks of the sequence ([`Cx::token_positions`]), and it
/// adds their rows.
///
/// It keeps nothing for its backward but the batch size and the tokens'
/// positions: the input gradient is the upstream gradient, and the table's
/// gradient is the upstream gradient summed over the batch into the rows
/// that were read.
///
/// ```
/// use tessera::module::{materialize, Act, Cx, Module};
/// use tessera::nn::PositionEmbedding;
/// use tessera::{DType, Device, Tensor};
///
/// let dev = Device::cpu();
/// let cx = &mut Cx::new(dev.clone());
/// let wpe = PositionEmbedding::new(16, 4)?;
/// materialize(&wpe, cx)?;
/// let x = Tensor::zeros([2, 5, 4], DType::F32, &dev)?;
/// let (y, saved) = wpe.forward(cx, Act::new(x))?;
/// // Zero activations plus the rows of positions 0..5.
/// let table = wpe.weight().value()?.narrow(0, 0, 5)?.to_f32_vec()?;
/// assert_eq!(&y.tensor().to_f32_vec()?[..20], &table[..]);
/// let dx = wpe.backward(cx, saved, y)?;
/// assert_eq!(dx.tensor().dims(), &[2, 5, 4]);
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Debug)]
pub struct PositionEmbedding {
    max_positions: usize,
    dim: usize,
    weight: Param,
}

/// What a [`PositionEmbedding`] keeps for its backward: the batch size and
/// the tokens' positions (no activation memory).
#[derive(Debug)]
pub struct PositionEmbeddingSaved {
    batch: usize,
    positions: Vec<u32>,
}

impl PositionEmbeddingSaved {
    /// Bytes of activation memory held: none.
    pub fn bytes(&self) -> usize {
        0
    }
}

impl PositionEmbedding {
    /// A table for sequences of up to `max_positions` tokens of width `dim`.
    pub fn new(max_positions: usize, dim: usize) -> Result<PositionEmbedding> {
        if max_positions == 0 || dim == 0 {
            return Err(Error::invalid("PositionEmbedding::new", format!("max_positions ({max_positions}) and dim ({dim}) must both be positive")));
        }
        if max_positions > u32::MAX as usize {
            return Err(Error::invalid("PositionEmbedding::new", format!("{max_positions} positions do not fit u32 indices; use at most {}", u32::MAX)));
        }
        Ok(PositionEmbedding { max_positions, dim, weight: Param::new([max_positions, dim], Init::Normal { mean: 0.0, std: 0.02 }) })
    }

    /// The longest sequence the table covers.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Width of a row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The table, `[max_positions, dim]`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// A serving step (see [`Decode`](crate::module::Decode)): the rows of the tokens' positions.
    fn decode_step(&self, cx: &Cx, dec: &crate::module::Decode, x: Tensor) -> Result<Tensor> {
        dec.check_tokens("PositionEmbedding", &x)?;
        let positions = &dec.batch.positions;
        if let Some(p) = positions.iter().find(|&&p| p as usize >= self.max_positions) {
            return Err(Error::invalid(
                "PositionEmbedding",
                format!("position {p} is past a table of {} positions; keep prompt and output within the model's context", self.max_positions),
            ));
        }
        let ids = Tensor::from_vec(positions.clone(), [1, positions.len()], cx.device())?;
        let rows = ops::embedding(&cx.param(&self.weight)?, &ids)?;
        let x = if x.dtype() == rows.dtype() { x } else { x.to_dtype(rows.dtype())? };
        ops::add(&x, &rows)
    }

    /// The position of every token, `[batch, seq]` as u32 row indices.
    fn positions(&self, s: &PositionEmbeddingSaved, cx: &Cx) -> Result<Tensor> {
        let ids: Vec<u32> = (0..s.batch).flat_map(|_| s.positions.iter().copied()).collect();
        Tensor::from_vec(ids, [s.batch, s.positions.len()], cx.device())
    }
}

/// Per token: under sequence parallelism it adds the rows of this rank's positions.
impl Module<Plain> for PositionEmbedding {
    type In = Replicated;
    type Out = Replicated;
    type Saved = PositionEmbeddingSaved;
    const SEQ_IN: Seq = Seq::Split;
    const SEQ_OUT: Seq = Seq::Split;

    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<Replicated>, PositionEmbeddingSaved)> {
        const OP: &str = "PositionEmbedding";
        let x = x.into_tensor();
        let &[batch, seq, dim] = x.dims() else {
            return Err(Error::shape(OP, format!("input of shape {}; pass [batch, seq, {}] activations", x.shape(), self.dim)));
        };
        if dim != self.dim {
            return Err(Error::shape(OP, format!("input of shape {} for rows of width {}; the last dimension must be {}", x.shape(), self.dim, self.dim)));
        }
        if let Some(dec) = cx.decode() {
            return self.decode_step(cx, dec, x).map(|y| (Act::new(y), PositionEmbeddingSaved { batch: 0, positions: Vec::new() }));
        }
        // This rank's slice of the sequence (sequence parallelism) or chunks of it (context parallelism).
        let positions = cx.token_positions(seq, true)?;
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= self.max_positions) {
            return Err(Error::invalid(
                OP,
                format!("position {p} does not fit a table of {} positions; feed sequences of at most {} tokens", self.max_positions, self.max_positions),
            ));
        }
        let saved = PositionEmbeddingSaved { batch, positions };
        let table = cx.param(&self.weight)?;
        let rows = ops::embedding(&table, &self.positions(&saved, cx)?)?;
        let x = if x.dtype() == rows.dtype() { x } else { x.to_dtype(rows.dtype())? };
        Ok((Act::new(ops::add(&x, &rows)?), saved))
    }

    fn backward(&self, cx: &mut Cx, saved: PositionEmbeddingSaved, dy: Act<Replicated>) -> Result<Act<Replicated>> {
        let (b, t) = (saved.batch, saved.positions.len());
        if dy.tensor().dims() != [b, t, self.dim] {
            return Err(Error::shape(
                "PositionEmbedding::backward",
                format!("upstream gradient {} for an output of [{b}, {t}, {}]", dy.tensor().shape(), self.dim),
            ));
        }
        let positions = self.positions(&saved, cx)?;
        let g = ops::embedding_backward(&positions, dy.tensor(), self.max_positions, 0, self.max_positions)?;
        cx.grad(&self.weight, g)?;
        Ok(dy)
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()> {
        v.param("weight", &self.weight, None)
    }

    /// Keeps nothing but the positions; one add each way.
    fn describe(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        if x.width != self.dim {
            return Err(Error::shape("PositionEmbedding", format!("an input of {} features per token for rows of width {}", x.width, self.dim)));
        }
        if d.settings().seq_len > self.max_positions {
            return Err(Error::invalid(
                "PositionEmbedding",
                format!("sequences of {} tokens do not fit a table of {} positions", d.settings().seq_len, self.max_positions),
            ));
        }
        let y = d.output(self.dim, x.tokens);
        d.traffic(3.0 * y.bytes(), y.bytes());
        d.replicated_grads(&[self.max_positions * self.dim]);
        Ok(y)
    }
}
