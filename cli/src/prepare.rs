//! `tessera prepare`.

/// Arguments of `tessera prepare`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`tessera prepare` is not implemented yet")
}
