//! Llama: RMSNorm, rotary position embeddings, grouped-query attention and
//! a SwiGLU MLP, no biases; the output head tied to the token embedding or not.
//!
//! Parameter names follow Hugging Face's `LlamaForCausalLM` without its
//! `model.` prefix (`layers.0.mlp.gate_proj.weight`, ...), except that the
//! query, key and value projections are one packed parameter,
//! `layers.{i}.self_attn.qkv_proj.weight`; see [`hf`](crate::hf).

mod config;
pub(crate) mod hf;

pub use config::LlamaConfig;
pub(crate) use config::{check_silu, default_head_dim, lift_rope_theta, llama_fields, nest_rope_theta, AttentionConfig};

pub use crate::causal_lm::CausalLm;
use crate::error::Result;
use tessera::nn::{CausalAttention, Linear, RmsNorm, Stack};
use tessera::prelude::*;

/// Grouped-query attention with rotary embeddings: the packed query/key/value
/// projection (`qkv_proj`, column parallel, rows packed per key/value group
/// as [`CausalAttention`] reads them), the attention core, and the output
/// projection (`o_proj`, row parallel). `Replicated → PartialSum`: the
/// caller all-reduces. Shared by [`Llama`] and [`Mixtral`](crate::mixtral::Mixtral).
#[derive(Module)]
pub struct LlamaAttention {
    #[shard(column)]
    qkv_proj: Linear,
    core: CausalAttention,
    #[shard(row)]
    o_proj: Linear,
}

#[forward]
impl LlamaAttention {
    fn forward(&self, x: Act<Replicated>) -> Act<PartialSum> {
        self.o_proj(self.core(self.qkv_proj(x)))
    }
}

impl LlamaAttention {
    /// The attention block `config` describes.
    pub(crate) fn new(config: &AttentionConfig<'_>) -> Result<LlamaAttention> {
        let (d, q, kv, hd) = (config.hidden_size, config.heads, config.kv_heads, config.head_dim);
        Ok(LlamaAttention {
            qkv_proj: Linear::new(d, (q + 2 * kv) * hd, false)?,
            core: CausalAttention::new(q, kv, hd)?.with_rope(config.rope_theta, config.max_positions)?,
            o_proj: Linear::new(q * hd, d, false)?,
        })
    }
}

/// Llama's MLP: `down_proj(silu(gate_proj(x)) · up_proj(x))`, the gate and
/// up projections column parallel, the down projection row parallel.
/// `Replicated → PartialSum`.
#[derive(Module)]
pub struct LlamaMlp {
    #[shard(column)]
    gate_proj: Linear,
    #[shard(column)]
    up_proj: Linear,
    #[shard(row)]
    down_proj: Linear,
}

#[forward]
impl LlamaMlp {
    fn forward(&self, x: Act<Replicated>) -> Act<PartialSum> {
        self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
    }
}

/// One pre-RMSNorm transformer block of Llama.
#[derive(Module)]
pub struct LlamaBlock {
    input_layernorm: RmsNorm,
    self_attn: LlamaAttention,
    post_attention_layernorm: RmsNorm,
    mlp: LlamaMlp,
}

#[forward]
impl LlamaBlock {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + all_reduce(self.self_attn(self.input_layernorm(x)));
        h + all_reduce(self.mlp(self.post_attention_layernorm(h)))
    }
}

/// Llama as a causal language model: [`CausalLm`] over [`LlamaBlock`]s.
///
/// ```
/// use tessera::module::{self, Act, Cx, Module};
/// use tessera::{Device, Tensor};
/// use tessera_models::llama::{Llama, LlamaConfig};
///
/// let cx = &mut Cx::new(Device::cpu());
/// let model = module::build(Llama::new(&LlamaConfig::tiny(64, 32, 4, 2, 64, 2, 16))?, cx)?;
/// let ids = Tensor::from_vec(vec![1u32, 5, 9, 2], [1, 4], cx.device())?;
/// let (logits, _) = model.forward(cx, Act::new(ids))?;
/// assert_eq!(logits.tensor().dims(), &[1, 4, 64]);
/// # Ok::<(), tessera_models::Error>(())
/// ```
pub type Llama = CausalLm<LlamaBlock>;

impl CausalLm<LlamaBlock> {
    /// The model `config` describes (validated first), not yet materialised:
    /// [`module::build`](tessera::module::build) gives it a rank's values.
    /// Under tensor parallelism the degree must divide the key/value head
    /// count (every rank holds whole groups).
    pub fn new(config: &LlamaConfig) -> Result<Llama> {
        config.validate()?;
        let (d, eps) = (config.hidden_size, config.rms_norm_eps);
        let block = |_| -> Result<LlamaBlock> {
            Ok(LlamaBlock {
                input_layernorm: RmsNorm::new(d, eps)?,
                self_attn: LlamaAttention::new(&config.attention())?,
                post_attention_layernorm: RmsNorm::new(d, eps)?,
                mlp: LlamaMlp {
                    gate_proj: Linear::new(d, config.intermediate_size, false)?,
                    up_proj: Linear::new(d, config.intermediate_size, false)?,
                    down_proj: Linear::new(config.intermediate_size, d, false)?,
                },
            })
        };
        Ok(CausalLm::from_parts(config.vocab_size, d, eps, config.tie_word_embeddings, stack(config.num_hidden_layers, block)?)?)
    }
}

/// `n` blocks built by `f`, with this crate's errors.
pub(crate) fn stack<M>(n: usize, mut f: impl FnMut(usize) -> Result<M>) -> Result<Stack<M>> {
    Ok(Stack::new((0..n).map(&mut f).collect::<Result<_>>()?)?)
}
