//! Text files to a token-shard dataset: what `tessera prepare` runs.

use super::{CharTokenizer, Index, ShardWriter, SpecialTokens, Tokenizer};
use std::path::{Path, PathBuf};
use tessera_core::{Error, Result};

/// Where the dataset's tokenizer comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerSource {
    /// Load this `tokenizer.json`.
    File(PathBuf),
    /// Train a byte-level BPE with this many ids on the input files.
    TrainBpe(usize),
    /// One id per character occurring in the input files.
    Chars,
}

/// Encoding happens in pieces of about this many bytes, cut after a newline,
/// so that a large file never needs its whole encoding in memory at once.
const ENCODE_CHUNK_BYTES: usize = 1 << 20;

/// The text files named by `inputs`: files as given, directories searched
/// recursively (hidden entries skipped), in path order.
pub fn input_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for input in inputs {
        if input.is_dir() {
            let mut found = Vec::new();
            collect_files(input, &mut found)?;
            found.sort();
            files.extend(found);
        } else if input.is_file() {
            files.push(input.clone());
        } else {
            return Err(Error::data_file(input, "does not exist; pass text files or directories that hold them"));
        }
    }
    if files.is_empty() {
        return Err(Error::Data(format!("no input files found in {inputs:?}; pass text files or directories that hold them")));
    }
    Ok(files)
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::data_file_io(dir, "cannot be listed", e, ""))?;
    for entry in entries {
        let path = entry.map_err(|e| Error::data_file_io(dir, "cannot be listed", e, ""))?.path();
        if path.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')) {
            continue;
        }
        if path.is_dir() {
            collect_files(&path, out)?;
        } else if path.is_file() {
            out.push(path);
        }
    }
    Ok(())
}

/// Tokenizes `files` (one document each) into a new dataset in `out`, which
/// must not exist yet or be empty; `shard_tokens` tokens per shard. With
/// [`SpecialTokens::Added`], each document gets the special tokens the
/// tokenizer's post-processor adds around a sequence (Llama's BOS), once.
pub fn prepare(files: &[PathBuf], out: &Path, source: &TokenizerSource, shard_tokens: usize, special: SpecialTokens) -> Result<Index> {
    if out.exists() && std::fs::read_dir(out).map_or(true, |mut d| d.next().is_some()) {
        return Err(Error::data_file(out, "already exists and is not empty; choose a new output directory or remove this one"));
    }
    if files.is_empty() {
        return Err(Error::Data("no input files to prepare; pass at least one".into()));
    }
    let tokenizer = match source {
        TokenizerSource::File(path) => Tokenizer::load(path)?,
        TokenizerSource::TrainBpe(vocab) => Tokenizer::train_bpe(files, *vocab)?,
        TokenizerSource::Chars => {
            let texts = files.iter().map(|f| read_text(f)).collect::<Result<Vec<_>>>()?;
            let chars = CharTokenizer::covering(texts.iter().map(String::as_str))?;
            Tokenizer::Chars(chars)
        }
    };
    let (prefix, suffix) = match special {
        SpecialTokens::Added => tokenizer.special_affixes()?,
        SpecialTokens::Omitted => (Vec::new(), Vec::new()),
    };
    let mut writer = ShardWriter::create(out, tokenizer.vocab_size(), tokenizer.document_separator(), shard_tokens)?;
    for file in files {
        let text = read_text(file)?;
        writer.push(&prefix)?;
        for piece in pieces(&text) {
            let ids = tokenizer.encode_with(piece, SpecialTokens::Omitted).map_err(|e| Error::data_file(file, e.to_string()))?;
            writer.push(&ids)?;
        }
        writer.push(&suffix)?;
        writer.end_document();
    }
    writer.finish(Some(&tokenizer))
}

fn read_text(file: &Path) -> Result<String> {
    let bytes = std::fs::read(file).map_err(|e| Error::data_file_io(file, "cannot be read", e, ""))?;
    String::from_utf8(bytes).map_err(|e| {
        Error::data_file(file, format!("is not UTF-8 text (invalid byte at offset {}); convert it to UTF-8 or leave it out", e.utf8_error().valid_up_to()))
    })
}

/// `text` cut into pieces of about [`ENCODE_CHUNK_BYTES`], each ending just after a newline where there is one.
fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut cut = rest.len().min(ENCODE_CHUNK_BYTES);
        while !rest.is_char_boundary(cut) {
            cut += 1;
        }
        if cut < rest.len() {
            cut = rest[cut..].find('\n').map_or(rest.len(), |i| cut + i + 1);
        }
        let (piece, tail) = rest.split_at(cut);
        rest = tail;
        Some(piece)
    })
}
