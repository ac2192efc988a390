//! What can be known about a run without running it is checked before the
//! run directory is touched: a configuration that cannot work fails in a
//! second, naming the setting, instead of on every rank at step 1 after the
//! directory, the lock and the first checkpoints exist.

use crate::TrainConfig;
use tessera_core::{Device, Error, Result};
use tessera_dist::inproc::{mesh_groups, InProcess};
use tessera_dist::mesh::Mesh;
use tessera_nn::module::{check_tp_degree, Cx, Staged};
use tessera_parallel::pipeline::ScheduleKind;

/// Checks `cfg` against the model `build` makes: the mesh fits the world,
/// the pipeline schedule can be built for these stages and microbatches,
/// the model has a layer for every virtual stage, the tensor-parallel degree
/// divides what the model splits, the experts split over the
/// expert-parallel ranks, and (on CPU ranks) the run fits in memory.
/// Returns the mesh. Building the model only records shapes: nothing is
/// allocated.
pub(super) fn check<M: Staged>(cfg: &TrainConfig, vocab: usize, build: impl Fn(&Cx, usize, usize) -> Result<M>) -> Result<Mesh> {
    let world = cfg.mesh.world_size();
    let mesh = Mesh::parse(&cfg.mesh.spec(), world, world)?;

    let kind = cfg.mesh.schedule_kind()?;
    let schedule = kind.build(cfg.mesh.pp, cfg.batch.grad_accum).map_err(|e| {
        Error::config(
            "batch.grad_accum",
            format!("the `{}` schedule cannot run this pipeline: {e}; batch.grad_accum is its microbatch count", cfg.mesh.schedule),
        )
    })?;

    let cx = Cx::new(Device::cpu());
    let whole = build(&cx, 0, 1)?;
    if cfg.mesh.pp > 1 {
        let (layers, virtual_stages) = (whole.split_layers(), schedule.virtual_stages());
        if layers < virtual_stages {
            let chunks = if let ScheduleKind::Interleaved { chunks } = kind { format!(" × mesh.chunks = {chunks}") } else { String::new() };
            return Err(Error::config(
                "mesh.pp",
                format!(
                    "the model's split field has {layers} layers, too few for {virtual_stages} pipeline stages (mesh.pp = {}{chunks}); every stage needs at least one layer: lower mesh.pp or mesh.chunks, or give the model more layers",
                    cfg.mesh.pp
                ),
            ));
        }
    }
    let split = if cfg.mesh.tp > 1 {
        // The model as a tensor-parallel rank builds it (a vocabulary the
        // degree does not divide is padded then): rank 0's groups of an
        // in-process world of the mesh's shape, read for their sizes only.
        let world = InProcess::new(mesh.world())?;
        let rank0 = Cx::new(Device::cpu()).with_groups(mesh_groups(&world, &mesh, 0, &Device::cpu())?);
        let split = build(&rank0, 0, 1)?;
        check_tp_degree(&split, cfg.mesh.tp).map_err(|e| Error::config("mesh.tp", e.to_string()))?;
        Some(split)
    } else {
        None
    };
    if cfg.mesh.ep > 1 {
        // Rank 0's share: building it checks that the experts divide.
        build(&cx, 0, cfg.mesh.ep).map_err(|e| Error::config("mesh.ep", e.to_string()))?;
    }
    let model = split.as_ref().unwrap_or(&whole);
    if cfg.mesh.rank_device()? == crate::RankDevice::Cpu {
        crate::memory_check::check(cfg, &whole, vocab)?;
        if let Some(warning) = crate::memory_check::fit_warning(cfg, model)? {
            eprintln!("{warning}");
        }
    } else if let Ok(gpu) = Device::cuda(0) {
        // Every rank has a GPU of its own: the fullest rank against one
        // GPU's memory. (A GPU that cannot be opened fails the run when its
        // rank starts, with that error.)
        if let Some(total) = gpu.total_memory()? {
            if let Some(warning) = crate::memory_check::gpu_fit_warning(cfg, model, total as f64)? {
                eprintln!("{warning}");
            }
        }
    }
    Ok(mesh)
}
