//! Generated ids to text as they arrive, one token at a time.
//!
//! Decoding each token on its own is wrong twice over. A byte-level BPE
//! token may hold part of a character (an emoji is four bytes, often two or
//! more tokens), so its text alone is `�`. And a SentencePiece tokenizer's
//! decoder reads a token differently at the start of a text: `▁world` is
//! " world" after another token and "world" first, so per-token pieces lose
//! their spaces. The remedy, vLLM's and `tokenizers`' `DecodeStream`'s:
//! decode a short window of tokens that ends with the new one and starts
//! with tokens already shown, and emit what the window's text adds to the
//! text of its shown part; emit nothing while the text ends in an
//! incomplete character.

use super::tokenizer::ModelTokenizer;
use tessera_core::{Error, Result};
use tessera_data::SpecialTokens;

/// Prompt tokens that start the first window: the left context a
/// SentencePiece decoder needs to read the first generated token (vLLM's
/// `INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET`).
const PROMPT_CONTEXT: usize = 5;

/// The text of one request's generated tokens, piece by piece.
///
/// Each [`push`](Self::push) returns the text that the new token completes,
/// or `None` while it completes none (part of a character, a skipped special
/// token). The pieces, followed by [`finish`](Self::finish), concatenate to
/// the text of the prompt and generated ids decoded together, less the
/// prompt's own text.
///
/// ```no_run
/// use tessera::serve::prompt::{Detokenizer, ModelTokenizer};
/// use tessera::data::SpecialTokens;
/// # fn main() -> tessera::Result<()> {
/// let tokenizer = ModelTokenizer::from_dir("models/llama")?;
/// let prompt = tokenizer.encode("The capital of France is", SpecialTokens::Added)?;
/// let mut text = Detokenizer::new(&tokenizer, &prompt, SpecialTokens::Omitted);
/// for id in [12366, 13] {
///     if let Some(piece) = text.push(id)? {
///         print!("{piece}");
///     }
/// }
/// print!("{}", text.finish()?);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Detokenizer {
    tokenizer: ModelTokenizer,
    special: SpecialTokens,
    /// The window: tokens whose text was emitted (`..read`), then those
    /// whose text is not yet complete.
    window: Vec<u32>,
    /// How many tokens of `window` are shown.
    read: usize,
    /// The text shown of the window: that of `window[..read]` (at the
    /// start, the prompt's text less an incomplete last character).
    prefix: String,
    /// How many ids were pushed (for errors).
    pushed: usize,
}

impl Detokenizer {
    /// A detokenizer for tokens generated after `prompt` (whose last tokens
    /// give the first ones their context); `special` says whether special
    /// tokens' text is shown (`Omitted`, Hugging Face's
    /// `skip_special_tokens`, is what a chat answer is shown with).
    pub fn new(tokenizer: &ModelTokenizer, prompt: &[u32], special: SpecialTokens) -> Self {
        let mut detok = Detokenizer { tokenizer: tokenizer.clone(), special, window: Vec::new(), read: 0, prefix: String::new(), pushed: 0 };
        // The context must not start inside a character: its text would
        // start with `�` where the prompt's reads a character, and a
        // generated token continuing that byte run would be read apart from
        // it. Starting a token or three earlier reaches the character's
        // first byte (a character has at most three bytes before its last).
        let mut start = prompt.len().saturating_sub(PROMPT_CONTEXT);
        let text = loop {
            match detok.decode(&prompt[start..]) {
                Ok(text) if start > 0 && prompt.len() - start < PROMPT_CONTEXT + 3 && text.starts_with(char::REPLACEMENT_CHARACTER) => start -= 1,
                Ok(text) => break Some(text),
                // A prompt id outside the vocabulary leaves the context out;
                // the prompt itself is refused where it is fed to the model.
                Err(_) => break None,
            }
        };
        if let Some(text) = text {
            detok.window = prompt[start..].to_vec();
            // The prompt's text counts as shown, less an incomplete
            // character at its end: the generated token that completes it
            // shows it whole. The tokens holding that character's first
            // bytes stay unread, so that the next window starts with them
            // rather than inside the character.
            detok.read = detok.window.len();
            let mut shown = text.clone();
            while shown.ends_with(char::REPLACEMENT_CHARACTER) && detok.read > 0 && detok.window.len() - detok.read < 3 {
                detok.read -= 1;
                shown = detok.decode(&detok.window[..detok.read]).unwrap_or_default();
            }
            detok.prefix = text.trim_end_matches(char::REPLACEMENT_CHARACTER).to_string();
        }
        detok
    }

    /// Takes the next generated id; returns the text it completes, if any.
    /// An id outside the tokenizer's vocabulary is an
    /// [`Error::IndexOutOfRange`] (the model's vocabulary may be padded past
    /// the tokenizer's: those ids must be masked when sampling).
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        let vocab = self.tokenizer.vocab_size();
        if id as usize >= vocab {
            return Err(Error::IndexOutOfRange {
                op: "Detokenizer::push",
                index: id.into(),
                position: self.pushed,
                bound: vocab as u64,
                hint: "; the model's vocabulary is larger than its tokenizer's: mask the ids past the tokenizer's when sampling",
            });
        }
        self.pushed += 1;
        self.window.push(id);
        let text = self.decode(&self.window)?;
        if text.len() <= self.prefix.len() || text.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(None);
        }
        let piece = suffix_after(&text, &self.prefix).to_string();
        // The next window starts where this one's unshown part began: those
        // tokens are now shown, and serve as the next token's context.
        self.window.drain(..self.read);
        self.prefix = self.decode(&self.window)?;
        self.read = self.window.len();
        Ok(Some(piece))
    }

    /// The text held back at the end of generation (an incomplete character
    /// reads as `�`, as a one-shot decode shows it); empty when there is none.
    pub fn finish(&mut self) -> Result<String> {
        let text = self.decode(&self.window)?;
        if text.len() <= self.prefix.len() {
            return Ok(String::new());
        }
        let piece = suffix_after(&text, &self.prefix).to_string();
        self.window.drain(..self.read);
        self.prefix = self.decode(&self.window)?;
        self.read = self.window.len();
        Ok(piece)
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, self.special)
    }
}

/// What `text` adds after `prefix`. A decoder whose text of a window does
/// not extend the text of the window's start (rare: a normaliser that
/// rewrites across tokens) gets vLLM's answer: the text past the prefix's
/// length, cut at a character boundary.
fn suffix_after<'a>(text: &'a str, prefix: &str) -> &'a str {
    if let Some(rest) = text.strip_prefix(prefix) {
        return rest;
    }
    let mut at = prefix.len().min(text.len());
    while !text.is_char_boundary(at) {
        at += 1;
    }
    &text[at..]
}
