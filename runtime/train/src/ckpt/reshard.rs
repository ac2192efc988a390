//! Rewriting a checkpoint for another mesh offline, from its manifest
//! alone: the manifest gives every parameter's global shape, the dimension
//! tensor parallelism splits, the pipeline parts that use it and the expert
//! it belongs to, which is all the [placement rules](super::place) need.

use super::check::{self, verify};
use super::io::{self, checksum, ckpt_err, io_err};
use super::manifest::{Manifest, MeshInfo, ParamRecord, TensorRecord};
use super::place::{self, Coords};
use super::region::Region;
use super::restore::Store;
use super::MANIFEST;
use std::fs;
use std::path::Path;
use tessera_core::file::sync_dir;
use tessera_core::{Error, Result};
use tessera_nn::module::{Shard, StagePart};

/// Why `mesh` cannot hold the parameters of `manifest`, every reason at once.
fn problems(manifest: &Manifest, mesh: &MeshInfo) -> Vec<String> {
    let mut out = Vec::new();
    for (axis, n) in [("tp", mesh.tp), ("dp", mesh.dp), ("pp", mesh.pp), ("ep", mesh.ep), ("chunks", mesh.chunks)] {
        if n == 0 {
            out.push(format!("{axis} is 0; every degree is at least 1"));
        }
    }
    if !out.is_empty() {
        return out;
    }
    for p in &manifest.params {
        if let Some(dim) = p.split_dim {
            let size = p.global_shape.get(dim).copied().unwrap_or(0);
            if mesh.tp > 1 && size % mesh.tp != 0 {
                out.push(format!("`{}` splits dimension {dim} of size {size}, which tp {} does not divide", p.name, mesh.tp));
            }
        }
        if let Some(e) = p.expert {
            if e.count % mesh.ep != 0 {
                out.push(format!("`{}` belongs to a layer of {} experts, which ep {} does not divide", p.name, e.count, mesh.ep));
            }
        }
        for part in &p.stages {
            if let StagePart::Layer { count, .. } = part {
                let virtual_stages = mesh.pp * mesh.chunks;
                if *count < virtual_stages && !out.iter().any(|o| o.contains("layers")) {
                    out.push(format!("the pipelined layers ({count}) cannot fill {virtual_stages} virtual stages (pp {} × {} chunks)", mesh.pp, mesh.chunks));
                }
            }
        }
    }
    out
}

/// The tensor-parallel shard of `p` held by rank `tp` of `mesh`.
fn shard_of(p: &ParamRecord, tp: usize, mesh: &MeshInfo) -> Shard {
    match p.split_dim {
        Some(dim) if mesh.tp > 1 => Shard::Split { dim, rank: tp, degree: mesh.tp },
        _ => Shard::Full,
    }
}

/// Rewrites the checkpoint in `src` for `mesh` as the new checkpoint
/// directory `out`, without the model; returns the new manifest.
///
/// Every stored piece is verified first. The new checkpoint holds the same
/// step, parameters, optimizer state (with its update counts) and `extra`,
/// laid out as a save on `mesh` without ZeRO would lay it out (ZeRO engines
/// restore their shards from it on any data-parallel degree). `out` must
/// not exist; it appears complete or not at all (written under a
/// temporary name, then renamed).
pub fn reshard(src: &Path, out: &Path, mesh: MeshInfo) -> Result<Manifest> {
    let manifest = verify(src)?;
    let found = problems(&manifest, &mesh);
    if !found.is_empty() {
        return Err(Error::CheckpointMismatch { path: src.display().to_string(), detail: format!("it cannot be laid out on {mesh}: {}", found.join("; ")) });
    }
    if out.exists() {
        return Err(ckpt_err(out, "already exists", "choose a new directory for the resharded checkpoint"));
    }
    let name = out.file_name().and_then(|n| n.to_str()).ok_or_else(|| ckpt_err(out, "has no directory name", "name the new checkpoint's directory"))?;
    let tmp = out.with_file_name(format!("{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, "cannot remove a stale temporary directory", e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| io_err(&tmp, "cannot create the temporary directory", e))?;
    let written = write_all(src, &tmp, &manifest, mesh);
    let done = written.and_then(|m| {
        fs::rename(&tmp, out).map_err(|e| io_err(out, "cannot rename the temporary directory into place", e))?;
        if let Some(parent) = out.parent() {
            sync_dir(parent);
        }
        Ok(m)
    });
    if done.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    done
}

/// Writes every rank file of `mesh` and the manifest into `tmp`.
fn write_all(src: &Path, tmp: &Path, manifest: &Manifest, mesh: MeshInfo) -> Result<Manifest> {
    let kinds = manifest.kinds();
    let mut store = Store::new(src, manifest);
    let mut tensors: Vec<TensorRecord> = Vec::new();
    // Replicas hold the same values: replica 0 of every other coordinate writes.
    for coords in Coords::all(&mesh).into_iter().filter(|c| c.dp == 0) {
        let file = coords.rank_file(&mesh, false);
        let mut pieces = Vec::new();
        for p in &manifest.params {
            if !place::writes(p, coords, &mesh)? {
                continue;
            }
            let region = Region::of_shard(&p.global_shape, shard_of(p, coords.tp, &mesh));
            for &kind in &kinds {
                let (bytes, dtype, steps) = store.assemble_bytes(p, kind, &region)?;
                let record = TensorRecord {
                    name: kind.key(&p.name),
                    param: p.name.clone(),
                    kind,
                    region: region.clone(),
                    dtype: dtype.name().to_string(),
                    file: file.clone(),
                    checksum: checksum(&bytes),
                    steps,
                };
                pieces.push((record, dtype, bytes));
            }
        }
        if pieces.is_empty() {
            continue;
        }
        let views: Vec<_> = pieces.iter().map(|(r, d, b)| (r.name.clone(), *d, r.region.stored_shape(), b.as_slice())).collect();
        io::write_safetensors(&tmp.join(&file), &views)?;
        tensors.extend(pieces.into_iter().map(|(r, _, _)| r));
    }
    let resharded = Manifest { format: super::FORMAT_VERSION, mesh, zero_stage: None, tensors, checksum: None, ..manifest.clone() };
    let path = tmp.join(MANIFEST);
    check::check_layout(&resharded, &path)?;
    io::write_synced(&path, &resharded.to_json()?)?;
    sync_dir(tmp);
    Ok(resharded)
}
