//! Causal grouped-query self-attention on packed query/key/value projections.

use crate::module::{Act, Activation, CollectiveKind, Cx, Describe, Group, Module, Pass, Plain, SplitHidden, Visitor};
use std::fmt;
use tessera_core::ops::{self, AttnOpts, QkvHeads, Rope};
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};

/// Causal self-attention with grouped-query heads and optional rotary
/// position embedding; no parameters.
///
/// It sits between a column-parallel `qkv` projection and a row-parallel
/// output projection, so its input and output are `SplitHidden`: each
/// tensor-parallel rank holds `q_heads / tp` query heads and `kv_heads / tp`
/// key/value heads (both must divide). The input is
/// `[batch, seq, (hq + 2·hkv)·head_dim]`, packed per key/value group: for
/// each group, its `q_heads / kv_heads` query heads, then its key head, then
/// its value head (each head's `head_dim` values contiguous). Packing by
/// group makes a column-parallel split of the projection hand every rank
/// whole groups, so one layout serves any tensor-parallel degree that
/// divides `kv_heads`, and a sharded run computes exactly what one rank does.
/// The output is `[batch, seq, hq·head_dim]`, query heads in order; query
/// head `h` reads key/value head `h / (q_heads / kv_heads)`. With RoPE,
/// positions are `0..seq`.
///
/// Under context parallelism (a cp group of several ranks, see
/// [`ContextSplit`](crate::module::ContextSplit)) the input holds this
/// rank's chunks of each sequence: RoPE rotates at their global positions
/// and attention runs as ring attention, key/value blocks passed around the
/// group and overlapped with the blocks' attention; the result is the
/// single-rank attention's rows for those chunks.
///
/// In a serving step ([`Cx::decode`]) the input is the step's tokens as one
/// row `[1, tokens, ..]`: their keys and values go to the paged cache and
/// each token attends its own sequence's cached positions (RoPE at the
/// tokens' positions); such a forward has no backward.
///
/// Under selective recompute ([`Cx::selective_recompute`]) the forward keeps
/// only its packed input and the backward recomputes the attention core;
/// otherwise it keeps what the backward reads (see [`AttentionSaved`]).
///
/// ```
/// use tessera::module::{Act, Cx, Module};
/// use tessera::nn::CausalAttention;
/// use tessera::{DType, Device, Tensor};
///
/// let dev = Device::cpu();
/// let cx = &mut Cx::new(dev.clone());
/// let attn = CausalAttention::new(4, 2, 8)?.with_rope(10_000.0, 128)?;
/// // 4 query heads + 2 key heads + 2 value heads, of 8 values each
/// let qkv = Tensor::zeros([2, 5, 64], DType::F32, &dev)?;
/// let (y, saved) = attn.forward(cx, Act::new(qkv))?;
/// assert_eq!(y.tensor().dims(), &[2, 5, 32]);
/// let dqkv = attn.backward(cx, saved, y)?;
/// assert_eq!(dqkv.tensor().dims(), &[2, 5, 64]);
/// # Ok::<(), tessera::Error>(())
/// ```
pub struct CausalAttention {
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rope: Option<RopeSpec>,
}

struct RopeSpec {
    theta: f64,
    max_position: usize,
    table: Rope,
}

impl fmt::Debug for CausalAttention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("CausalAttention");
        s.field("q_heads", &self.q_heads).field("kv_heads", &self.kv_heads).field("head_dim", &self.head_dim);
        if let Some(r) = &self.rope {
            s.field("rope_theta", &r.theta).field("max_position", &r.max_position);
        }
        s.finish()
    }
}

/// What a [`CausalAttention`] keeps for its backward.
///
/// * Without selective recompute: the packed input (after RoPE, when the
///   layer has it; otherwise shared with the caller's copy), the output
///   (shared with the layer's output tensor) and the per-query log-sum-exp,
///   `[batch, q_heads, seq]` in f32 (f64 for f64 inputs).
/// * With selective recompute: only the packed input, shared with the
///   caller's copy of it; the backward recomputes RoPE, the output and the
///   log-sum-exp.
pub struct AttentionSaved(Kept);

enum Kept {
    Core(Box<Core>),
    /// Under context parallelism: ring attention's tensors.
    Ring(Box<crate::ring_attention::RingSaved>),
    Input(Tensor),
    /// A decoding step's forward, which has no backward.
    Decode,
}

struct Core {
    /// The packed input the kernel read (rotated when the layer has RoPE).
    qkv: Tensor,
    out: Tensor,
    lse: Tensor,
}

impl AttentionSaved {
    /// Bytes of activation memory held (counting a kept input in full).
    pub fn bytes(&self) -> usize {
        use super::bytes_of;
        match &self.0 {
            Kept::Core(c) => [&c.qkv, &c.out, &c.lse].into_iter().map(bytes_of).sum(),
            Kept::Ring(r) => r.bytes(),
            Kept::Input(x) => bytes_of(x),
            Kept::Decode => 0,
        }
    }

    /// Whether only the input was kept (selective recompute).
    pub fn is_input_only(&self) -> bool {
        matches!(self.0, Kept::Input(_))
    }
}

impl fmt::Debug for AttentionSaved {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.is_input_only() { "input" } else { "core" };
        write!(f, "AttentionSaved({kind}, {} bytes)", self.bytes())
    }
}

/// This rank's head counts.
#[derive(Clone, Copy)]
struct Heads {
    q: usize,
    kv: usize,
    d: usize,
}

impl Heads {
    fn total(self) -> usize {
        self.q + 2 * self.kv
    }

    fn packed(self) -> QkvHeads {
        QkvHeads { q_heads: self.q, kv_heads: self.kv, head_dim: self.d }
    }
}

impl CausalAttention {
    /// Attention with `q_heads` query heads grouped over `kv_heads` key/value
    /// heads of `head_dim` values each.
    pub fn new(q_heads: usize, kv_heads: usize, head_dim: usize) -> Result<CausalAttention> {
        const OP: &str = "CausalAttention::new";
        if q_heads == 0 || kv_heads == 0 || head_dim == 0 {
            return Err(Error::invalid(OP, format!("q_heads ({q_heads}), kv_heads ({kv_heads}) and head_dim ({head_dim}) must all be positive")));
        }
        if !q_heads.is_multiple_of(kv_heads) {
            return Err(Error::invalid(
                OP,
                format!("{q_heads} query heads cannot be grouped over {kv_heads} key/value heads; q_heads must be a multiple of kv_heads"),
            ));
        }
        Ok(CausalAttention { q_heads, kv_heads, head_dim, rope: None })
    }

    /// Applies rotary position embedding (base `theta`, usually 10000) to
    /// queries and keys, for sequences of up to `max_position` tokens.
    pub fn with_rope(mut self, theta: f64, max_position: usize) -> Result<CausalAttention> {
        if max_position == 0 {
            return Err(Error::invalid("CausalAttention::with_rope", "max_position must be positive (the longest sequence the model sees)"));
        }
        let table = Rope::new(self.head_dim, max_position, theta)?;
        self.rope = Some(RopeSpec { theta, max_position, table });
        Ok(self)
    }

    /// Query heads (global).
    pub fn q_heads(&self) -> usize {
        self.q_heads
    }

    /// Key/value heads (global).
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Values per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// This rank's heads on a tensor-parallel group of `tp` ranks.
    fn local(&self, tp: usize) -> Result<Heads> {
        if !self.q_heads.is_multiple_of(tp) || !self.kv_heads.is_multiple_of(tp) {
            return Err(Error::indivisible(
                "CausalAttention",
                format!(
                    "{} query heads and {} key/value heads cannot be split over a tensor-parallel group of {tp}; choose a degree that divides both",
                    self.q_heads, self.kv_heads
                ),
            ));
        }
        Ok(Heads { q: self.q_heads / tp, kv: self.kv_heads / tp, d: self.head_dim })
    }

    /// RoPE (if any) at the global positions of this rank's tokens (its
    /// chunks of the sequence under context parallelism).
    fn rotate(&self, cx: &Cx, h: Heads, x: &Tensor) -> Result<Tensor> {
        match &self.rope {
            Some(r) => ops::rope_packed(x, &r.table, &Self::positions(cx, r, x.dims()[1])?, h.packed()),
            None => Ok(x.clone()),
        }
    }

    /// The global positions of this rank's `seq` tokens, checked against the table.
    fn positions(cx: &Cx, r: &RopeSpec, seq: usize) -> Result<Vec<u32>> {
        let positions = cx.token_positions(seq, false)?;
        if let Some(p) = positions.iter().find(|&&p| p as usize >= r.max_position) {
            return Err(Error::invalid(
                "CausalAttention",
                format!("position {p} is past the {} positions RoPE was built for; feed sequences of at most {} tokens", r.max_position, r.max_position),
            ));
        }
        Ok(positions)
    }

    /// Checks the packed input's shape against this rank's heads.
    fn check_input(h: Heads, x: &Tensor) -> Result<()> {
        let dims = x.dims();
        if dims.len() != 3 || dims[2] != h.total() * h.d {
            return Err(Error::shape(
                "CausalAttention",
                format!(
                    "input of shape {} for {} query and {} key/value heads of {} on this rank; pass [batch, seq, {}] packed per key/value group as [q.. | k | v]",
                    x.shape(),
                    h.q,
                    h.kv,
                    h.d,
                    h.total() * h.d
                ),
            ));
        }
        Ok(())
    }

    /// Applies RoPE (if any) and runs attention on the packed input: on
    /// this rank, or around the context-parallel ring when the sequence is
    /// split ([`ring_attention`](crate::ring_attention)).
    /// Returns the output and what the backward reads.
    fn core(&self, cx: &Cx, h: Heads, x: &Tensor) -> Result<(Tensor, Kept)> {
        Self::check_input(h, x)?;
        let qkv = self.rotate(cx, h, x)?;
        if cx.cp().size() > 1 {
            let (out, saved) = crate::ring_attention::forward(cx.cp(), h.packed(), &qkv)?;
            return Ok((out, Kept::Ring(Box::new(saved))));
        }
        let (out, lse) = ops::attention_packed(&qkv, h.packed(), AttnOpts::causal())?;
        Ok((out.clone(), Kept::Core(Box::new(Core { qkv, out, lse }))))
    }
}

impl CausalAttention {
    /// A serving step (see [`Decode`](crate::module::Decode)): RoPE at the
    /// tokens' positions, their keys and values written to their cache
    /// slots, then each token attends its own sequence's cached positions.
    fn decode_step(&self, cx: &Cx, h: Heads, x: &Tensor) -> Result<Tensor> {
        let dec = cx.decode().expect("called in a decoding step");
        dec.check_tokens("CausalAttention", x)?;
        if x.dims().last() != Some(&(h.total() * h.d)) {
            return Err(Error::shape(
                "CausalAttention",
                format!("input of shape {} for {} query and {} key/value heads of {} on this rank", x.shape(), h.q, h.kv, h.d),
            ));
        }
        let positions = &dec.batch.positions;
        let qkv = match &self.rope {
            Some(r) => {
                if let Some(p) = positions.iter().find(|&&p| p as usize >= r.max_position) {
                    return Err(Error::invalid(
                        "CausalAttention",
                        format!("position {p} is past the {} positions RoPE was built for; keep prompt and output within the model's context", r.max_position),
                    ));
                }
                ops::rope_packed(x, &r.table, positions, h.packed())?
            }
            None => x.clone(),
        };
        let cache = dec.cache.layer(&cx.path(), h.kv, h.d)?;
        ops::kv_cache_write(&qkv, h.packed(), &cache.k, &cache.v, &dec.batch)?;
        ops::paged_attention(&qkv, h.packed(), &cache.k, &cache.v, &dec.batch)
    }
}

impl Module<Plain> for CausalAttention {
    type In = SplitHidden;
    type Out = SplitHidden;
    type Saved = AttentionSaved;

    fn check_tp(&self, path: &str, degree: usize, problems: &mut Vec<String>) {
        if let Err(e) = self.local(degree) {
            problems.push(format!("`{path}`: {e}"));
        }
    }

    fn forward(&self, cx: &mut Cx, x: Act<SplitHidden>) -> Result<(Act<SplitHidden>, AttentionSaved)> {
        let h = self.local(cx.tp().size())?;
        let x = x.into_tensor();
        if cx.decode().is_some() {
            return Ok((Act::new(self.decode_step(cx, h, &x)?), AttentionSaved(Kept::Decode)));
        }
        let (y, kept) = self.core(cx, h, &x)?;
        let kept = if cx.selective_recompute() { Kept::Input(x) } else { kept };
        Ok((Act::new(y), AttentionSaved(kept)))
    }

    fn backward(&self, cx: &mut Cx, saved: AttentionSaved, dy: Act<SplitHidden>) -> Result<Act<SplitHidden>> {
        const OP: &str = "CausalAttention::backward";
        let h = self.local(cx.tp().size())?;
        let kept = match saved.0 {
            Kept::Input(x) => self.core(cx, h, &x)?.1,
            kept => kept,
        };
        let dy = dy.into_tensor();
        let dqkv = match kept {
            Kept::Core(c) => {
                if dy.shape() != c.out.shape() {
                    return Err(Error::shape(OP, format!("upstream gradient {} for an output of {}", dy.shape(), c.out.shape())));
                }
                ops::attention_packed_backward(&c.qkv, &c.out, &c.lse, &dy, h.packed(), AttnOpts::causal())?
            }
            Kept::Ring(r) => crate::ring_attention::backward(cx.cp(), h.packed(), *r, &dy)?,
            Kept::Input(_) => unreachable!("recomputed above"),
            Kept::Decode => {
                return Err(Error::invalid(OP, "the forward was a decoding step, which has no backward; train without a decoding state in the context"));
            }
        };
        let dx = match &self.rope {
            Some(r) => ops::rope_packed_backward(&dqkv, &r.table, &Self::positions(cx, r, dqkv.dims()[1])?, h.packed())?,
            None => dqkv,
        };
        Ok(Act::new(dx))
    }

    fn visit_params(&self, _v: &mut Visitor<'_>) -> Result<()> {
        Ok(())
    }

    /// Causal attention over sequences of the settings' length: `QKᵀ` and
    /// `PV` over the `(T+1)/2` keys a query sees on average (under context
    /// parallelism too: the split is balanced), 2.5 times that backward;
    /// with context parallelism, the ring's key/value blocks. It keeps the (rotated) projections, its output and the
    /// log-sum-exp, or under selective recompute only its input, and runs
    /// again in the backward.
    fn describe(&self, d: &mut Describe, x: Activation) -> Result<Activation> {
        let h = self.local(d.tp())?;
        if x.width != h.total() * h.d {
            return Err(Error::shape(
                "CausalAttention",
                format!("an input of {} features per token on a rank for {} query and {} key/value heads of {} there", x.width, h.q, h.kv, h.d),
            ));
        }
        let t = d.settings().seq_len as f64;
        let forward = 4.0 * (h.q * h.d) as f64 * (t + 1.0) / 2.0 * x.tokens;
        d.attention_flops(forward, 2.5 * forward);
        let qkv = match self.rope {
            Some(_) => {
                let r = d.output(x.width, x.tokens);
                d.traffic(2.0 * r.bytes(), 2.0 * r.bytes());
                r
            }
            None => x,
        };
        if d.settings().cp > 1 {
            // Ring attention: this rank's keys and values travel around the
            // ring (cp − 1 hops) beside the blocks' attention, and again in
            // the backward with their gradients, which travel in f32 and
            // make one hop more, back to their owner: per hop, on average,
            // `cp / (cp − 1)` of them.
            let cp = d.settings().cp as f64;
            let kv = x.bytes() * (2 * h.kv) as f64 / h.total() as f64;
            let kv_grads = (2 * h.kv * h.d) as f64 * 4.0 * x.tokens * cp / (cp - 1.0);
            d.collective_beside(CollectiveKind::Ring, Group::Cp, Pass::Forward, kv, forward);
            d.collective_beside(CollectiveKind::Ring, Group::Cp, Pass::Backward, kv + kv_grads, 2.5 * forward);
            if d.selective() {
                // The recompute in the backward runs the forward's ring again.
                d.collective_beside(CollectiveKind::Ring, Group::Cp, Pass::Backward, kv, forward);
            }
        }
        let out = d.output(h.q * h.d, x.tokens);
        if d.selective() {
            d.save(&x);
            d.recompute(forward);
        } else {
            d.save(&qkv);
            d.save(&out);
            d.save_new(h.q, x.tokens, d.stat_dtype());
        }
        Ok(out)
    }
}
