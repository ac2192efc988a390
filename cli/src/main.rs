//! `tessera`: the command-line tools around training runs.
//!
//! - `tessera prepare`: turn text files into memory-mapped token shards;
//! - `tessera train`: run a training configuration (any model kind, from
//!   scratch or from a Hugging Face directory, on any mesh);
//! - `tessera export`: write a run's checkpoint as a Hugging Face directory;
//! - `tessera generate`: text from a Hugging Face model or a trained run,
//!   through the serving engine;
//! - `tessera serve`: the same behind an OpenAI-compatible HTTP API;
//! - `tessera perplexity`: how well a model predicts a text, its weights
//!   optionally quantized;
//! - `tessera ckpt inspect` / `tessera ckpt reshard`: look into a checkpoint,
//!   and rewrite it for another mesh;
//! - `tessera launch`: start one process per rank on this node with
//!   torchrun's environment variables, and supervise them;
//! - `tessera profile`: measure this machine into a planner's profile.
//! - `tessera plan`: the fastest layout of a model over a cluster, written as a training configuration.

/// Prints a line to stdout; when the reader has gone (`tessera … | head`),
/// the program ends quietly and successfully, as Unix tools do.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout(), $($t)*).is_err() {
            std::process::exit(0);
        }
    }};
}

mod ckpt;
mod export;
mod generate;
mod launch;
mod model;
mod perplexity;
mod plan;
mod prepare;
mod profile;
mod server;
mod train;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "tessera", version, about = "Tessera's tools: data preparation, training, export and checkpoints")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Tokenize text files into memory-mapped token shards.
    Prepare(prepare::Args),
    /// Train a model as a TOML configuration says (see docs/training.md).
    Train(train::Args),
    /// Write a training run's checkpoint as a Hugging Face model directory.
    Export(export::Args),
    /// Inspect or reshard a checkpoint.
    #[command(subcommand)]
    Ckpt(ckpt::Command),
    /// Serve a Hugging Face model or a trained run over an OpenAI-compatible HTTP API (see docs/serving.md).
    Serve(server::Args),
    /// Generate text with a Hugging Face model or a trained run, through the serving engine (see docs/serving.md).
    Generate(generate::Args),
    /// The perplexity of a model on a text, its weights optionally quantized (see docs/serving.md).
    Perplexity(perplexity::Args),
    /// Start one process per rank on this node, torchrun-style, and supervise them (see docs/launch.md).
    Launch(launch::Args),
    /// Measure what this machine's CPU ranks or GPUs, or a launched job's ranks and links, can do into a planner's profile (see docs/planner.md).
    Profile(profile::Args),
    /// Find the fastest layout of a model over a cluster and write it as a training configuration (see docs/planner.md).
    Plan(plan::Args),
}

fn main() -> anyhow::Result<()> {
    let r = match Cli::parse().command {
        Command::Prepare(args) => prepare::run(args),
        Command::Train(args) => train::run(args),
        Command::Export(args) => export::run(args),
        Command::Serve(args) => server::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Perplexity(args) => perplexity::run(args),
        Command::Ckpt(cmd) => ckpt::run(cmd),
        Command::Launch(args) => launch::run(args),
        Command::Profile(args) => profile::run(args),
        Command::Plan(args) => plan::run(args),
    };
    // A reader that went away is not an error of this program.
    match r {
        Err(e) if e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)) => Ok(()),
        r => r,
    }
}
