//! Tokenizers: text to token ids and back.
//!
//! Two kinds share one interface ([`Tokenizer`]):
//!
//! - a byte-level BPE from the Hugging Face `tokenizers` crate, trained here on
//!   text files or loaded from any `tokenizer.json`. Its base alphabet is the
//!   256 bytes, so every text encodes, whatever its script;
//! - a character tokenizer over a fixed alphabet ([`CharTokenizer`]): one id
//!   per character. Tiny models learn a small, regular task such as the bundled
//!   arithmetic much faster on characters than on merged pieces.
//!
//! Both are saved as a `tokenizer.json`. The character tokenizer's file is a
//! small Tessera format (`{"tessera": "char-tokenizer", "alphabet": ...}`);
//! [`Tokenizer::load`] recognises either.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use tessera_core::{Error, Result};

/// The special token a trained BPE reserves to separate documents.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// Whether an encoding carries the special tokens (BOS, EOS, ...) that the
/// tokenizer file's post-processor adds around a sequence, as Hugging Face's
/// `encode` does by default. A character tokenizer has none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpecialTokens {
    /// As the post-processor says (Llama's adds BOS, GPT-2's adds nothing).
    #[default]
    Added,
    /// The text's own tokens only.
    Omitted,
}

/// Text to token ids and back: a byte-level BPE or a character tokenizer.
#[derive(Clone, Debug)]
pub enum Tokenizer {
    /// One id per character of a fixed alphabet.
    Chars(CharTokenizer),
    /// A Hugging Face tokenizer (a trained byte-level BPE, or any loaded `tokenizer.json`).
    Bpe(Box<tokenizers::Tokenizer>),
}

impl Tokenizer {
    /// A character tokenizer over `alphabet` (see [`CharTokenizer::new`]).
    pub fn chars(alphabet: &str) -> Result<Tokenizer> {
        CharTokenizer::new(alphabet).map(Tokenizer::Chars)
    }

    /// Trains a byte-level BPE on the text `files` with at most `vocab_size`
    /// ids (fewer when the corpus has fewer distinct merges). Id 0 is
    /// [`END_OF_TEXT`]; ids 1..=256 are the bytes, so no text is ever unknown.
    pub fn train_bpe(files: &[impl AsRef<Path>], vocab_size: usize) -> Result<Tokenizer> {
        use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
        use tokenizers::models::TrainerWrapper;
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::AddedToken;

        let base = 1 + ByteLevel::alphabet().len();
        if vocab_size < base {
            return Err(Error::Data(format!(
                "a byte-level BPE needs a vocabulary of at least {base} ids (the end-of-text token and the 256 bytes), {vocab_size} was asked; ask for more (a few thousand is typical)"
            )));
        }
        if files.is_empty() {
            return Err(Error::Data("no text files to train a BPE tokenizer on; pass at least one".into()));
        }
        let mut names = Vec::with_capacity(files.len());
        for file in files {
            let file = file.as_ref();
            if !file.is_file() {
                return Err(Error::data_file(file, "is not a readable file; check the path"));
            }
            names.push(file.to_string_lossy().into_owned());
        }
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .show_progress(false)
            .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        // No prefix space: decoding must give back exactly the text encoded.
        let byte_level = ByteLevel::default().add_prefix_space(false);
        let mut bpe = tokenizers::Tokenizer::new(BPE::default());
        bpe.with_pre_tokenizer(Some(byte_level)).with_decoder(Some(byte_level));
        bpe.train_from_files(&mut trainer, names)
            .map_err(|e| Error::Data(format!("training a BPE tokenizer failed: {e}; every input must be a readable UTF-8 text file")))?;
        Ok(Tokenizer::Bpe(Box::new(bpe)))
    }

    /// Loads a `tokenizer.json`: a Hugging Face tokenizer or a Tessera character tokenizer.
    pub fn load(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::data_file_io(path, "cannot be read", e, "; check the path"))?;
        let not_a_tokenizer = |e: &dyn std::fmt::Display| {
            Error::data_file(path, format!("is not a tokenizer.json ({e}); pass one written by `tessera prepare` or by the `tokenizers` library"))
        };
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| not_a_tokenizer(&e))?;
        if json.get("tessera").is_some() {
            let file: CharTokenizerFile = serde_json::from_value(json).map_err(|e| not_a_tokenizer(&e))?;
            if file.tessera != CHAR_TOKENIZER_TAG || file.version != 1 {
                return Err(not_a_tokenizer(&format!("unknown Tessera tokenizer `{}` version {}", file.tessera, file.version)));
            }
            return CharTokenizer::new(&file.alphabet).map(Tokenizer::Chars).map_err(|e| not_a_tokenizer(&e));
        }
        let bpe: tokenizers::Tokenizer = text.parse().map_err(|e| not_a_tokenizer(&e))?;
        Ok(Tokenizer::Bpe(Box::new(bpe)))
    }

    /// Writes the tokenizer to `path` as JSON; [`Tokenizer::load`] reads it back.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let json = self.to_json()?;
        tessera_core::file::write_atomic(path, json.as_bytes())
            .map_err(|e| Error::data_file_io(path, "cannot be written", e, "; check that its directory exists and is writable"))
    }

    /// The tokenizer's JSON, as [`Tokenizer::save`] writes it.
    pub fn to_json(&self) -> Result<String> {
        match self {
            Tokenizer::Chars(c) => {
                let file = CharTokenizerFile { tessera: CHAR_TOKENIZER_TAG.into(), version: 1, alphabet: c.alphabet() };
                serde_json::to_string_pretty(&file).map_err(|e| Error::Data(format!("serialising a character tokenizer: {e}")))
            }
            Tokenizer::Bpe(b) => b.to_string(true).map_err(|e| Error::Data(format!("serialising a BPE tokenizer: {e}"))),
        }
    }

    /// The token ids of `text`, with the special tokens the tokenizer's
    /// post-processor adds (as Hugging Face's `encode`); see
    /// [`encode_with`](Self::encode_with) to leave them out.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, SpecialTokens::Added)
    }

    /// The token ids of `text`, with or without the post-processor's special tokens.
    pub fn encode_with(&self, text: &str, special: SpecialTokens) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Chars(c) => c.encode(text),
            Tokenizer::Bpe(b) => b
                .encode(text, special == SpecialTokens::Added)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| Error::Data(format!("the BPE tokenizer cannot encode a text: {e}"))),
        }
    }

    /// The special tokens the post-processor puts before and after one
    /// sequence (`([BOS], [])` for Llama's, `([], [])` for GPT-2's), so that
    /// a document encoded in pieces gets them once. Found by encoding a
    /// probe text with and without them: the plain ids sit inside the
    /// others, and what surrounds them is the answer.
    pub fn special_affixes(&self) -> Result<(Vec<u32>, Vec<u32>)> {
        if let Tokenizer::Chars(_) = self {
            return Ok((Vec::new(), Vec::new()));
        }
        for probe in ["a", "0", " ", "the", ""] {
            let (Ok(plain), Ok(full)) = (self.encode_with(probe, SpecialTokens::Omitted), self.encode_with(probe, SpecialTokens::Added)) else { continue };
            if plain.is_empty() {
                // Only the affixes: all of them go first, unless the probes
                // above found where the text goes.
                return Ok((full, Vec::new()));
            }
            if let Some(at) = full.windows(plain.len()).position(|w| w == plain) {
                return Ok((full[..at].to_vec(), full[at + plain.len()..].to_vec()));
            }
        }
        Err(Error::Data("the tokenizer's post-processor does not keep a text's tokens together, so where its special tokens go is unknown; prepare the data without special tokens".into()))
    }

    /// The text of `ids`; every id must be below [`Tokenizer::vocab_size`].
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, SpecialTokens::Added)
    }

    /// The text of `ids`, with the special tokens' text or without it
    /// (`Omitted`: Hugging Face's `skip_special_tokens`, what a generated
    /// answer is shown with); every id must be below [`Tokenizer::vocab_size`].
    pub fn decode_with(&self, ids: &[u32], special: SpecialTokens) -> Result<String> {
        // Each id is looked up rather than compared with `vocab_size`: a
        // Hugging Face tokenizer counts its vocabulary by building the whole
        // map, too slow for a server that decodes a few ids per token.
        let unknown = |id: u32| match self {
            Tokenizer::Chars(c) => id as usize >= c.vocab_size(),
            Tokenizer::Bpe(b) => b.id_to_token(id).is_none(),
        };
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| unknown(id)) {
            return Err(Error::Data(format!(
                "token id {id} at position {i} is outside the tokenizer's vocabulary of {} ids; decode only ids this tokenizer produced",
                self.vocab_size()
            )));
        }
        match self {
            Tokenizer::Chars(c) => c.decode(ids),
            Tokenizer::Bpe(b) => b.decode(ids, special == SpecialTokens::Omitted).map_err(|e| Error::Data(format!("the BPE tokenizer cannot decode: {e}"))),
        }
    }

    /// The id of the token spelt `token` (a special token such as `<s>`, or
    /// a vocabulary entry in the tokenizer's own spelling), if there is one.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match self {
            Tokenizer::Chars(c) => {
                let mut chars = token.chars();
                match (chars.next(), chars.next()) {
                    (Some(ch), None) => c.id(ch),
                    _ => None,
                }
            }
            Tokenizer::Bpe(b) => b.token_to_id(token),
        }
    }

    /// The spelling of token `id` (the inverse of [`token_id`](Self::token_id)).
    pub fn token(&self, id: u32) -> Option<String> {
        match self {
            Tokenizer::Chars(c) => c.chars.get(id as usize).map(|ch| ch.to_string()),
            Tokenizer::Bpe(b) => b.id_to_token(id),
        }
    }

    /// How many distinct ids the tokenizer produces (special tokens included).
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Chars(c) => c.vocab_size(),
            Tokenizer::Bpe(b) => b.get_vocab_size(true),
        }
    }

    /// The id written between two documents: [`END_OF_TEXT`] for a BPE, the
    /// newline for a character tokenizer whose alphabet has one; `None` when
    /// there is no such token (documents are then simply concatenated).
    pub fn document_separator(&self) -> Option<u32> {
        match self {
            Tokenizer::Chars(c) => c.id('\n'),
            Tokenizer::Bpe(b) => b.token_to_id(END_OF_TEXT),
        }
    }

    /// `"chars"` or `"bpe"`: what the shard index records.
    pub fn kind(&self) -> &'static str {
        match self {
            Tokenizer::Chars(_) => "chars",
            Tokenizer::Bpe(_) => "bpe",
        }
    }
}

const CHAR_TOKENIZER_TAG: &str = "char-tokenizer";

/// The JSON form of a [`CharTokenizer`].
#[derive(Serialize, Deserialize)]
struct CharTokenizerFile {
    tessera: String,
    version: u32,
    alphabet: String,
}

/// A tokenizer with one id per character: id `i` is the `i`-th character of its alphabet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CharTokenizer {
    chars: Vec<char>,
    ids: HashMap<char, u32>,
}

impl CharTokenizer {
    /// A tokenizer over the characters of `alphabet`, in that order; each may appear once.
    pub fn new(alphabet: &str) -> Result<Self> {
        let chars: Vec<char> = alphabet.chars().collect();
        if chars.is_empty() {
            return Err(Error::Data("a character tokenizer needs a non-empty alphabet".into()));
        }
        let mut ids = HashMap::with_capacity(chars.len());
        for (i, &c) in chars.iter().enumerate() {
            if ids.insert(c, i as u32).is_some() {
                return Err(Error::Data(format!("the character {c:?} appears twice in the alphabet; list each character once")));
            }
        }
        Ok(Self { chars, ids })
    }

    /// A tokenizer over every character that occurs in `texts`, in code-point order
    /// (so the same characters always give the same ids).
    pub fn covering<'a>(texts: impl IntoIterator<Item = &'a str>) -> Result<Self> {
        let mut seen = std::collections::BTreeSet::new();
        for text in texts {
            seen.extend(text.chars());
        }
        Self::new(&seen.into_iter().collect::<String>())
    }

    /// The alphabet, in id order.
    pub fn alphabet(&self) -> String {
        self.chars.iter().collect()
    }

    /// The id of `c`, if it is in the alphabet.
    pub fn id(&self, c: char) -> Option<u32> {
        self.ids.get(&c).copied()
    }

    /// The number of ids: the alphabet's length.
    pub fn vocab_size(&self) -> usize {
        self.chars.len()
    }

    /// One id per character of `text`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.chars()
            .enumerate()
            .map(|(i, c)| {
                self.id(c).ok_or_else(|| {
                    Error::Data(format!(
                        "the character {c:?} at position {i} is not in the tokenizer's alphabet {:?}; add it to the alphabet or use a BPE tokenizer",
                        self.alphabet()
                    ))
                })
            })
            .collect()
    }

    /// The characters of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        ids.iter()
            .enumerate()
            .map(|(i, &id)| {
                self.chars
                    .get(id as usize)
                    .copied()
                    .ok_or_else(|| Error::Data(format!("token id {id} at position {i} is outside the alphabet of {} characters", self.chars.len())))
            })
            .collect()
    }
}
