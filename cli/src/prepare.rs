//! `tessera prepare`: text files (or the bundled task) to a token-shard dataset.

use anyhow::{bail, Context};
use std::path::PathBuf;
use tessera::data::{self, arith, Index, TokenizerSource};

/// Arguments of `tessera prepare`.
#[derive(clap::Args)]
#[command(group = clap::ArgGroup::new("tokenizer-source").args(["tokenizer", "train_bpe", "chars"]))]
pub struct Args {
    /// Text files, or directories searched recursively for them; each file is one document.
    #[arg(long, num_args = 1.., required_unless_present = "bundled", conflicts_with = "bundled")]
    input: Vec<PathBuf>,

    /// The directory to write the dataset into; it must not exist yet, or be empty.
    #[arg(long)]
    out: PathBuf,

    /// Tokenize with this tokenizer.json (a Hugging Face tokenizer, or one written by this command).
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,

    /// Train a byte-level BPE with this many ids on the input files.
    #[arg(long, value_name = "VOCAB")]
    train_bpe: Option<usize>,

    /// One id per character that occurs in the input files.
    #[arg(long)]
    chars: bool,

    /// Leave out the special tokens (BOS, EOS, ...) the tokenizer file's post-processor adds
    /// around each document; by default they are added, as Hugging Face's `encode` does.
    #[arg(long)]
    no_special_tokens: bool,

    /// Tokens per shard file.
    #[arg(long, value_name = "N", default_value_t = 1 << 24)]
    shard_tokens: usize,

    /// Write a bundled dataset instead of reading input files.
    #[arg(long, value_enum, conflicts_with = "tokenizer-source")]
    bundled: Option<Bundled>,

    /// With --bundled: write the task as text files (to try `--input` on) instead of shards.
    #[arg(long, requires = "bundled")]
    text: bool,

    /// With --bundled: the seed of the task's train/held-out split and problems.
    #[arg(long, default_value_t = 0, requires = "bundled")]
    seed: u64,

    /// With --bundled: how many training problems to generate.
    #[arg(long, default_value_t = arith::DEFAULT_TRAIN_SIZE, requires = "bundled")]
    train_size: usize,
}

/// The datasets `--bundled` can write.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Bundled {
    /// Three-digit addition, every number least significant digit first: 123+45=168 is `321+540=8610`.
    Arith,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(Bundled::Arith) = args.bundled {
        if args.train_size == 0 {
            bail!("--train-size 0 would write no training problems; give at least 1 (the default is {})", arith::DEFAULT_TRAIN_SIZE);
        }
        let task = arith::Task::new(args.seed).with_train_size(args.train_size);
        if args.text {
            for path in task.write_text(&args.out)? {
                say!("wrote {}", path.display());
            }
            return Ok(());
        }
        let index = task.write_shards(&args.out, args.shard_tokens).context("writing the bundled arithmetic dataset")?;
        report(&args.out, &index);
        return Ok(());
    }
    let source = match (args.tokenizer, args.train_bpe, args.chars) {
        (Some(file), None, false) => TokenizerSource::File(file),
        (None, Some(vocab), false) => TokenizerSource::TrainBpe(vocab),
        (None, None, true) => TokenizerSource::Chars,
        _ => bail!("choose how to tokenize: --tokenizer FILE, --train-bpe VOCAB or --chars"),
    };
    let files = data::input_files(&args.input)?;
    let special = if args.no_special_tokens { data::SpecialTokens::Omitted } else { data::SpecialTokens::Added };
    let index = data::prepare(&files, &args.out, &source, args.shard_tokens, special)?;
    report(&args.out, &index);
    Ok(())
}

fn report(out: &std::path::Path, index: &Index) {
    say!(
        "wrote {} tokens from {} document(s) in {} shard(s) of {} to {}; vocabulary {} ({})",
        index.total_tokens,
        index.documents,
        index.shards.len(),
        index.dtype,
        out.display(),
        index.vocab_size,
        index.tokenizer_kind.as_deref().unwrap_or("no tokenizer"),
    );
}
