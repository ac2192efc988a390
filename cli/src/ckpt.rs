//! `tessera ckpt`: look into a checkpoint, and rewrite it for another mesh.

use anyhow::Context;
use std::io::Write;
use std::path::{Path, PathBuf};
use tessera::ckpt::{self, Checkpointer, Manifest, MeshInfo, TensorKind, TensorRecord};

/// The `tessera ckpt` subcommands.
#[derive(clap::Subcommand)]
pub enum Command {
    /// Show what a checkpoint holds (step, mesh, tensors with their global
    /// shapes and shards, optimizer, extra state, sizes) and verify every
    /// checksum; exits with an error if one does not match.
    Inspect(InspectArgs),
    /// Rewrite a checkpoint for another mesh, offline and without the model.
    Reshard(ReshardArgs),
}

/// Arguments of `tessera ckpt inspect`.
#[derive(clap::Args)]
pub struct InspectArgs {
    /// A checkpoint directory (`<root>/step-<N>`), or a checkpoint root (its
    /// `latest` checkpoint is inspected).
    dir: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Arguments of `tessera ckpt reshard`.
#[derive(clap::Args)]
pub struct ReshardArgs {
    /// The checkpoint to rewrite (a checkpoint directory, or a root).
    dir: PathBuf,
    /// The new checkpoint directory (must not exist), e.g. `<new root>/step-<N>`.
    #[arg(long)]
    out: PathBuf,
    /// Tensor-parallel degree of the new mesh.
    #[arg(long)]
    tp: usize,
    /// Data-parallel degree of the new mesh.
    #[arg(long)]
    dp: usize,
    /// Pipeline-parallel degree of the new mesh.
    #[arg(long)]
    pp: usize,
    /// Expert-parallel degree of the new mesh.
    #[arg(long, default_value_t = 1)]
    ep: usize,
    /// Model chunks per pipeline stage (for interleaved schedules).
    #[arg(long, default_value_t = 1)]
    chunks: usize,
}

pub fn run(cmd: Command) -> anyhow::Result<()> {
    match cmd {
        Command::Inspect(args) => inspect(&args),
        Command::Reshard(args) => reshard(&args),
    }
}

/// `dir` itself when it holds a manifest, else the checkpoint its `latest`
/// pointer (or its newest `step-<N>` directory) names.
fn resolve(dir: &Path) -> anyhow::Result<PathBuf> {
    if dir.join(ckpt::MANIFEST).exists() {
        return Ok(dir.to_path_buf());
    }
    let root = Checkpointer::open(dir, usize::MAX).with_context(|| format!("`{}` is neither a checkpoint nor a checkpoint root", dir.display()))?;
    if let Some(latest) = root.latest()?.filter(|d| d.is_dir()) {
        return Ok(latest);
    }
    match root.steps()?.pop() {
        Some((_, newest)) => Ok(newest),
        None => anyhow::bail!("`{}` holds no `{}` and no `step-<N>` checkpoint directory", dir.display(), ckpt::MANIFEST),
    }
}

fn inspect(args: &InspectArgs) -> anyhow::Result<()> {
    let dir = resolve(&args.dir)?;
    let manifest = ckpt::read_manifest(&dir)?;
    let verified = ckpt::verify(&dir).map(|_| ());
    let files: Vec<(String, Option<u64>)> =
        manifest.files().into_iter().map(|f| (f.to_string(), std::fs::metadata(dir.join(f)).ok().map(|m| m.len()))).collect();
    let shown = if args.json {
        serde_json::to_string_pretty(&report(&dir, &manifest, &files, &verified))? + "\n"
    } else {
        text_report(&dir, &manifest, &files, &verified)
    };
    // A write error (such as a closed pipe) is an error, not a panic.
    std::io::stdout().lock().write_all(shown.as_bytes()).context("cannot write the report")?;
    verified.with_context(|| format!("checkpoint `{}` failed verification", dir.display()))
}

/// The machine-readable form of `inspect`.
fn report(dir: &Path, m: &Manifest, files: &[(String, Option<u64>)], verified: &tessera::Result<()>) -> serde_json::Value {
    let params: Vec<serde_json::Value> = m
        .params
        .iter()
        .map(|p| {
            let pieces: Vec<serde_json::Value> = TensorKind::ALL
                .iter()
                .flat_map(|&k| m.pieces(&p.name, k))
                .map(|r| {
                    serde_json::json!({
                        "kind": r.kind,
                        "file": r.file,
                        "key": r.name,
                        "offsets": r.region.offsets,
                        "shape": r.region.shape,
                        "elements": r.region.flat,
                        "dtype": r.dtype,
                        "bytes": r.byte_len(),
                        "steps": r.steps,
                    })
                })
                .collect();
            serde_json::json!({
                "name": p.name,
                "aliases": p.aliases,
                "global_shape": p.global_shape,
                "dtype": p.dtype,
                "split_dim": p.split_dim,
                "stages": p.stages,
                "expert": p.expert,
                "pieces": pieces,
            })
        })
        .collect();
    serde_json::json!({
        "dir": dir.display().to_string(),
        "format": m.format,
        "step": m.step,
        "mesh": m.mesh,
        "zero_stage": m.zero_stage,
        "optimizer": m.optimizer,
        "extra": m.extra,
        "params": params,
        "files": files.iter().map(|(f, b)| serde_json::json!({ "name": f, "bytes": b })).collect::<Vec<_>>(),
        "tensor_bytes": m.tensor_bytes(),
        "file_bytes": files.iter().filter_map(|(_, b)| *b).sum::<u64>(),
        "verified": verified.is_ok(),
        "error": verified.as_ref().err().map(|e| e.to_string()),
    })
}

/// The human-readable form of `inspect`.
fn text_report(dir: &Path, m: &Manifest, files: &[(String, Option<u64>)], verified: &tessera::Result<()>) -> String {
    let mut out = vec![format!("checkpoint {}", dir.display()), format!("  step {} (format {})", m.step, m.format)];
    let zero = m.zero_stage.map(|z| format!(", ZeRO stage {z} shards"));
    out.push(format!("  mesh {}{}", m.mesh, zero.unwrap_or_default()));
    out.push(match &m.optimizer {
        Some(o) => format!("  optimizer {} (beta1 {:?}, beta2 {:?}, eps {:?}, weight decay {:?})", o.kind, o.beta1, o.beta2, o.eps, o.weight_decay),
        None => "  optimizer none (parameters only)".to_string(),
    });
    out.push(format!("  extra {}", m.extra));
    let elements: usize = m.params.iter().map(|p| p.global_shape.iter().product::<usize>()).sum();
    out.push(format!("  parameters: {} ({elements} elements)", m.params.len()));
    for p in &m.params {
        let also = if p.aliases.is_empty() { String::new() } else { format!(" (also {})", p.aliases.join(", ")) };
        let split = p.split_dim.map_or("whole on every tp rank".to_string(), |d| format!("tp splits dim {d}"));
        let stages: Vec<String> = p.stages.iter().map(|s| s.to_string()).collect();
        let expert = p.expert.map(|e| format!(", expert {} of {}", e.index, e.count)).unwrap_or_default();
        out.push(format!("    {}{also}  {:?} {}  {split}, stage {}{expert}", p.name, p.global_shape, p.dtype, stages.join(" + ")));
        // The moments usually lie exactly like the values: one line for all three then.
        let layouts: Vec<(TensorKind, Vec<String>)> =
            TensorKind::ALL.iter().map(|&k| (k, m.pieces(&p.name, k).map(describe_piece).collect::<Vec<_>>())).filter(|(_, v)| !v.is_empty()).collect();
        if layouts.len() > 1 && layouts.iter().all(|(_, v)| *v == layouts[0].1) {
            let kinds: Vec<&str> = layouts.iter().map(|(k, _)| k.name()).collect();
            out.push(format!("      {}: {}", kinds.join(", "), layouts[0].1.join(", ")));
        } else {
            out.extend(layouts.iter().map(|(k, v)| format!("      {}: {}", k.name(), v.join(", "))));
        }
    }
    let on_disk: u64 = files.iter().filter_map(|(_, b)| *b).sum();
    out.push(format!("  files: {} ({} bytes of tensors, {on_disk} bytes on disk)", files.len(), m.tensor_bytes()));
    out.extend(files.iter().map(|(f, b)| format!("    {f}  {}", b.map_or("missing".to_string(), |b| format!("{b} bytes")))));
    out.push(match verified {
        Ok(()) => format!("  checksums: ok ({} tensors verified)", m.tensors.len()),
        Err(e) => format!("  checksums: FAILED: {e}"),
    });
    out.join("\n") + "\n"
}

/// `pp0-tp1.safetensors [6, 8] at [6, 0]`, with `elements a..b` for a run.
fn describe_piece(r: &TensorRecord) -> String {
    let run = r.region.flat.as_ref().map(|f| format!(" elements {}..{}", f.start, f.end)).unwrap_or_default();
    format!("{} {:?} at {:?}{run}", r.file, r.region.shape, r.region.offsets)
}

fn reshard(args: &ReshardArgs) -> anyhow::Result<()> {
    let dir = resolve(&args.dir)?;
    let mesh = MeshInfo { tp: args.tp, dp: args.dp, pp: args.pp, ep: args.ep, chunks: args.chunks };
    let m = ckpt::reshard(&dir, &args.out, mesh).with_context(|| format!("cannot reshard `{}` for {mesh}", dir.display()))?;
    say!("wrote {}: step {}, mesh {}, {} files, {} bytes of tensors", args.out.display(), m.step, m.mesh, m.files().len(), m.tensor_bytes());
    Ok(())
}
