//! The prompt side of serving: a user's text or chat messages to token ids,
//! and generated ids back to text.
//!
//! - [`ModelTokenizer`] loads a model directory's `tokenizer.json` with the
//!   special tokens, BOS/EOS behaviour, stop ids and chat templates of the
//!   Hugging Face files beside it, and encodes a [`Prompt`]: a plain text,
//!   or a conversation of [`ChatMessage`]s.
//! - [`ChatTemplate`] renders a model's Jinja chat template as transformers'
//!   `apply_chat_template` does, to the byte (minijinja, with transformers'
//!   settings, `raise_exception`, `strftime_now` and `tojson`).
//! - [`Detokenizer`] turns one request's generated ids into text pieces as
//!   they arrive, whole characters only, with the spaces a SentencePiece
//!   decoder gives a token in context.
//!
//! ```no_run
//! use tessera::data::SpecialTokens;
//! use tessera::serve::prompt::{ChatMessage, Detokenizer, ModelTokenizer, Prompt};
//! # fn main() -> tessera::Result<()> {
//! let tokenizer = ModelTokenizer::from_dir("models/Qwen2.5-0.5B-Instruct")?;
//! let prompt = Prompt::Chat(vec![ChatMessage::system("Be brief."), ChatMessage::user("Why is the sky blue?")]);
//! let ids = tokenizer.encode_prompt(&prompt)?;
//! let mut text = Detokenizer::new(&tokenizer, &ids, SpecialTokens::Omitted);
//! # let generated: Vec<u32> = Vec::new();
//! for id in generated {
//!     if tokenizer.eos_ids().contains(&id) {
//!         break;
//!     }
//!     if let Some(piece) = text.push(id)? {
//!         print!("{piece}");
//!     }
//! }
//! print!("{}", text.finish()?);
//! # Ok(()) }
//! ```
//!
//! Errors are the runtime's: a missing or malformed file is an
//! [`Error::DataFile`](tessera_core::Error::DataFile) naming the file and
//! field; a conversation the template refuses (`raise_exception`), chat
//! messages for a model without a template, or an id outside the
//! vocabulary, is an [`Error::InvalidArgument`](tessera_core::Error::InvalidArgument)
//! or [`Error::IndexOutOfRange`](tessera_core::Error::IndexOutOfRange): the
//! request's fault; a template that fails otherwise while rendering is
//! [`Error::Unsupported`](tessera_core::Error::Unsupported).

mod detokenizer;
mod files;
mod globals;
mod message;
mod pyjson;
mod strftime;
mod template;
mod tokenizer;

#[cfg(test)]
mod tests;

pub use detokenizer::Detokenizer;
pub use message::{ChatMessage, ChatOptions, Prompt};
pub use template::ChatTemplate;
pub use tokenizer::{ModelTokenizer, SpecialToken, TOKENIZER_FILE};
