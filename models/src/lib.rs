//! Reference models written with Tessera's model DSL, with Hugging Face
//! checkpoint import and export.
//!
//! * [`gpt2`]: GPT-2 ([`Gpt2`](gpt2::Gpt2), [`Gpt2Config`](gpt2::Gpt2Config)),
//!   and GPT-2 with a mixture of experts in every block ([`MoeGpt2`](gpt2::MoeGpt2)):
//!   one generic definition, [`Gpt2Lm`](gpt2::Gpt2Lm), over their blocks.
//! * [`llama`]: Llama ([`Llama`](llama::Llama), [`LlamaConfig`](llama::LlamaConfig)):
//!   RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.
//! * [`mixtral`]: Mixtral ([`Mixtral`](mixtral::Mixtral), [`MixtralConfig`](mixtral::MixtralConfig)):
//!   Llama's attention with a sparse mixture of SwiGLU experts. Llama and
//!   Mixtral are one generic definition, [`CausalLm`](llama::CausalLm), over
//!   their blocks.
//! * [`kinds`]: a model chosen by name (`model.kind`) from a training
//!   configuration's `[model]` table, described there or started from a
//!   Hugging Face directory (`model.from`), built for any rank of a mesh.
//! * [`generate`]: greedy decoding on one rank, for evaluation.
//! * [`hf`]: loading a Hugging Face checkpoint directory (`config.json` +
//!   `model.safetensors`) into a model on each tensor-parallel rank, and
//!   exporting a model in the same form.
//!
//! Every model maps token ids `[batch, seq]` (u32) to logits
//! `[batch, seq, vocab]` split over the vocabulary on the tensor-parallel
//! group (`Act<SplitHidden>`), carries `#[shard]` attributes for tensor
//! parallelism and `#[stage]` attributes for pipeline parallelism, and is
//! built from its config (`Gpt2::new(&config)`), then materialised for a
//! rank with [`module::build`](tessera::module::build).
//!
//! Loading a checkpoint, computing logits and exporting it again:
//!
//! ```
//! use tessera::module::{Act, Cx, Module};
//! use tessera::{Device, Tensor};
//! use tessera_models::{hf, llama::Llama};
//!
//! // `dir` holds `config.json` and `model.safetensors`, as Hugging Face's `save_pretrained` writes them.
//! # let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/llama");
//! let cx = &mut Cx::new(Device::cpu());
//! let hf::Pretrained { model, config } = hf::load_pretrained::<Llama>(dir, cx)?;
//! let ids = Tensor::from_vec(vec![1u32, 41, 29, 3], [1, 4], cx.device())?;
//! let (logits, _) = model.forward(cx, Act::new(ids))?;
//! assert_eq!(logits.tensor().dims(), &[1, 4, config.vocab_size]);
//!
//! let out = std::env::temp_dir().join("tessera-models-doc-llama");
//! hf::save_pretrained(&model, &config, &out)?;
//! # std::fs::remove_dir_all(&out).ok();
//! # Ok::<(), tessera_models::Error>(())
//! ```
//!
//! On several ranks, give each rank's [`Cx`](tessera::module::Cx) its
//! communicators: every rank loads its own shard of every weight. See
//! `docs/models.md` for the name mapping and layout conversions.

mod causal_lm;
mod config;
mod error;
pub mod generate;
pub mod gpt2;
pub mod hf;
pub mod kinds;
pub mod llama;
pub mod mixtral;
pub mod vocab;

pub use error::{Error, Result};
pub use tessera;
