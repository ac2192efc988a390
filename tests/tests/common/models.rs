//! Models written with the DSL, shared by the integration tests.

use tessera::nn::{CausalAttention, Embedding, LayerNorm, Linear, Moe, RmsNorm, Stack};
use tessera::prelude::*;
use tessera::Result;

#[derive(Module)]
pub struct GptBlock {
    pub ln1: LayerNorm,
    #[shard(column)]
    qkv: Linear,
    attn: CausalAttention,
    #[shard(row)]
    proj: Linear,
    ln2: LayerNorm,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl GptBlock {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + all_reduce(self.proj(self.attn(self.qkv(self.ln1(x)))));
        h + all_reduce(self.down(gelu(self.up(self.ln2(h)))))
    }
}

impl GptBlock {
    pub fn new(d: usize, heads: usize) -> Result<Self> {
        Self::with_qkv_bias(d, heads, true)
    }

    /// A block whose query/key/value projection has a bias or not. The key
    /// part of that bias gets no gradient (softmax ignores a shift of all
    /// scores), so under Adam it only turns rounding noise into updates.
    pub fn with_qkv_bias(d: usize, heads: usize, qkv_bias: bool) -> Result<Self> {
        let hd = d / heads;
        Ok(GptBlock {
            ln1: LayerNorm::new(d, 1e-5, true)?,
            qkv: Linear::new(d, 3 * d, qkv_bias)?,
            attn: CausalAttention::new(heads, heads, hd)?,
            proj: Linear::new(d, d, true)?,
            ln2: LayerNorm::new(d, 1e-5, true)?,
            up: Linear::new(d, 4 * d, true)?,
            down: Linear::new(4 * d, d, true)?,
        })
    }
}

#[derive(Module)]
pub struct LlamaBlock {
    n1: RmsNorm,
    #[shard(column)]
    qkv: Linear,
    attn: CausalAttention,
    #[shard(row)]
    o: Linear,
    n2: RmsNorm,
    #[shard(column)]
    gate: Linear,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl LlamaBlock {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + all_reduce(self.o(self.attn(self.qkv(self.n1(x)))));
        let n = self.n2(h);
        h + all_reduce(self.down(swiglu(self.gate(n), self.up(n))))
    }
}

impl LlamaBlock {
    pub fn new(d: usize, q_heads: usize, kv_heads: usize, hidden: usize) -> Result<Self> {
        let hd = d / q_heads;
        Ok(LlamaBlock {
            n1: RmsNorm::new(d, 1e-6)?,
            qkv: Linear::new(d, (q_heads + 2 * kv_heads) * hd, false)?,
            attn: CausalAttention::new(q_heads, kv_heads, hd)?.with_rope(10_000.0, 64)?,
            o: Linear::new(q_heads * hd, d, false)?,
            n2: RmsNorm::new(d, 1e-6)?,
            gate: Linear::new(d, hidden, false)?,
            up: Linear::new(d, hidden, false)?,
            down: Linear::new(hidden, d, false)?,
        })
    }
}

#[derive(Module)]
pub struct MoeBlock {
    pub norm: RmsNorm,
    pub moe: Moe,
}

#[forward]
impl MoeBlock {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + self.moe(self.norm(x))
    }
}

#[derive(Module)]
pub struct Gpt {
    #[stage(first)]
    #[shard(vocab)]
    pub tok: Embedding,
    #[stage(split)]
    pub blocks: Stack<GptBlock>,
    #[stage(last)]
    #[precision(f32)]
    norm: LayerNorm,
    #[stage(last)]
    #[shard(vocab)]
    #[tied(tok)]
    pub head: Linear,
}

#[forward]
impl Gpt {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        let h = all_reduce(self.tok(ids));
        self.head(self.norm(self.blocks(h)))
    }
}

impl Gpt {
    pub fn new(vocab: usize, d: usize, heads: usize, layers: usize) -> Result<Self> {
        Self::with_qkv_bias(vocab, d, heads, layers, true)
    }

    /// A GPT whose blocks' query/key/value projections have a bias or not.
    pub fn with_qkv_bias(vocab: usize, d: usize, heads: usize, layers: usize, qkv_bias: bool) -> Result<Self> {
        Ok(Gpt {
            tok: Embedding::new(vocab, d)?,
            blocks: Stack::from_fn(layers, |_| GptBlock::with_qkv_bias(d, heads, qkv_bias))?,
            norm: LayerNorm::new(d, 1e-5, true)?,
            head: Linear::new(d, vocab, false)?,
        })
    }
}

/// [`Gpt`] with selective recompute declared on its blocks (the run-time
/// override turns it into full recompute, or off); same parameter names.
#[derive(Module)]
pub struct RecomputeGpt {
    #[stage(first)]
    #[shard(vocab)]
    pub tok: Embedding,
    #[stage(split)]
    #[recompute(selective)]
    pub blocks: Stack<GptBlock>,
    #[stage(last)]
    #[precision(f32)]
    pub norm: LayerNorm,
    #[stage(last)]
    #[shard(vocab)]
    #[tied(tok)]
    pub head: Linear,
}

#[forward]
impl RecomputeGpt {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        let h = all_reduce(self.tok(ids));
        self.head(self.norm(self.blocks(h)))
    }
}

impl RecomputeGpt {
    pub fn new(vocab: usize, d: usize, heads: usize, layers: usize) -> Result<Self> {
        Ok(RecomputeGpt {
            tok: Embedding::new(vocab, d)?,
            blocks: Stack::from_fn(layers, |_| GptBlock::with_qkv_bias(d, heads, false))?,
            norm: LayerNorm::new(d, 1e-5, true)?,
            head: Linear::new(d, vocab, false)?,
        })
    }
}

/// A transformer block whose MLP is a mixture of experts.
#[derive(Module)]
pub struct MoeGptBlock {
    pub ln1: LayerNorm,
    #[shard(column)]
    pub qkv: Linear,
    pub attn: CausalAttention,
    #[shard(row)]
    pub proj: Linear,
    pub ln2: RmsNorm,
    pub moe: Moe,
}

#[forward]
impl MoeGptBlock {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + all_reduce(self.proj(self.attn(self.qkv(self.ln1(x)))));
        h + self.moe(self.ln2(h))
    }
}

/// A small MoE language model: experts split over `ep_degree` ranks, this one `ep_rank`.
#[derive(Module)]
pub struct MoeGpt {
    #[stage(first)]
    #[shard(vocab)]
    pub tok: Embedding,
    #[stage(split)]
    pub blocks: Stack<MoeGptBlock>,
    #[stage(last)]
    pub norm: LayerNorm,
    #[stage(last)]
    #[shard(vocab)]
    #[tied(tok)]
    pub head: Linear,
}

#[forward]
impl MoeGpt {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        let h = all_reduce(self.tok(ids));
        self.head(self.norm(self.blocks(h)))
    }
}

impl MoeGpt {
    pub fn new(vocab: usize, d: usize, heads: usize, layers: usize, experts: usize, ep_rank: usize, ep_degree: usize) -> Result<Self> {
        let block = |_| -> Result<MoeGptBlock> {
            Ok(MoeGptBlock {
                ln1: LayerNorm::new(d, 1e-5, true)?,
                qkv: Linear::new(d, 3 * d, false)?,
                attn: CausalAttention::new(heads, heads, d / heads)?,
                proj: Linear::new(d, d, true)?,
                ln2: RmsNorm::new(d, 1e-6)?,
                moe: Moe::new(d, 2 * d, experts, 2)?.with_expert_parallel(ep_rank, ep_degree)?,
            })
        };
        Ok(MoeGpt {
            tok: Embedding::new(vocab, d)?,
            blocks: Stack::from_fn(layers, block)?,
            norm: LayerNorm::new(d, 1e-5, true)?,
            head: Linear::new(d, vocab, false)?,
        })
    }
}

/// [`MoeGpt`] with selective recompute declared on its blocks; same parameter names.
#[derive(Module)]
pub struct RecomputeMoeGpt {
    #[stage(first)]
    #[shard(vocab)]
    pub tok: Embedding,
    #[stage(split)]
    #[recompute(selective)]
    pub blocks: Stack<MoeGptBlock>,
    #[stage(last)]
    pub norm: LayerNorm,
    #[stage(last)]
    #[shard(vocab)]
    #[tied(tok)]
    pub head: Linear,
}

#[forward]
impl RecomputeMoeGpt {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        let h = all_reduce(self.tok(ids));
        self.head(self.norm(self.blocks(h)))
    }
}

impl RecomputeMoeGpt {
    pub fn new(vocab: usize, d: usize, heads: usize, layers: usize, experts: usize, ep_rank: usize, ep_degree: usize) -> Result<Self> {
        let m = MoeGpt::new(vocab, d, heads, layers, experts, ep_rank, ep_degree)?;
        Ok(RecomputeMoeGpt { tok: m.tok, blocks: m.blocks, norm: m.norm, head: m.head })
    }
}
