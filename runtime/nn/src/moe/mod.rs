//! A mixture of SwiGLU experts with top-k routing (Mixtral style), with a
//! per-expert capacity, the load-balancing loss, and expert parallelism.

mod dispatch;
mod routing;

pub use routing::MoeStats;

use super::{param_value, rows};
use crate::module::{Act, Activation, CollectiveKind, Cx, Describe, Group, Module, Param, Pass, Plain, Replicated, Visitor};
use dispatch::Plan;
use parking_lot::Mutex;
use std::ops::Range;
use tessera_core::ops;
use tessera_core::tensor::{Init, Shape, Tensor};
use tessera_core::{Error, Result};

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
/// router through the softmax of the selected scores (and through the
/// load-balancing loss when it is on); which experts are selected is not
/// differentiable. Every local expert's weights are read and receive a
/// gradient each step (zeros for an expert no token reached), so the set of
/// gradients does not depend on the routing.
///
/// # Capacity
///
/// [`with_capacity_factor(f)`](Self::with_capacity_factor) lets each expert
/// accept at most `capacity = ceil(f · tokens · top_k / experts)` slots (a
/// slot is one token's choice of one expert), where `tokens` is the number
/// of rows of **this rank's** input: each rank applies the capacity to its
/// own tokens, so an expert processes at most `ep · capacity` rows per
/// forward, and the drop decisions need no communication (a rank's output
/// does not depend on the other ranks' tokens). Slots are admitted by
/// priority: all first choices, in token order, then all second choices,
/// and so on. A dropped slot contributes nothing (the mixing weights are not
/// renormalised); a token that loses every slot gets a zero output, so the
/// residual connection around the layer carries it. The default capacity is
/// unlimited. Drops are counted in [`MoeStats`].
///
/// # Load-balancing loss
///
/// The Switch/Mixtral auxiliary loss of this rank's tokens,
/// `aux = E · Σ_e f_e · P_e`, where `f_e` is the fraction of slots the router
/// chose expert `e` for (before the capacity drops) and `P_e` is the mean,
/// over tokens, of the softmax over **all** `E` router logits. It is 1 for
/// perfectly uniform routing and at most `E`. Its value is always computed
/// and reported ([`MoeStats::aux_loss`]); with
/// [`with_aux_loss(coef)`](Self::with_aux_loss) the backward adds the
/// gradient of `coef · aux` to the router's (through `P_e`; `f_e` is
/// piecewise constant), as though `coef · aux` were added to the loss whose
/// gradient the backward receives. Scale `coef` as that loss is scaled
/// (averaging over microbatches, loss scaling).
///
/// # Expert parallelism
///
/// [`with_expert_parallel(rank, degree)`](Self::with_expert_parallel) makes
/// this layer hold only experts `rank·E/degree .. (rank+1)·E/degree` (rank
/// `rank` of an expert-parallel group of `degree`, the context's
/// `groups().ep`). The other experts' parameters do not exist on this rank:
/// [`visit_params`](Module::visit_params) reports only the local ones,
/// under their global names, so materialising allocates `E/degree` experts
/// and their initial values equal the single-rank layer's (values are drawn
/// per parameter name). Each rank routes its own tokens with its replica of
/// the router, sends each kept slot's token row to the rank holding its
/// expert with an uneven all-to-all, runs its local experts on the rows it
/// received, and returns the outputs with a second all-to-all; the source
/// rank mixes them. The backward sends the output gradients along the same
/// route and the input gradients back. With a degree of one no
/// communication happens and the layer is the single-rank one.
///
/// The router is replicated but sees different tokens on each rank: its
/// gradient here is this rank's tokens' part, and (like every non-expert
/// parameter) it must be summed over the expert-parallel group as well as
/// the data-parallel one. An expert's gradient already sums every rank's
/// tokens routed to it.
///
/// ```
/// use tessera::module::{materialize, Act, Cx, Module};
/// use tessera::nn::Moe;
/// use tessera::{DType, Device, Tensor};
///
/// let dev = Device::cpu();
/// let cx = &mut Cx::new(dev.clone());
/// let moe = Moe::new(4, 8, 4, 2)?.with_capacity_factor(1.25)?.with_aux_loss(0.01)?;
/// materialize(&moe, cx)?;
/// let x = Tensor::full(0.5, [2, 3, 4], DType::F32, &dev)?;
/// let (y, saved) = moe.forward(cx, Act::new(x))?;
/// assert_eq!(y.tensor().dims(), &[2, 3, 4]);
/// // Six equal tokens all choose the same two experts; each accepts
/// // ceil(1.25 · 6 · 2 / 4) = 4 of its 6 slots.
/// let stats = saved.stats().clone();
/// assert_eq!((stats.slots(), stats.capacity, stats.dropped_total()), (12, Some(4), 4));
/// let _dx = moe.backward(cx, saved, y)?;
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Debug)]
pub struct Moe {
    dim: usize,
    hidden: usize,
    top_k: usize,
    /// Experts in the whole layer (over all ranks of the ep group).
    total: usize,
    ep_rank: usize,
    ep_degree: usize,
    capacity_factor: Option<f64>,
    aux_coef: f64,
    router: Param,
    /// This rank's experts: global indices `ep_rank · local ..`.
    experts: Vec<Expert>,
    last: Mutex<Option<MoeStats>>,
}

#[derive(Debug)]
struct Expert {
    gate: Param,
    up: Param,
    down: Param,
}

/// What a [`Moe`] keeps for its backward: the input, the routing (the
/// selected experts `[n, top_k]` as u32, their mixing weights `[n, top_k]`,
/// and with the load-balancing loss on, the router probabilities `[n, E]`),
/// the slots this rank sent and the `s` expert outputs it got back
/// `[s, dim]`, the all-to-all plan, and per local expert for its `m`
/// received rows: the inputs `[m, dim]` and the gate, up and gated products
/// `[m, hidden]` each. Over the group, about `n·top_k·(2·dim + 3·hidden)`
/// values per rank plus the input, for balanced routing.
#[derive(Debug)]
pub struct MoeSaved {
    x: Tensor,
    shape: Shape,
    experts_idx: Tensor,
    weights: Tensor,
    /// Softmax over all logits, when the load-balancing loss is trained.
    probs: Option<Tensor>,
    /// The slots sent (in send order) and their tokens.
    slots: Vec<u32>,
    tokens: Vec<u32>,
    /// Mixing weights of the sent slots `[s, 1, 1]` and their expert outputs `[s, 1, dim]`.
    w: Option<Tensor>,
    o: Option<Tensor>,
    plan: Plan,
    /// The received rows regrouped expert by expert (see [`Plan::expert_order`]).
    order: Vec<u32>,
    per_expert: Vec<Option<ExpertSaved>>,
    stats: MoeStats,
}

#[derive(Debug)]
struct ExpertSaved {
    /// Where its rows start in the expert-by-expert order.
    start: usize,
    xe: Tensor,
    gate: Tensor,
    up: Tensor,
    h: Tensor,
}

impl MoeSaved {
    /// Bytes of activation memory held (counting the input in full).
    pub fn bytes(&self) -> usize {
        use super::bytes_of;
        let experts: usize = self.per_expert.iter().flatten().map(|e| [&e.xe, &e.gate, &e.up, &e.h].into_iter().map(bytes_of).sum::<usize>()).sum();
        let opt: usize = [&self.probs, &self.w, &self.o].into_iter().flatten().map(bytes_of).sum();
        bytes_of(&self.x)
            + bytes_of(&self.experts_idx)
            + bytes_of(&self.weights)
            + opt
            + 4 * (self.slots.len() + self.tokens.len() + self.order.len())
            + experts
    }

    /// What this forward routed and dropped, and its load-balancing loss.
    pub fn stats(&self) -> &MoeStats {
        &self.stats
    }
}

impl Moe {
    /// `experts` SwiGLU experts of width `hidden` on `dim`-wide tokens, each
    /// token routed to `top_k` of them; unlimited capacity, load-balancing
    /// loss reported but not trained, all experts on this rank.
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
            total: experts,
            ep_rank: 0,
            ep_degree: 1,
            capacity_factor: None,
            aux_coef: 0.0,
            router: Param::new([experts, dim], init),
            experts: (0..experts)
                .map(|_| Expert { gate: Param::new([hidden, dim], init), up: Param::new([hidden, dim], init), down: Param::new([dim, hidden], init) })
                .collect(),
            last: Mutex::new(None),
        })
    }

    /// Limits each expert to `ceil(factor · tokens · top_k / experts)` slots
    /// of this rank's tokens per forward (see the type's documentation);
    /// `factor` must be positive and finite. 1.0 is exactly the balanced
    /// load; 1.25 is a common choice.
    pub fn with_capacity_factor(mut self, factor: f64) -> Result<Moe> {
        if !(factor.is_finite() && factor > 0.0) {
            return Err(Error::invalid(
                "Moe::with_capacity_factor",
                format!("capacity factor {factor}: pass a positive finite number (1.0 is the balanced load; leave it unset for no limit)"),
            ));
        }
        self.capacity_factor = Some(factor);
        Ok(self)
    }

    /// Trains on the load-balancing loss with weight `coef` (0, the default,
    /// only reports it); `coef` must be non-negative and finite. Switch
    /// Transformers use 0.01.
    pub fn with_aux_loss(mut self, coef: f64) -> Result<Moe> {
        if !(coef.is_finite() && coef >= 0.0) {
            return Err(Error::invalid(
                "Moe::with_aux_loss",
                format!("coefficient {coef}: pass a non-negative finite number (0 turns the loss's gradient off)"),
            ));
        }
        self.aux_coef = coef;
        Ok(self)
    }

    /// Keeps only the experts of rank `rank` of an expert-parallel group of
    /// `degree` ranks: `rank·E/degree .. (rank+1)·E/degree`. Call it before
    /// materialising, with the context's `groups().ep` rank and size; the
    /// number of experts must be a multiple of `degree`.
    pub fn with_expert_parallel(mut self, rank: usize, degree: usize) -> Result<Moe> {
        const OP: &str = "Moe::with_expert_parallel";
        if self.ep_degree != 1 {
            return Err(Error::state_mismatch(OP, format!("the layer is already split over {} ranks; build a fresh layer to split it again", self.ep_degree)));
        }
        if degree == 0 || rank >= degree {
            return Err(Error::no_such_rank(OP, format!("rank {rank} of an expert-parallel group of {degree}: pass the group's rank and size (rank < size)")));
        }
        if !self.total.is_multiple_of(degree) {
            return Err(Error::indivisible(
                OP,
                format!("{} experts cannot be split evenly over an expert-parallel group of {degree} ranks; choose an ep degree that divides {}, or change the number of experts", self.total, self.total),
            ));
        }
        let local = self.total / degree;
        self.experts = self.experts.drain(rank * local..(rank + 1) * local).collect();
        self.ep_rank = rank;
        self.ep_degree = degree;
        Ok(self)
    }

    /// Number of experts (in the whole layer, over all ranks).
    pub fn experts(&self) -> usize {
        self.total
    }

    /// The global indices of the experts this rank holds.
    pub fn local_experts(&self) -> Range<usize> {
        let local = self.experts.len();
        self.ep_rank * local..(self.ep_rank + 1) * local
    }

    /// `(rank, degree)` of the expert-parallel split; `(0, 1)` when unsplit.
    pub fn expert_parallel(&self) -> (usize, usize) {
        (self.ep_rank, self.ep_degree)
    }

    /// The capacity factor, `None` for unlimited capacity.
    pub fn capacity_factor(&self) -> Option<f64> {
        self.capacity_factor
    }

    /// The load-balancing loss's coefficient (0: reported only).
    pub fn aux_coef(&self) -> f64 {
        self.aux_coef
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

    /// The weights `(gate, up, down)` of expert `e` (global index); `None`
    /// when `e` is out of range or held by another rank.
    pub fn expert(&self, e: usize) -> Option<(&Param, &Param, &Param)> {
        let local = self.local_experts();
        if !local.contains(&e) {
            return None;
        }
        self.experts.get(e - local.start).map(|x| (&x.gate, &x.up, &x.down))
    }

    /// The statistics of the latest forward on this rank (the same as that
    /// forward's [`MoeSaved::stats`]); `None` before the first.
    pub fn last_stats(&self) -> Option<MoeStats> {
        self.last.lock().clone()
    }

    /// The slots each expert accepts from `tokens` tokens, `None` if unlimited.
    pub fn capacity(&self, tokens: usize) -> Option<usize> {
        self.capacity_factor.map(|f| routing::capacity(f, tokens, self.top_k, self.total))
    }

    fn check_group(&self, cx: &Cx) -> Result<()> {
        let ep = &cx.groups().ep;
        if ep.size() != self.ep_degree || ep.rank() != self.ep_rank {
            return Err(Error::state_mismatch(
                "Moe",
                format!(
                    "the layer holds the experts of rank {} of an expert-parallel group of {}, but runs as rank {} of a group of {}; build it with `.with_expert_parallel({}, {})`",
                    self.ep_rank,
                    self.ep_degree,
                    ep.rank(),
                    ep.size(),
                    ep.rank(),
                    ep.size()
                ),
            ));
        }
        Ok(())
    }
}

/// `a · bᵀ` for a weight `b` stored `[out, in]`; batch-invariant in a
/// serving step (a token's expert output does not depend on how many other
/// tokens the expert got), as [`Linear`](crate::Linear) is.
fn linear(cx: &Cx, a: &Tensor, w: &Tensor) -> Result<Tensor> {
    if cx.decode().is_some() {
        return ops::matmul_rows_nt(a, w, None);
    }
    ops::matmul(a, &w.t()?)
}

/// `(dyᵀ · a)`: the gradient of a `[out, in]` weight used as `a · wᵀ`.
fn weight_grad(dy: &Tensor, a: &Tensor) -> Result<Tensor> {
    ops::matmul(&dy.t()?, a)
}

/// Joins `[m_i, d]` row blocks into `[Σ m_i, d]`.
fn concat_rows(parts: &[&Tensor], d: usize) -> Result<Tensor> {
    let rows: usize = parts.iter().map(|p| p.dims()[0]).sum();
    match parts {
        [one] => Ok((*one).clone()),
        _ => Tensor::concat_flat(parts)?.reshape([rows, d]),
    }
}

/// Places block rows (in the expert-by-expert `order`) back at their
/// positions in the received order; zero rows when there are none.
fn unpermute(blocks: &[Tensor], order: &[u32], d: usize, like: &Tensor) -> Result<Tensor> {
    if blocks.is_empty() {
        return Tensor::zeros([order.len(), d], like.dtype(), like.device());
    }
    let refs: Vec<&Tensor> = blocks.iter().collect();
    rows::scatter_add(&concat_rows(&refs, d)?, order, order.len())
}

impl Module<Plain> for Moe {
    type In = Replicated;
    type Out = Replicated;
    type Saved = MoeSaved;

    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<Replicated>, MoeSaved)> {
        self.check_group(cx)?;
        let x = x.into_tensor();
        let shape = x.shape().clone();
        if shape.rank() < 1 || shape.dims().last() != Some(&self.dim) || x.elem_count() == 0 {
            return Err(Error::shape("Moe", format!("input of shape {shape} for a layer of width {}; pass a non-empty [.., {}] tensor", self.dim, self.dim)));
        }
        let (d, k, ne) = (self.dim, self.top_k, self.total);
        let n = x.elem_count() / d;
        let ep = cx.groups().ep.clone();
        let wr = cx.param(&self.router)?;
        let xf = x.reshape([n, d])?;
        let xf = if xf.dtype() == wr.dtype() { xf } else { xf.to_dtype(wr.dtype())? };
        let logits = linear(cx, &xf, &wr)?;
        let (top, idx) = ops::topk(&logits, k)?;
        let weights = ops::softmax(&top)?;
        let probs = ops::softmax(&logits)?;

        // Route on the host: the kept slots of every expert, under the capacity.
        let capacity = self.capacity(n);
        let route = routing::route(&idx.to_vec::<u32>()?, k, ne, capacity);
        let aux_loss = routing::aux_loss(&probs.to_f64_vec()?, &route.routed, n);

        // Dispatch: the token rows of the kept slots, grouped by destination rank, then expert.
        let local = ne / self.ep_degree;
        let mut slots = Vec::new();
        let counts: Vec<Vec<usize>> = (0..self.ep_degree)
            .map(|q| {
                (q * local..(q + 1) * local)
                    .map(|e| {
                        slots.extend_from_slice(&route.kept[e]);
                        route.kept[e].len()
                    })
                    .collect()
            })
            .collect();
        let tokens: Vec<u32> = slots.iter().map(|&s| s / k as u32).collect();
        let plan = Plan::exchange(&*ep, counts, xf.device())?;
        let sent = if tokens.is_empty() { Tensor::zeros([0, d], xf.dtype(), xf.device())? } else { rows::gather(&xf, &tokens)? };
        let received = plan.dispatch(&*ep, &sent)?;

        // This rank's experts on the rows they received, expert by expert.
        let order = plan.expert_order();
        let by_expert = if order.is_empty() { None } else { Some(rows::gather(received.tensor(), &order)?) };
        let mut per_expert = Vec::with_capacity(self.experts.len());
        let mut outs = Vec::new();
        let mut start = 0;
        for (ex, m) in self.experts.iter().zip(plan.received_per_expert()) {
            let (wg, wu, wd) = (cx.param(&ex.gate)?, cx.param(&ex.up)?, cx.param(&ex.down)?);
            let Some(all) = by_expert.as_ref().filter(|_| m > 0) else {
                per_expert.push(None);
                continue;
            };
            let xe = all.narrow(0, start, m)?;
            let gate = linear(cx, &xe, &wg)?;
            let up = linear(cx, &xe, &wu)?;
            let h = ops::swiglu(&gate, &up)?;
            outs.push(linear(cx, &h, &wd)?);
            per_expert.push(Some(ExpertSaved { start, xe, gate, up, h }));
            start += m;
        }
        let outs = unpermute(&outs, &order, d, &xf)?;

        // Combine: the outputs return to their tokens' ranks and are mixed there.
        let o = plan.combine(&*ep, Act::new(outs))?;
        let s = slots.len();
        let (y, w, o) = if s == 0 {
            (Tensor::zeros([n, d], xf.dtype(), xf.device())?, None, None)
        } else {
            let w = rows::gather(&weights.reshape([n * k, 1])?, &slots)?.reshape([s, 1, 1])?;
            let o = o.reshape([s, 1, d])?;
            let mixed = ops::matmul(&w, &o)?.reshape([s, d])?;
            (rows::scatter_add(&mixed, &tokens, n)?, Some(w), Some(o))
        };

        let stats = MoeStats {
            tokens: n,
            capacity,
            routed: route.routed,
            dropped: route.dropped,
            received: plan.received_per_expert(),
            aux_loss,
            aux_coef: self.aux_coef,
        };
        *self.last.lock() = Some(stats.clone());
        let probs = (self.aux_coef != 0.0).then_some(probs);
        let saved = MoeSaved { x: xf, shape: shape.clone(), experts_idx: idx, weights, probs, slots, tokens, w, o, plan, order, per_expert, stats };
        Ok((Act::new(y.reshape(shape)?), saved))
    }

    fn backward(&self, cx: &mut Cx, saved: MoeSaved, dy: Act<Replicated>) -> Result<Act<Replicated>> {
        const OP: &str = "Moe::backward";
        let MoeSaved { x, shape, experts_idx, weights, probs, slots, tokens, w, o, plan, order, per_expert, stats } = saved;
        let (n, k, d, ne) = (x.dims()[0], self.top_k, self.dim, self.total);
        if per_expert.len() != self.experts.len() || stats.routed.len() != ne {
            return Err(Error::state_mismatch(OP, "the saved state does not come from this layer's forward"));
        }
        let dy = dy.into_tensor();
        if *dy.shape() != shape {
            return Err(Error::shape(OP, format!("upstream gradient {} for an output of {shape}", dy.shape())));
        }
        let ep = cx.groups().ep.clone();
        let dyf = dy.reshape([n, d])?;
        let zeros = |rows: usize, cols: usize| Tensor::zeros([rows, cols], x.dtype(), x.device());

        // Mixing: gradients of the weights of the sent slots and of the returned outputs.
        let s = slots.len();
        let (dw, dsent) = match (&w, &o) {
            (Some(w), Some(o)) => {
                let dmixed = rows::gather(&dyf, &tokens)?.reshape([s, 1, d])?;
                let (dws, dos) = ops::matmul_backward(w, o, &dmixed)?;
                (rows::scatter_add(&dws.reshape([s, 1])?, &slots, n * k)?.reshape([n, k])?, dos.reshape([s, d])?)
            }
            _ => (zeros(n, k)?, zeros(0, d)?),
        };

        // The output gradients travel to the experts' ranks, as the tokens did.
        let dreceived = plan.dispatch(&*ep, &dsent)?;
        let dby_expert = if order.is_empty() { None } else { Some(rows::gather(dreceived.tensor(), &order)?) };
        let mut dxe_blocks = Vec::new();
        for (ex, saved) in self.experts.iter().zip(per_expert) {
            let params = [ex.gate.clone(), ex.up.clone(), ex.down.clone()];
            let Some(se) = saved else {
                // No row reached this expert: its gradient is zero. Delivered
                // through the same deferral as a busy expert's, so that every
                // rank delivers (and, under sequence parallelism, reduces) the
                // experts' gradients at the same point.
                let device = x.device().clone();
                cx.weight_grad(move |cx| {
                    for p in &params {
                        cx.grad(p, Tensor::zeros(p.local_shape(), cx.compute_dtype(), &device)?)?;
                    }
                    Ok(())
                })?;
                continue;
            };
            let m = se.xe.dims()[0];
            let do_ = dby_expert
                .as_ref()
                .ok_or_else(|| Error::state_mismatch(OP, "the saved state does not come from this layer's forward"))?
                .narrow(0, se.start, m)?;
            let (wg, wu, wd) = (param_value(cx, &ex.gate)?, param_value(cx, &ex.up)?, param_value(cx, &ex.down)?);
            let dh = ops::matmul(&do_, &wd)?;
            let (dgate, dup) = ops::swiglu_backward(&se.gate, &se.up, &dh)?;
            dxe_blocks.push(ops::add(&ops::matmul(&dgate, &wg)?, &ops::matmul(&dup, &wu)?)?);
            // Delivered in the same order as an idle expert's zeros (gate, up,
            // down): under sequence parallelism each delivery is a collective
            // over the tensor-parallel group, whose ranks route differently.
            let (xe, h) = (se.xe.clone(), se.h.clone());
            cx.weight_grad(move |cx| {
                let [gate, up, down] = &params;
                let ddown = weight_grad(&do_, &h)?;
                cx.grad(gate, weight_grad(&dgate, &xe)?)?;
                cx.grad(up, weight_grad(&dup, &xe)?)?;
                cx.grad(down, ddown)
            })?;
        }
        let dreceived_x = unpermute(&dxe_blocks, &order, d, &x)?;

        // The input gradients return to the tokens' ranks.
        let dsent_x = plan.combine(&*ep, Act::new(dreceived_x))?;
        let dx = if s == 0 { zeros(n, d)? } else { rows::scatter_add(&dsent_x, &tokens, n)? };

        // Router: through the softmax of the selected scores, back to all scores,
        // plus the load-balancing loss through the softmax of all scores.
        let dtop = ops::softmax_backward(&weights, &dw)?;
        let mut dlogits = ops::topk_backward(&experts_idx, &dtop, ne)?;
        if let Some(probs) = probs {
            let row = routing::aux_grad_row(self.aux_coef, &stats.routed, n);
            let g: Vec<f64> = (0..n).flat_map(|_| row.iter().copied()).collect();
            let g = Tensor::from_vec(g, [n, ne], x.device())?;
            let g = if g.dtype() == probs.dtype() { g } else { g.to_dtype(probs.dtype())? };
            dlogits = ops::add(&dlogits, &ops::softmax_backward(&probs, &g)?)?;
        }
        let wr = param_value(cx, &self.router)?;
        let dx = ops::add(&dx, &ops::matmul(&dlogits, &wr)?)?;
        let (router, x) = (self.router.clone(), x.clone());
        cx.weight_grad(move |cx| cx.grad(&router, weight_grad(&dlogits, &x)?))?;
        Ok(Act::new(dx.reshape(shape)?))
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()> {
        // The router and experts are this layer's own parameters (no
        // sub-module calls of their own): named in groups, owned by the layer.
        v.group("router", |v| v.param("weight", &self.router, None))?;
        let first = self.local_experts().start;
        v.group("experts", |v| {
            for (e, ex) in self.experts.iter().enumerate() {
                let index = first + e;
                v.expert(index, self.total, |v| {
                    v.group(&index.to_string(), |v| {
                        v.group("gate", |v| v.param("weight", &ex.gate, None))?;
                        v.group("up", |v| v.param("weight", &ex.up, None))?;
                        v.group("down", |v| v.param("weight", &ex.down, None))
                    })
                })?;
            }
            Ok(())
        })
    }

    /// The costs with balanced routing and no capacity drops: every token's
    /// `top_k` rows go through an expert's three products, travel to the
    /// expert's rank and back (two all-to-alls each way over the
    /// expert-parallel group), and are mixed by their weights.
    fn describe(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        let ep = d.settings().ep;
        if self.ep_degree > 1 && self.ep_degree != ep {
            return Err(Error::state_mismatch(
                "Moe",
                format!("the layer is split over {} expert-parallel ranks but described for {ep}; describe the unsplit model", self.ep_degree),
            ));
        }
        if !self.total.is_multiple_of(ep) {
            return Err(Error::indivisible("Moe", format!("{} experts cannot be split over an expert-parallel group of {ep}", self.total)));
        }
        if x.width != self.dim {
            return Err(Error::shape("Moe", format!("an input of {} features per token for a layer of width {}", x.width, self.dim)));
        }
        let (dm, k, e, h, t) = (self.dim, self.top_k, self.total, self.hidden, x.tokens);
        let b = d.compute_dtype().size_in_bytes() as f64;
        d.save(&x);
        // The router, its choices and mixing weights (and all probabilities for the loss).
        d.matmul(&x, dm, e);
        d.save_new(k, t, tessera_core::DType::U32);
        d.save_new(k, t, d.compute_dtype());
        if self.aux_coef != 0.0 {
            d.save_new(e, t, d.compute_dtype());
        }
        let rows = (k * dm) as f64 * b * t;
        // The forward first exchanges how many rows go to each expert (a u32 each).
        d.collective_per_micro_batch(CollectiveKind::AllToAll, Group::Ep, Pass::Forward, (e * 4) as f64);
        for pass in [Pass::Forward, Pass::Backward] {
            d.collective(CollectiveKind::AllToAll, Group::Ep, pass, rows);
            d.collective(CollectiveKind::AllToAll, Group::Ep, pass, rows);
        }
        // The experts on the rows they receive: `k` per token on balance.
        let expert = 2.0 * (dm * h * k) as f64 * t;
        d.flops(3.0 * expert, 6.0 * expert);
        d.save_new(k * dm, t, d.compute_dtype());
        for _ in 0..3 {
            d.save_new(k * h, t, d.compute_dtype());
        }
        // The outputs, mixed by their weights.
        let mix = 2.0 * (k * dm) as f64 * t;
        d.flops(mix, 2.0 * mix);
        d.save_new(k * dm, t, d.compute_dtype());
        d.save_new(k, t, d.compute_dtype());
        let hidden = (k * h) as f64 * b * t;
        d.nonlinear((k * h) as f64 * t, (k * h) as f64 * t);
        d.traffic(4.0 * rows + 3.0 * hidden, 8.0 * rows + 5.0 * hidden);
        Ok(d.output(dm, t))
    }
}
