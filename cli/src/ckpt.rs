//! `tessera ckpt`.

/// The `tessera ckpt` subcommands.
#[derive(clap::Subcommand)]
pub enum Command {}

pub fn run(cmd: Command) -> anyhow::Result<()> {
    match cmd {}
}
