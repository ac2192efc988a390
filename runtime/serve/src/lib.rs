//! Tessera's inference engine: what turns a trained or imported model into a
//! generator.
//!
//! It is being built in pieces; docs/serving.md says what exists:
//!
//! - [`engine`]: the [`Engine`](engine::Engine): requests in, tokens out,
//!   continuous batching over the paged cache;
//! - [`driver`]: an engine on a thread of its own, for many clients at
//!   once (what a server talks to);
//! - [`sampling`]: choosing each next token from a step's logits, and when
//!   a request stops;
//! - [`prompt`]: a model directory's tokenizer and chat template, and
//!   streaming generated tokens back to text;
//! - [`kv`]: the paged KV cache's blocks: which physical block holds each
//!   token of each sequence, shared between sequences with a common prefix.

pub mod driver;
pub mod engine;
pub mod kv;
pub mod prompt;
pub mod sampling;
#[cfg(test)]
mod test_data;
