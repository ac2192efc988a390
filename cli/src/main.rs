//! `tessera`: the command-line tools around training runs.
//!
//! - `tessera prepare`: turn text files into memory-mapped token shards;
//! - `tessera ckpt inspect` / `tessera ckpt reshard`: look into a checkpoint,
//!   and rewrite it for another mesh.

mod ckpt;
mod prepare;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "tessera", version, about = "Tessera's tools: data preparation and checkpoints")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Tokenize text files into memory-mapped token shards.
    Prepare(prepare::Args),
    /// Inspect or reshard a checkpoint.
    #[command(subcommand)]
    Ckpt(ckpt::Command),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Prepare(args) => prepare::run(args),
        Command::Ckpt(cmd) => ckpt::run(cmd),
    }
}
