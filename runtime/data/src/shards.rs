//! Token shards: the on-disk form of a tokenized corpus, written once by
//! [`ShardWriter`] and read back, memory-mapped, through [`Dataset`].
//!
//! A dataset is a directory:
//!
//! - `shard-00000.bin`, `shard-00001.bin`, ...: a 24-byte header (the magic
//!   bytes `TSRTOKEN`, format version `u32`, token width in bytes `u32`
//!   (2 or 4), token count `u64`, all little-endian) followed by the tokens as
//!   little-endian `u16` (when every id fits in 16 bits) or `u32`;
//! - `index.json`: the [`Index`] (tokenizer file, vocabulary size, token
//!   dtype, document separator, each shard's file and token count);
//! - `tokenizer.json`: the tokenizer that produced the ids, when there is one.
//!
//! The index is written last, so a directory without one was never finished.
//! Opening checks every shard's header and size against the index, so a
//! truncated or foreign file is reported by name before any training starts.

use super::Tokenizer;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tessera_core::file::{map_read_only, write_atomic, Mmap};
use tessera_core::{Error, Result};

/// The first eight bytes of every shard.
pub const MAGIC: [u8; 8] = *b"TSRTOKEN";
/// The shard and index format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The size of a shard's header, in bytes.
pub const HEADER_BYTES: usize = 24;
/// The index's file name inside a dataset directory.
pub const INDEX_FILE: &str = "index.json";
/// The tokenizer's file name inside a dataset directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// What the index's `format` field holds.
pub const INDEX_FORMAT: &str = "tessera-token-shards";

const REPREPARE: &str = "re-run `tessera prepare` to write the dataset again, or copy the directory again if it was copied";

/// How token ids are stored in a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDType {
    /// Two bytes per token: vocabularies of at most 65,536 ids.
    U16,
    /// Four bytes per token: larger vocabularies.
    U32,
}

impl TokenDType {
    /// The narrowest dtype that holds every id below `vocab_size`.
    pub fn for_vocab(vocab_size: usize) -> Self {
        if vocab_size <= 1 << 16 {
            TokenDType::U16
        } else {
            TokenDType::U32
        }
    }

    /// Bytes per token.
    pub fn width(self) -> usize {
        match self {
            TokenDType::U16 => 2,
            TokenDType::U32 => 4,
        }
    }
}

impl std::fmt::Display for TokenDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TokenDType::U16 => "u16",
            TokenDType::U32 => "u32",
        })
    }
}

/// One shard as the index lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// The file name, relative to the dataset directory.
    pub file: String,
    /// How many tokens it holds.
    pub tokens: u64,
}

/// A dataset's `index.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Index {
    /// Always [`INDEX_FORMAT`].
    pub format: String,
    /// The format version, [`FORMAT_VERSION`] for what this build writes.
    pub version: u32,
    /// The tokenizer's file name in the dataset directory, if one was saved.
    pub tokenizer: Option<String>,
    /// `"chars"` or `"bpe"`, when a tokenizer was saved.
    pub tokenizer_kind: Option<String>,
    /// Every token id is below this.
    pub vocab_size: usize,
    /// How the shards store ids.
    pub dtype: TokenDType,
    /// The id written between documents, if any.
    pub document_separator: Option<u32>,
    /// How many documents were written.
    pub documents: u64,
    /// The sum of the shards' token counts.
    pub total_tokens: u64,
    /// The shards, in stream order.
    pub shards: Vec<ShardEntry>,
}

/// Writes a token stream into shards of a fixed size, then the index.
///
/// Tokens arrive with [`push`](ShardWriter::push); [`end_document`](ShardWriter::end_document)
/// marks a document boundary, where the separator id goes before the next
/// document's first token. [`finish`](ShardWriter::finish) writes the last
/// shard, the tokenizer and the index.
pub struct ShardWriter {
    dir: PathBuf,
    vocab_size: usize,
    dtype: TokenDType,
    separator: Option<u32>,
    shard_tokens: usize,
    pending: Vec<u32>,
    shards: Vec<ShardEntry>,
    documents: u64,
    in_document: bool,
    separate_next: bool,
}

impl ShardWriter {
    /// A writer into `dir` (created if missing) for ids below `vocab_size`,
    /// `shard_tokens` tokens per shard, `separator` between documents.
    pub fn create(dir: impl AsRef<Path>, vocab_size: usize, separator: Option<u32>, shard_tokens: usize) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        if vocab_size == 0 || vocab_size > u32::MAX as usize {
            return Err(Error::Data(format!("a vocabulary of {vocab_size} ids cannot be stored; it must be between 1 and {}", u32::MAX)));
        }
        if shard_tokens == 0 {
            return Err(Error::Data("shards must hold at least one token; pass a positive shard size".into()));
        }
        if let Some(sep) = separator.filter(|&s| s as usize >= vocab_size) {
            return Err(Error::Data(format!("the document separator {sep} is outside the vocabulary of {vocab_size} ids")));
        }
        std::fs::create_dir_all(&dir).map_err(|e| Error::data_file_io(&dir, "cannot be created", e, "; check the path and permissions"))?;
        Ok(Self {
            dir,
            vocab_size,
            dtype: TokenDType::for_vocab(vocab_size),
            separator,
            shard_tokens,
            pending: Vec::new(),
            shards: Vec::new(),
            documents: 0,
            in_document: false,
            separate_next: false,
        })
    }

    /// Appends `tokens` to the current document.
    pub fn push(&mut self, tokens: &[u32]) -> Result<()> {
        if let Some((i, &t)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= self.vocab_size) {
            return Err(Error::Data(format!(
                "token {t} at position {i} is outside the vocabulary of {} ids; it was not produced by this dataset's tokenizer",
                self.vocab_size
            )));
        }
        if tokens.is_empty() {
            return Ok(());
        }
        if std::mem::take(&mut self.separate_next) {
            if let Some(sep) = self.separator {
                self.append(&[sep])?;
            }
        }
        if !self.in_document {
            self.in_document = true;
            self.documents += 1;
        }
        self.append(tokens)
    }

    /// Ends the current document: the separator goes before the next token pushed.
    pub fn end_document(&mut self) {
        if self.in_document {
            self.in_document = false;
            self.separate_next = true;
        }
    }

    /// Writes the last shard, `tokenizer` (if given) and the index; returns the index.
    pub fn finish(mut self, tokenizer: Option<&Tokenizer>) -> Result<Index> {
        if !self.pending.is_empty() {
            self.flush_shard()?;
        }
        if let Some(tok) = tokenizer {
            if tok.vocab_size() > self.vocab_size {
                return Err(Error::Data(format!(
                    "the tokenizer has {} ids but the shards were written for {}; create the writer with the tokenizer's vocabulary size",
                    tok.vocab_size(),
                    self.vocab_size
                )));
            }
            tok.save(self.dir.join(TOKENIZER_FILE))?;
        }
        let index = Index {
            format: INDEX_FORMAT.into(),
            version: FORMAT_VERSION,
            tokenizer: tokenizer.map(|_| TOKENIZER_FILE.into()),
            tokenizer_kind: tokenizer.map(|t| t.kind().into()),
            vocab_size: self.vocab_size,
            dtype: self.dtype,
            document_separator: self.separator,
            documents: self.documents,
            total_tokens: self.shards.iter().map(|s| s.tokens).sum(),
            shards: self.shards,
        };
        let path = self.dir.join(INDEX_FILE);
        let json = serde_json::to_string_pretty(&index).map_err(|e| Error::Data(format!("serialising the shard index: {e}")))?;
        write_atomic(&path, json.as_bytes()).map_err(|e| Error::data_file_io(&path, "cannot be written", e, ""))?;
        Ok(index)
    }

    fn append(&mut self, mut tokens: &[u32]) -> Result<()> {
        while !tokens.is_empty() {
            let take = tokens.len().min(self.shard_tokens - self.pending.len());
            self.pending.extend_from_slice(&tokens[..take]);
            tokens = &tokens[take..];
            if self.pending.len() == self.shard_tokens {
                self.flush_shard()?;
            }
        }
        Ok(())
    }

    fn flush_shard(&mut self) -> Result<()> {
        let file = format!("shard-{:05}.bin", self.shards.len());
        let path = self.dir.join(&file);
        let mut bytes = Vec::with_capacity(HEADER_BYTES + self.pending.len() * self.dtype.width());
        bytes.extend_from_slice(&MAGIC);
        bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        bytes.extend_from_slice(&(self.dtype.width() as u32).to_le_bytes());
        bytes.extend_from_slice(&(self.pending.len() as u64).to_le_bytes());
        match self.dtype {
            // Ids were checked against the vocabulary, which fits u16 here.
            TokenDType::U16 => self.pending.iter().for_each(|&t| bytes.extend_from_slice(&(t as u16).to_le_bytes())),
            TokenDType::U32 => self.pending.iter().for_each(|&t| bytes.extend_from_slice(&t.to_le_bytes())),
        }
        write_atomic(&path, &bytes).map_err(|e| Error::data_file_io(&path, "cannot be written", e, "; check free space and permissions"))?;
        self.shards.push(ShardEntry { file, tokens: self.pending.len() as u64 });
        self.pending.clear();
        Ok(())
    }
}

/// A tokenized dataset opened for reading: the index and every shard, memory-mapped.
///
/// Cloning is cheap (the mappings are shared).
#[derive(Clone)]
pub struct Dataset {
    dir: PathBuf,
    index: Index,
    shards: Arc<[Shard]>,
}

struct Shard {
    path: PathBuf,
    map: Mmap,
    tokens: u64,
}

impl Dataset {
    /// Opens the dataset in `dir`, checking the index and every shard's header and size.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let index_path = dir.join(INDEX_FILE);
        let text = std::fs::read_to_string(&index_path).map_err(|e| {
            Error::data_file_io(
                &index_path,
                "cannot be read",
                e,
                format!("; point at a directory written by `tessera prepare` (a directory without an index was never finished: {REPREPARE})"),
            )
        })?;
        let index: Index = serde_json::from_str(&text).map_err(|e| Error::data_file(&index_path, format!("is not a shard index ({e}); {REPREPARE}")))?;
        if index.format != INDEX_FORMAT || index.version != FORMAT_VERSION {
            return Err(Error::data_file(
                &index_path,
                format!("has format `{}` version {}, this build reads `{INDEX_FORMAT}` version {FORMAT_VERSION}; {REPREPARE}", index.format, index.version),
            ));
        }
        if index.dtype == TokenDType::U16 && TokenDType::for_vocab(index.vocab_size) == TokenDType::U32 {
            return Err(Error::data_file(&index_path, format!("stores ids as u16 but the vocabulary has {} ids; {REPREPARE}", index.vocab_size)));
        }
        let total: u64 = index.shards.iter().map(|s| s.tokens).sum();
        if total != index.total_tokens {
            return Err(Error::data_file(&index_path, format!("says {} tokens in all but its shards add up to {total}; {REPREPARE}", index.total_tokens)));
        }
        let shards = index.shards.iter().map(|entry| Shard::open(&dir, entry, index.dtype)).collect::<Result<Vec<_>>>()?;
        Ok(Self { dir, index, shards: shards.into() })
    }

    /// The directory the dataset was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The index.
    pub fn index(&self) -> &Index {
        &self.index
    }

    /// Every token id is below this.
    pub fn vocab_size(&self) -> usize {
        self.index.vocab_size
    }

    /// The tokenizer saved with the shards.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        match &self.index.tokenizer {
            Some(file) => Tokenizer::load(self.dir.join(file)),
            None => Err(Error::Data(format!(
                "the dataset in `{}` was written without a tokenizer; load the one that produced its ids directly",
                self.dir.display()
            ))),
        }
    }

    /// The number of shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The number of tokens in shard `shard`.
    pub fn shard_tokens(&self, shard: usize) -> u64 {
        self.shards.get(shard).map_or(0, |s| s.tokens)
    }

    /// The number of tokens in all shards.
    pub fn total_tokens(&self) -> u64 {
        self.index.total_tokens
    }

    /// Copies `out.len()` tokens of shard `shard`, from token `start` on, into `out`.
    pub fn read(&self, shard: usize, start: u64, out: &mut [u32]) -> Result<()> {
        let s = self.shards.get(shard).ok_or_else(|| Error::Data(format!("shard {shard} does not exist; the dataset has {}", self.shards.len())))?;
        let end = start.checked_add(out.len() as u64).filter(|&e| e <= s.tokens).ok_or_else(|| {
            Error::Data(format!(
                "tokens {start}..{} are past the end of shard `{}`, which holds {}",
                start as u128 + out.len() as u128,
                s.path.display(),
                s.tokens
            ))
        })?;
        let width = self.index.dtype.width();
        let bytes = &s.map[HEADER_BYTES + start as usize * width..HEADER_BYTES + end as usize * width];
        match self.index.dtype {
            TokenDType::U16 => out.iter_mut().zip(bytes.chunks_exact(2)).for_each(|(o, b)| *o = u16::from_le_bytes([b[0], b[1]]) as u32),
            TokenDType::U32 => out.iter_mut().zip(bytes.chunks_exact(4)).for_each(|(o, b)| *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        }
        if let Some((i, &t)) = out.iter().enumerate().find(|(_, &t)| t as usize >= self.index.vocab_size) {
            return Err(Error::data_file(
                &s.path,
                format!(
                    "token {t} at position {} is outside the vocabulary of {} ids: the file is corrupt; {REPREPARE}",
                    start + i as u64,
                    self.index.vocab_size
                ),
            ));
        }
        Ok(())
    }

    /// Tokens `start..start + len` of shard `shard`.
    pub fn tokens(&self, shard: usize, start: u64, len: usize) -> Result<Vec<u32>> {
        let mut out = vec![0; len];
        self.read(shard, start, &mut out)?;
        Ok(out)
    }
}

impl std::fmt::Debug for Dataset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dataset").field("dir", &self.dir).field("index", &self.index).finish()
    }
}

impl Shard {
    fn open(dir: &Path, entry: &ShardEntry, dtype: TokenDType) -> Result<Self> {
        let path = dir.join(&entry.file);
        let bad = |detail: String| Error::data_file(&path, format!("{detail}; {REPREPARE}"));
        let io = |doing, e| Error::data_file_io(&path, doing, e, format!("; {REPREPARE}"));
        let file = File::open(&path).map_err(|e| io("cannot be opened", e))?;
        let len = file.metadata().map_err(|e| io("cannot be inspected", e))?.len();
        if len < HEADER_BYTES as u64 {
            return Err(bad(format!("is truncated: {len} bytes, shorter than the {HEADER_BYTES}-byte header")));
        }
        let map = map_read_only(&file).map_err(|e| io("cannot be memory-mapped", e))?;
        if map[..8] != MAGIC {
            return Err(bad("is not a Tessera token shard (wrong magic bytes)".into()));
        }
        let u32_at = |at: usize| u32::from_le_bytes([map[at], map[at + 1], map[at + 2], map[at + 3]]);
        let version = u32_at(8);
        if version != FORMAT_VERSION {
            return Err(bad(format!("has shard format version {version}, this build reads version {FORMAT_VERSION}")));
        }
        let width = u32_at(12);
        if width as usize != dtype.width() {
            return Err(bad(format!("stores {width}-byte tokens but the index says {}-byte ({dtype})", dtype.width())));
        }
        let count = u64::from_le_bytes(std::array::from_fn(|i| map[16 + i]));
        if count != entry.tokens {
            return Err(bad(format!("holds {count} tokens but the index says {}", entry.tokens)));
        }
        let expected = count.checked_mul(width as u64).and_then(|b| b.checked_add(HEADER_BYTES as u64));
        if expected != Some(len) {
            let detail = if expected.is_some_and(|e| len < e) { "is truncated" } else { "has trailing bytes" };
            return Err(bad(format!(
                "{detail}: {len} bytes, but a header of {HEADER_BYTES} and {count} tokens of {width} bytes make {}",
                expected.map_or("too many".to_string(), |e| e.to_string())
            )));
        }
        Ok(Self { path, map, tokens: count })
    }
}
