//! What one rank writes in a save: the records of the parameters it owns
//! and a copy of every piece it writes (see [`place`](super::place) for
//! who writes what).

use super::io::{self, ckpt_err};
use super::manifest::{MeshInfo, ParamRecord, TensorRecord};
use super::place::{self, Coords};
use super::region::Region;
use std::path::Path;
use tessera_core::tensor::{DType, Tensor};
use tessera_core::{Error, Result};
use tessera_nn::module::{self, Cx, ExpertSlot, Module, Param, StagePart};
use tessera_optim::TensorKind;
use tessera_optim::{OptimizerState, StatePiece};

/// A distinct parameter of a model with everything that places it.
pub(crate) struct ModelParam {
    pub param: Param,
    /// Every name it is reached by; the first is its own.
    pub names: Vec<String>,
    /// The pipeline part of each name.
    pub stages: Vec<StagePart>,
    pub split_dim: Option<usize>,
    pub expert: Option<ExpertSlot>,
}

impl ModelParam {
    /// Its own (first) name.
    pub fn name(&self) -> &str {
        &self.names[0]
    }

    /// Its record, for values of `dtype`.
    pub fn record(&self, dtype: DType) -> ParamRecord {
        ParamRecord {
            name: self.names[0].clone(),
            aliases: self.names[1..].to_vec(),
            global_shape: self.param.global_shape().dims().to_vec(),
            dtype: dtype.name().to_string(),
            split_dim: self.split_dim,
            stages: self.stages.clone(),
            expert: self.expert,
        }
    }
}

/// Every distinct parameter of `model` once, in visit order.
pub(crate) fn model_params<M: Module>(model: &M) -> Result<Vec<ModelParam>> {
    let mut out: Vec<ModelParam> = Vec::new();
    let mut index: std::collections::HashMap<tessera_nn::module::ParamId, usize> = std::collections::HashMap::new();
    module::visit_params(model, |e| {
        match index.get(&e.param.id()) {
            Some(&i) => {
                let p = &mut out[i];
                p.names.push(e.name.to_string());
                p.stages.push(e.stage);
            }
            None => {
                index.insert(e.param.id(), out.len());
                out.push(ModelParam {
                    param: e.param.clone(),
                    names: vec![e.name.to_string()],
                    stages: vec![e.stage],
                    split_dim: e.split_dim,
                    expert: e.expert,
                });
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// One piece to write: its record (checksum still empty) and its bytes.
pub(crate) struct Piece {
    pub record: TensorRecord,
    pub dtype: DType,
    pub bytes: Vec<u8>,
}

/// What one rank writes.
#[derive(Default)]
pub(crate) struct Part {
    /// The parameters it describes (replica 0 of each owner describes them).
    pub params: Vec<ParamRecord>,
    pub pieces: Vec<Piece>,
}

/// This rank's part of a save of `model` (and `opt`) on `mesh`, copied out
/// of the live tensors, to be written to `file`.
pub(crate) fn collect<M: Module>(model: &M, opt: Option<&dyn OptimizerState>, cx: &Cx, mesh: &MeshInfo, file: &str, tmp: &Path) -> Result<Part> {
    let c = Coords::of(cx);
    let zero = opt.and_then(|o| o.zero_stage()).is_some();
    let state = opt.map(|o| o.pieces()).transpose()?.unwrap_or_default();
    let mut by_param: std::collections::HashMap<tessera_nn::module::ParamId, Vec<&StatePiece>> = std::collections::HashMap::new();
    for p in &state {
        by_param.entry(p.slot.param.id()).or_default().push(p);
    }
    let mut part = Part::default();
    for mp in model_params(model)? {
        if mp.param.is_remote() {
            continue;
        }
        let mine: Vec<&StatePiece> = by_param.remove(&mp.param.id()).unwrap_or_default();
        // The dtype the parameter's values are saved in: its master copy's
        // when the optimizer holds one.
        let master_piece = mine.iter().find(|p| p.slot.kind == TensorKind::Param);
        let dtype = match (master_piece, mp.param.value()) {
            (Some(p), _) => p.tensor.dtype(),
            (None, Ok(v)) => v.dtype(),
            (None, Err(_)) => mine.first().map_or(cx.master_dtype(), |p| p.tensor.dtype()),
        };
        let record = mp.record(dtype);
        if !place::writes(&record, c, mesh)? {
            continue;
        }
        let tp_box = Region::of_shard(&record.global_shape, mp.param.shard());
        let mut push = |kind: TensorKind, region: Region, tensor: &Tensor, steps: Option<u64>| -> Result<()> {
            if tensor.elem_count() != region.elem_count() {
                return Err(Error::Checkpoint {
                    path: tmp.join(file).display().to_string(),
                    detail: format!(
                        "the {} of `{}` has {} elements where its place holds {}; the optimizer does not belong to this model",
                        kind.name(),
                        mp.name(),
                        tensor.elem_count(),
                        region.elem_count()
                    ),
                });
            }
            let record = TensorRecord {
                name: kind.key(mp.name()),
                param: mp.name().to_string(),
                kind,
                region,
                dtype: tensor.dtype().name().to_string(),
                file: file.to_string(),
                checksum: String::new(),
                steps,
            };
            part.pieces.push(Piece { record, dtype: tensor.dtype(), bytes: io::tensor_bytes(tensor)? });
            Ok(())
        };
        // Replicas hold equal values: the first writes them, unless ZeRO
        // shards them (then every replica writes its own shard of them). An
        // optimizer that holds the parameter's master copy (of a parameter
        // held in half precision) saves that instead.
        if !zero && master_piece.is_none() && c.dp == 0 {
            let value = mp.param.value().map_err(|_| {
                ckpt_err(
                    &tmp.join(file),
                    &format!("parameter `{}` has no value on this rank", mp.name()),
                    "a ZeRO engine holds it: pass the engine as the optimizer to save it",
                )
            })?;
            push(TensorKind::Param, tp_box.clone(), &value, None)?;
        }
        if zero || c.dp == 0 {
            for p in mine {
                let region = match &p.slot.elements {
                    Some(e) => tp_box.narrowed(e.clone()),
                    None => tp_box.clone(),
                };
                let steps = (p.slot.kind != TensorKind::Param).then_some(p.steps);
                push(p.slot.kind, region, &p.tensor, steps)?;
            }
        }
        if c.dp == 0 {
            part.params.push(record);
        }
    }
    Ok(part)
}
