//! Loading onto any mesh: every local parameter shard and optimizer slot
//! names the region of the global tensor it holds, and is assembled from
//! the stored pieces that overlap it, wherever and however they were cut.

use super::collect::{model_params, ModelParam};
use super::io::{self, RankFile};
use super::manifest::{Index, Manifest, ParamRecord, TensorRecord};
use super::region::{overlap, Region, Sources};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use tessera_core::tensor::{DType, Tensor};
use tessera_core::Device;
use tessera_core::{Error, Result};
use tessera_nn::module::{Cx, Module, Param};
use tessera_optim::OptimizerState;
use tessera_optim::TensorKind;

/// The stored pieces of one checkpoint, each rank file read once.
pub(crate) struct Store<'a> {
    dir: &'a Path,
    index: Index<'a>,
    files: HashMap<String, RankFile>,
}

impl<'a> Store<'a> {
    pub fn new(dir: &'a Path, manifest: &'a Manifest) -> Self {
        Store { dir, index: Index::new(manifest), files: HashMap::new() }
    }

    /// The parameter reached by `name` in the checkpoint.
    pub fn param(&self, name: &str) -> Option<&'a ParamRecord> {
        self.index.param(name)
    }

    fn mismatch(&self, detail: String) -> Error {
        Error::CheckpointMismatch { path: self.dir.display().to_string(), detail }
    }

    /// The elements `want` of parameter `param`'s tensor of `kind`,
    /// assembled from every stored piece that holds some of them (each
    /// verified against its checksum), and the update count they record.
    pub fn assemble(&mut self, param: &ParamRecord, kind: TensorKind, want: &Region, device: &Device) -> Result<(Tensor, Option<u64>)> {
        let (bytes, dtype, steps) = self.assemble_bytes(param, kind, want)?;
        Ok((io::tensor_from_bytes(&bytes, dtype, &want.stored_shape(), device)?, steps))
    }

    /// As [`assemble`](Self::assemble), the elements' little-endian bytes and dtype.
    pub fn assemble_bytes(&mut self, param: &ParamRecord, kind: TensorKind, want: &Region) -> Result<(Vec<u8>, DType, Option<u64>)> {
        let global = &param.global_shape;
        let target = want.runs(global);
        let stored = self.index.pieces(&param.name, kind);
        if let Some((r, e)) = stored.iter().find_map(|r| r.region.check(global).err().map(|e| (r, e))) {
            return Err(self.mismatch(format!("piece `{}` in `{}` is not inside `{}` {global:?}: {e}", r.name, r.file, param.name)));
        }
        let pieces: Vec<&TensorRecord> = stored.iter().copied().filter(|r| overlap(&r.region.runs(global), &target)).collect();
        let Some(first) = pieces.first() else {
            return Err(self.mismatch(match kind {
                TensorKind::Param => format!("it holds no values of `{}`", param.name),
                _ => format!("it holds no AdamW moments for parameter `{}`; it was saved without them, or from a different optimizer or model", param.name),
            }));
        };
        let dtype = io::dtype_named(&first.dtype).ok_or_else(|| self.mismatch(format!("piece `{}` has an unknown dtype `{}`", first.name, first.dtype)))?;
        if let Some(other) = pieces.iter().find(|r| r.dtype != first.dtype) {
            return Err(
                self.mismatch(format!("the pieces of `{}` are stored as {} and {}; rewrite the checkpoint in one dtype", first.name, first.dtype, other.dtype))
            );
        }
        let mut steps: Vec<u64> = pieces.iter().filter_map(|r| r.steps).collect();
        steps.sort_unstable();
        steps.dedup();
        if steps.len() > 1 {
            return Err(self.mismatch(format!(
                "the pieces of the {} of `{}` record different update counts {steps:?}; the checkpoint mixes states",
                kind.name(),
                param.name
            )));
        }
        for r in &pieces {
            if !self.files.contains_key(&r.file) {
                self.files.insert(r.file.clone(), RankFile::open(&self.dir.join(&r.file))?);
            }
        }
        let bytes = pieces.iter().map(|r| self.files[&r.file].tensor(r, &self.dir.join(&r.file))).collect::<Result<Vec<_>>>()?;
        let sources = Sources::new(global, pieces.iter().map(|r| &r.region).zip(bytes), dtype.size_in_bytes())
            .map_err(|e| self.mismatch(format!("the {} of `{}`: {e}", kind.name(), param.name)))?;
        let mut out = vec![0u8; want.elem_count() * dtype.size_in_bytes()];
        let covered = sources.copy_into(&target, &mut out);
        if covered != want.elem_count() {
            return Err(self.mismatch(format!(
                "its pieces hold {covered} of the {} elements of the {} of `{}` this rank needs; the checkpoint is incomplete",
                want.elem_count(),
                kind.name(),
                param.name
            )));
        }
        Ok((out, dtype, steps.first().copied()))
    }
}

/// Everything a load changes on this rank, read and checked.
pub(crate) struct Prepared {
    values: Vec<(Param, Tensor)>,
    state: Vec<(Tensor, Option<u64>)>,
    steps: u64,
}

/// The checkpoint's record of model parameter `m` (found by any of its names).
fn record_of<'m>(store: &Store<'m>, m: &ModelParam) -> Option<&'m ParamRecord> {
    m.names.iter().find_map(|n| store.param(n))
}

/// Reads and checks everything this rank's share of `model` (and `opt`)
/// needs from the checkpoint in `dir`, changing nothing.
pub(crate) fn prepare<M: Module>(dir: &Path, manifest: &Manifest, model: &M, opt: Option<&dyn OptimizerState>, cx: &Cx) -> Result<Prepared> {
    let params = model_params(model)?;
    let mut store = Store::new(dir, manifest);
    check_fits(&store, manifest, &params)?;
    if opt.is_some() && manifest.optimizer.is_none() {
        return Err(store.mismatch("it holds no optimizer state; load it without an optimizer, or save one with its optimizer".into()));
    }
    // A ZeRO engine holds the parameters' master copy: it restores them
    // (its shard here; the rest reaches this rank through the engine).
    let values = if opt.is_some_and(|o| o.zero_stage().is_some()) { Vec::new() } else { read_values(&mut store, &params, cx)? };
    let state = match opt {
        Some(o) => read_state(&mut store, &params, o, cx, manifest.kinds().contains(&TensorKind::OuterMomentum))?,
        None => Vec::new(),
    };
    let steps = manifest.tensors.iter().filter_map(|r| r.steps).max().unwrap_or(0);
    Ok(Prepared { values, state, steps })
}

/// Checks that the checkpoint holds the model's parameters, with their
/// global shapes and expert counts, and no parameter the model lacks.
fn check_fits(store: &Store, manifest: &Manifest, params: &[ModelParam]) -> Result<()> {
    // (Experts are exempt from the second check: this rank's model holds only its own.)
    let model_names: HashSet<&str> = params.iter().flat_map(|m| m.names.iter().map(String::as_str)).collect();
    for p in manifest.params.iter().filter(|p| p.expert.is_none()) {
        if !std::iter::once(&p.name).chain(&p.aliases).any(|n| model_names.contains(n.as_str())) {
            return Err(store.mismatch(format!(
                "it holds parameter `{}` (global shape {:?}), which the model lacks; load it into the model it was saved from",
                p.name, p.global_shape
            )));
        }
    }
    for m in params {
        let model_shape = m.param.global_shape().dims().to_vec();
        let Some(r) = record_of(store, m) else {
            return Err(
                store.mismatch(format!("the model's parameter `{}` (global shape {model_shape:?}) is not in it; load a checkpoint of this model", m.name()))
            );
        };
        if r.global_shape != model_shape {
            return Err(store.mismatch(format!(
                "parameter `{}` has global shape {:?} in the checkpoint but {model_shape:?} in the model; load it into the model it was saved from",
                m.name(),
                r.global_shape
            )));
        }
        let (saved, here) = (r.expert.map(|e| e.count), m.expert.map(|e| e.count));
        if saved != here {
            return Err(store.mismatch(format!(
                "parameter `{}` belongs to a layer of {saved:?} experts in the checkpoint but {here:?} in the model; load it into the model it was saved from",
                m.name()
            )));
        }
    }
    Ok(())
}

/// This rank's shard of every parameter it holds, in the dtype it holds it in.
fn read_values(store: &mut Store, params: &[ModelParam], cx: &Cx) -> Result<Vec<(Param, Tensor)>> {
    let mut values = Vec::new();
    for m in params.iter().filter(|m| !m.param.is_remote()) {
        let current = m.param.value().map_err(|_| {
            store.mismatch(format!(
                "parameter `{}` has no value on this rank: a ZeRO engine holds it, so pass the engine as the optimizer to restore it",
                m.name()
            ))
        })?;
        let r = record_of(store, m).expect("checked by check_fits");
        let (t, _) = store.assemble(r, TensorKind::Param, &Region::of_shard(&r.global_shape, m.param.shard()), cx.device())?;
        values.push((m.param.clone(), convert(t, current.dtype())?));
    }
    Ok(values)
}

/// The value of every slot of `opt`, with its update count; without
/// `outer` (a checkpoint that holds no outer momentum), every slot but
/// those of the outer momentum.
fn read_state(store: &mut Store, params: &[ModelParam], opt: &dyn OptimizerState, cx: &Cx, outer: bool) -> Result<Vec<(Tensor, Option<u64>)>> {
    let slots = opt.slots();
    let by_id: std::collections::HashMap<tessera_nn::module::ParamId, &ModelParam> = params.iter().map(|m| (m.param.id(), m)).collect();
    let mut state = Vec::with_capacity(slots.len());
    // Local SGD's outer momentum is in a checkpoint only after a meeting of
    // a run with it: without it, those slots are left out (and none restored).
    for s in slots.iter().filter(|s| outer || s.kind != TensorKind::OuterMomentum) {
        let Some(&m) = by_id.get(&s.param.id()) else {
            return Err(
                store.mismatch(format!("the optimizer updates `{}`, which is not a parameter of this model; build the optimizer from the model", s.name))
            );
        };
        let r = record_of(store, m).expect("checked by check_fits");
        let local = Region::of_shard(&r.global_shape, s.param.shard());
        let want = match &s.elements {
            Some(e) => local.narrowed(e.clone()),
            None => local,
        };
        let (t, steps) = store.assemble(r, s.kind, &want, cx.device())?;
        // Optimizer state is in the master dtype: a parameter's own (f32 or
        // f64), the context's for one held in half precision or freed.
        let dtype = m.param.value().ok().map(|v| v.dtype()).filter(|d| matches!(d, DType::F32 | DType::F64)).unwrap_or(cx.master_dtype());
        state.push((convert(t, dtype)?, steps));
    }
    Ok(state)
}

fn convert(t: Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        Ok(t)
    } else {
        t.to_dtype(dtype)
    }
}

/// Installs what [`prepare`] read (every rank together: ZeRO regathers).
pub(crate) fn install(prepared: Prepared, opt: Option<&mut dyn OptimizerState>) -> Result<()> {
    for (p, t) in prepared.values {
        p.set_value(t)?;
    }
    if let Some(opt) = opt {
        opt.restore(prepared.state, prepared.steps)?;
    }
    Ok(())
}
