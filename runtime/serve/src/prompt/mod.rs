//! The prompt side of serving: a user's text or chat messages to token ids,
//! and generated ids back to text.
//!
//! - [`ChatTemplate`] renders a model's Jinja chat template as transformers'
//!   `apply_chat_template` does, to the byte (minijinja, with transformers'
//!   settings, `raise_exception`, `strftime_now` and `tojson`), from a
//!   conversation of [`ChatMessage`]s and [`ChatOptions`].
//!
//! Errors are the runtime's: a conversation the template refuses
//! (`raise_exception`) is an
//! [`Error::InvalidArgument`](tessera_core::Error::InvalidArgument), the
//! request's fault; a template that fails otherwise while rendering is
//! [`Error::Unsupported`](tessera_core::Error::Unsupported).

mod globals;
mod message;
mod pyjson;
mod strftime;
mod template;

#[cfg(test)]
mod tests;

pub use message::{ChatMessage, ChatOptions, Prompt};
pub use template::ChatTemplate;
