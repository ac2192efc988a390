//! Sampling: from a step's logits to the next token, and from tokens to the
//! decision to stop.
//!
//! A request's [`SamplingParams`] are checked once; its [`Sampler`] turns each
//! step's logits and the request's [`History`] into a [`Sampled`] token, and
//! its [`StopChecker`] says when to stop and which text to show. The steps,
//! in vLLM's and Hugging Face's order: penalties on the raw logits,
//! temperature, then top-k, top-p and min-p on the softmax, then argmax
//! (temperature 0) or a draw seeded per request and step.

mod filter;
mod history;
mod params;
mod sampler;
mod stop;

pub use history::History;
pub use params::{SamplingParams, MAX_LOGPROBS};
pub use sampler::{Sampled, Sampler};
pub use stop::{Status, StopCheck, StopChecker, StopReason};
