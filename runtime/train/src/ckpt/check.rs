//! Checking a checkpoint without a model: every piece lies inside its
//! tensor, the pieces of each tensor cover it exactly once, and every
//! stored byte matches its checksum (hashed straight from the file, never
//! decoded into tensors).

use super::io::RankFile;
use super::manifest::{Index, Manifest};
use super::region::Region;
use std::path::Path;
use tessera_core::{Error, Result};

/// Checks that the manifest describes every tensor it holds completely:
/// each parameter's values (and, with an optimizer, both moments) are
/// covered by its pieces exactly once, each piece inside the tensor.
pub(crate) fn check_layout(manifest: &Manifest, path: &Path) -> Result<()> {
    let bad = |detail: String| Error::Checkpoint { path: path.display().to_string(), detail };
    let index = Index::new(manifest);
    for r in &manifest.tensors {
        let Some(p) = index.param(&r.param).filter(|p| p.name == r.param) else {
            return Err(bad(format!("piece `{}` in `{}` belongs to `{}`, which the manifest does not list", r.name, r.file, r.param)));
        };
        r.region.check(&p.global_shape).map_err(|e| bad(format!("piece `{}` in `{}` is not inside `{}` {:?}: {e}", r.name, r.file, p.name, p.global_shape)))?;
    }
    let kinds = manifest.kinds();
    for p in &manifest.params {
        for &kind in &kinds {
            let regions: Vec<&Region> = index.pieces(&p.name, kind).iter().map(|r| &r.region).collect();
            let covered = coverage(&p.global_shape, &regions).map_err(|e| bad(format!("the {} of `{}`: {e}", kind.name(), p.name)))?;
            let total: usize = p.global_shape.iter().product();
            if covered != total {
                return Err(bad(format!(
                    "the pieces of the {} of `{}` hold {covered} of its {total} elements; the checkpoint is incomplete",
                    kind.name(),
                    p.name
                )));
            }
        }
    }
    Ok(())
}

/// How many elements of a tensor of shape `global` the `regions` hold; an
/// error if two of them hold the same element.
pub(crate) fn coverage(global: &[usize], regions: &[&Region]) -> std::result::Result<usize, String> {
    let mut runs: Vec<(usize, usize)> = regions.iter().flat_map(|r| r.runs(global)).map(|r| (r.start, r.len)).collect();
    runs.sort_unstable();
    if let Some(w) = runs.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
        return Err(format!("two pieces both hold global element {}", w[1].0));
    }
    Ok(runs.iter().map(|r| r.1).sum())
}

/// Verifies the checkpoint in `dir`: its manifest; its layout (every
/// piece inside its tensor, the pieces of each parameter's values and, with
/// an optimizer, moments covering them exactly once); and the checksum of
/// every stored tensor, hashing the bytes as they lie in the files without
/// decoding them. Returns the manifest.
pub fn verify(dir: &Path) -> Result<Manifest> {
    let manifest = super::read_manifest(dir)?;
    check_layout(&manifest, &dir.join(super::MANIFEST))?;
    for file in manifest.files() {
        let path = dir.join(file);
        let rank_file = RankFile::open(&path)?;
        for r in manifest.tensors.iter().filter(|r| r.file == file) {
            rank_file.tensor(r, &path)?;
        }
    }
    Ok(manifest)
}

/// The checks of [`verify`] that read no tensor bytes: the manifest, the
/// layout, and every file it lists present. What pruning asks of a
/// checkpoint before deleting it (a full verification would read every
/// old checkpoint at every save).
pub(crate) fn looks_whole(dir: &Path) -> Result<()> {
    let manifest = super::read_manifest(dir)?;
    check_layout(&manifest, &dir.join(super::MANIFEST))?;
    for file in manifest.files() {
        let path = dir.join(file);
        if !path.is_file() {
            return Err(Error::Checkpoint { path: path.display().to_string(), detail: "the manifest lists this file, but it is missing".into() });
        }
    }
    Ok(())
}
