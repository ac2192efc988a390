//! A mixture of SwiGLU experts with top-k routing (Mixtral style).

use super::{param_value, rows};
use crate::error::{Error, Result};
use crate::module::{Act, Cx, Module, Param, Plain, Replicated, Visitor};
use crate::ops;
use crate::tensor::{Init, Shape, Tensor};

/// A sparse mixture-of-experts MLP, Mixtral style: a linear router scores
/// every expert per token, each token goes to its `top_k` best experts, and
/// their outputs are mixed with the softmax of the selected scores.
///
/// Parameters (global shapes): `router.weight` `[experts, dim]` and, per
/// expert `e`, `experts.{e}.gate.weight` and `experts.{e}.up.weight`
/// `[hidden, dim]` and `experts.{e}.down.weight` `[dim, hidden]`; all start
/// Normal(0, 0.02), none has a bias. Expert `e` computes
/// `down(silu(gate(x)) · up(x))`.
///
/// `Replicated → Replicated` on inputs `[.., dim]`. The backward reaches the
/// router through the softmax of the selected scores; which experts are
/// selected is not differentiable. Every expert's weights are read and
/// receive a gradient each step (zeros for an expert no token chose), so the
/// set of gradients is the same on every rank.
///
/// Every rank runs every expert on its own tokens. Expert parallelism is
/// not part of this layer yet: it needs an all-to-all dispatch of the routed
/// tokens to the ranks holding their experts (and back), a per-expert
/// capacity with a policy for overflowing tokens, and the auxiliary
/// load-balancing loss.
///
/// ```
/// use tessera::module::{materialize, Act, Cx, Module};
/// use tessera::nn::Moe;
/// use tessera::{DType, Device, Tensor};
///
/// let dev = Device::cpu();
/// let cx = &mut Cx::new(dev.clone());
/// let moe = Moe::new(4, 8, 4, 2)?;
/// materialize(&moe, cx)?;
/// let x = Tensor::full(0.5, [2, 3, 4], DType::F32, &dev)?;
/// let (y, saved) = moe.forward(cx, Act::new(x))?;
/// assert_eq!(y.tensor().dims(), &[2, 3, 4]);
/// let _dx = moe.backward(cx, saved, y)?;
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Debug)]
pub struct Moe {
    dim: usize,
    hidden: usize,
    top_k: usize,
    router: Param,
    experts: Vec<Expert>,
}

#[derive(Debug)]
struct Expert {
    gate: Param,
    up: Param,
    down: Param,
}

/// What a [`Moe`] keeps for its backward: the input, the routing (the
/// selected experts `[n, top_k]` as u32 and their mixing weights `[n, top_k]`),
/// and per expert with tokens: the token and slot lists and the expert's
/// intermediate values for its `m` tokens: the gathered inputs `[m, dim]`,
/// the gate, up and gated products `[m, hidden]` each, and the output
/// `[m, dim]` before mixing. In total about `n·top_k·(2·dim + 3·hidden)`
/// values plus the input.
#[derive(Debug)]
pub struct MoeSaved {
    x: Tensor,
    shape: Shape,
    experts_idx: Tensor,
    weights: Tensor,
    per_expert: Vec<Option<ExpertSaved>>,
}

#[derive(Debug)]
struct ExpertSaved {
    /// The tokens routed to this expert (rows of the flattened input).
    tokens: Vec<u32>,
    /// Their slots in the flattened `[n, top_k]` routing.
    slots: Vec<u32>,
    xe: Tensor,
    gate: Tensor,
    up: Tensor,
    h: Tensor,
    /// The expert's output before mixing, `[m, 1, dim]`.
    o: Tensor,
    /// The mixing weights of its tokens, `[m, 1, 1]`.
    w: Tensor,
}

impl MoeSaved {
    /// Bytes of activation memory held (counting the input in full).
    pub fn bytes(&self) -> usize {
        use super::bytes_of;
        let experts: usize = self
            .per_expert
            .iter()
            .flatten()
            .map(|e| 8 * e.tokens.len() + [&e.xe, &e.gate, &e.up, &e.h, &e.o, &e.w].into_iter().map(bytes_of).sum::<usize>())
            .sum();
        bytes_of(&self.x) + bytes_of(&self.experts_idx) + bytes_of(&self.weights) + experts
    }
}

impl Moe {
    /// `experts` SwiGLU experts of width `hidden` on `dim`-wide tokens, each
    /// token routed to `top_k` of them.
    pub fn new(dim: usize, hidden: usize, experts: usize, top_k: usize) -> Result<Moe> {
        const OP: &str = "Moe::new";
        if dim == 0 || hidden == 0 || experts == 0 {
            return Err(Error::invalid(OP, format!("dim ({dim}), hidden ({hidden}) and experts ({experts}) must all be positive")));
        }
        if top_k == 0 || top_k > experts {
            return Err(Error::invalid(OP, format!("top_k must be in 1..={experts} (the number of experts), got {top_k}")));
        }
        let init = Init::Normal { mean: 0.0, std: 0.02 };
        Ok(Moe {
            dim,
            hidden,
            top_k,
            router: Param::new([experts, dim], init),
            experts: (0..experts)
                .map(|_| Expert { gate: Param::new([hidden, dim], init), up: Param::new([hidden, dim], init), down: Param::new([dim, hidden], init) })
                .collect(),
        })
    }

    /// Number of experts.
    pub fn experts(&self) -> usize {
        self.experts.len()
    }

    /// Width of a token.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Width of an expert's hidden layer.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The router weight, `[experts, dim]`.
    pub fn router(&self) -> &Param {
        &self.router
    }

    /// The weights `(gate, up, down)` of expert `e`.
    pub fn expert(&self, e: usize) -> Option<(&Param, &Param, &Param)> {
        self.experts.get(e).map(|x| (&x.gate, &x.up, &x.down))
    }
}

/// `a · bᵀ` for a weight `b` stored `[out, in]`.
fn linear(a: &Tensor, w: &Tensor) -> Result<Tensor> {
    ops::matmul(a, &w.t()?)
}

/// `(dyᵀ · a)`: the gradient of a `[out, in]` weight used as `a · wᵀ`.
fn weight_grad(dy: &Tensor, a: &Tensor) -> Result<Tensor> {
    ops::matmul(&dy.t()?, a)
}

impl Module<Plain> for Moe {
    type In = Replicated;
    type Out = Replicated;
    type Saved = MoeSaved;

    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<Replicated>, MoeSaved)> {
        let x = x.into_tensor();
        let shape = x.shape().clone();
        if shape.rank() < 1 || shape.dims().last() != Some(&self.dim) || x.elem_count() == 0 {
            return Err(Error::shape("Moe", format!("input of shape {shape} for a layer of width {}; pass a non-empty [.., {}] tensor", self.dim, self.dim)));
        }
        let n = x.elem_count() / self.dim;
        let (ne, k) = (self.experts.len(), self.top_k);
        let wr = cx.param(&self.router)?;
        let xf = x.reshape([n, self.dim])?;
        let xf = if xf.dtype() == wr.dtype() { xf } else { xf.to_dtype(wr.dtype())? };
        let logits = linear(&xf, &wr)?;
        let (top, idx) = ops::topk(&logits, k)?;
        let weights = ops::softmax(&top)?;
        // Route on the host: for each expert, its tokens and their slots in [n, k].
        let chosen = idx.to_vec::<u32>()?;
        let mut tokens = vec![Vec::new(); ne];
        let mut slots = vec![Vec::new(); ne];
        for (slot, &e) in chosen.iter().enumerate() {
            tokens[e as usize].push((slot / k) as u32);
            slots[e as usize].push(slot as u32);
        }
        let wflat = weights.reshape([n * k, 1])?;
        let mut y: Option<Tensor> = None;
        let mut per_expert = Vec::with_capacity(ne);
        for ((ex, tokens), slots) in self.experts.iter().zip(tokens).zip(slots) {
            let (wg, wu, wd) = (cx.param(&ex.gate)?, cx.param(&ex.up)?, cx.param(&ex.down)?);
            if tokens.is_empty() {
                per_expert.push(None);
                continue;
            }
            let m = tokens.len();
            let xe = rows::gather(&xf, &tokens)?;
            let gate = linear(&xe, &wg)?;
            let up = linear(&xe, &wu)?;
            let h = ops::swiglu(&gate, &up)?;
            let o = linear(&h, &wd)?.reshape([m, 1, self.dim])?;
            let w = rows::gather(&wflat, &slots)?.reshape([m, 1, 1])?;
            let mixed = ops::matmul(&w, &o)?.reshape([m, self.dim])?;
            let part = rows::scatter_add(&mixed, &tokens, n)?;
            y = Some(match y {
                None => part,
                Some(acc) => ops::add(&acc, &part)?,
            });
            per_expert.push(Some(ExpertSaved { tokens, slots, xe, gate, up, h, o, w }));
        }
        let y = y.ok_or_else(|| Error::invalid("Moe", "no token was routed"))?.reshape(shape.clone())?;
        Ok((Act::new(y), MoeSaved { x: xf, shape, experts_idx: idx, weights, per_expert }))
    }

    fn backward(&self, cx: &mut Cx, saved: MoeSaved, dy: Act<Replicated>) -> Result<Act<Replicated>> {
        let MoeSaved { x, shape, experts_idx, weights, per_expert } = saved;
        let (n, k, ne) = (x.dims()[0], self.top_k, self.experts.len());
        if per_expert.len() != ne {
            return Err(Error::invalid("Moe::backward", "the saved state does not come from this layer's forward"));
        }
        let dy = dy.into_tensor();
        if *dy.shape() != shape {
            return Err(Error::shape("Moe::backward", format!("upstream gradient {} for an output of {shape}", dy.shape())));
        }
        let dyf = dy.reshape([n, self.dim])?;
        let mut dx: Option<Tensor> = None;
        let mut dw: Option<Tensor> = None;
        let add = |acc: &mut Option<Tensor>, t: Tensor| -> Result<()> {
            *acc = Some(match acc.take() {
                None => t,
                Some(a) => ops::add(&a, &t)?,
            });
            Ok(())
        };
        for (ex, s) in self.experts.iter().zip(per_expert) {
            let Some(s) = s else {
                // No token chose this expert: its gradient is zero.
                for p in [&ex.gate, &ex.up, &ex.down] {
                    cx.grad(p, Tensor::zeros(p.local_shape(), cx.compute_dtype(), x.device())?)?;
                }
                continue;
            };
            let m = s.tokens.len();
            let (wg, wu, wd) = (param_value(cx, &ex.gate)?, param_value(cx, &ex.up)?, param_value(cx, &ex.down)?);
            let dmixed = rows::gather(&dyf, &s.tokens)?.reshape([m, 1, self.dim])?;
            let (dwe, do_) = ops::matmul_backward(&s.w, &s.o, &dmixed)?;
            let do_ = do_.reshape([m, self.dim])?;
            add(&mut dw, rows::scatter_add(&dwe.reshape([m, 1])?, &s.slots, n * k)?)?;
            let dh = ops::matmul(&do_, &wd)?;
            cx.grad(&ex.down, weight_grad(&do_, &s.h)?)?;
            let (dgate, dup) = ops::swiglu_backward(&s.gate, &s.up, &dh)?;
            cx.grad(&ex.gate, weight_grad(&dgate, &s.xe)?)?;
            cx.grad(&ex.up, weight_grad(&dup, &s.xe)?)?;
            let dxe = ops::add(&ops::matmul(&dgate, &wg)?, &ops::matmul(&dup, &wu)?)?;
            add(&mut dx, rows::scatter_add(&dxe, &s.tokens, n)?)?;
        }
        // Router: through the softmax of the selected scores, back to all scores.
        let dw = dw.ok_or_else(|| Error::invalid("Moe::backward", "no token was routed"))?.reshape([n, k])?;
        let dtop = ops::softmax_backward(&weights, &dw)?;
        let dlogits = ops::topk_backward(&experts_idx, &dtop, ne)?;
        let wr = param_value(cx, &self.router)?;
        cx.grad(&self.router, weight_grad(&dlogits, &x)?)?;
        add(&mut dx, ops::matmul(&dlogits, &wr)?)?;
        let dx = dx.ok_or_else(|| Error::invalid("Moe::backward", "no token was routed"))?;
        Ok(Act::new(dx.reshape(shape)?))
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()> {
        v.child::<Plain>("router", |v| v.param("weight", &self.router, None))?;
        v.child::<Plain>("experts", |v| {
            for (e, ex) in self.experts.iter().enumerate() {
                v.child::<Plain>(&e.to_string(), |v| {
                    v.child::<Plain>("gate", |v| v.param("weight", &ex.gate, None))?;
                    v.child::<Plain>("up", |v| v.param("weight", &ex.up, None))?;
                    v.child::<Plain>("down", |v| v.param("weight", &ex.down, None))
                })?;
            }
            Ok(())
        })
    }
}
