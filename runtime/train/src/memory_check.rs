//! Refusing a run that cannot fit in memory before it allocates anything,
//! and warning about one that will probably not.
//!
//! Ranks on CPU share the host's memory, and an allocation the host cannot
//! satisfy aborts the process (SIGABRT) rather than returning an error. So
//! before the ranks start, the trainer adds up a lower bound of what the run
//! will hold and compares it with the memory the host has available: a run
//! refused here could never have fitted. Then the planner's cost model
//! estimates what each rank will hold at its peak (model states, the
//! activations the schedule keeps, logits, the backward's buffers) from the
//! model's own description; when the ranks together would need more than
//! the host has, the trainer warns before step 1 and says what to change.

use super::TrainConfig;
use tessera_core::{Error, Result};
use tessera_nn::module::{self, Module};
use tessera_plan::estimate::{memory, Layout};
use tessera_plan::memory::ZeroStage;

/// The layout `cfg` runs, as the planner's cost model takes it.
pub fn planned_layout(cfg: &TrainConfig) -> Result<Layout> {
    let zero = ZeroStage::from_number(cfg.zero.stage);
    Ok(Layout {
        dp: cfg.mesh.dp,
        tp: cfg.mesh.tp,
        pp: cfg.mesh.pp,
        ep: cfg.mesh.ep,
        cp: cfg.mesh.cp,
        sp: cfg.mesh.sp,
        schedule: cfg.mesh.schedule_kind()?,
        micro_batch: cfg.batch.micro_batch,
        grad_accum: cfg.batch.grad_accum,
        seq_len: cfg.batch.seq_len,
        recompute: cfg.recompute.to_override()?,
        zero,
        compute: cfg.precision.dtype()?,
        half_params: cfg.precision.half_params()?,
        bucket_bytes: cfg.mesh.bucket_bytes,
        offload: cfg.zero.offload,
    })
}

/// What the cost model estimates `cfg` needs of the host's memory for
/// `model` (as a tensor-parallel rank builds it): every rank's peak, the
/// fullest stage's for each; `None` when the model does not describe itself.
pub(crate) fn estimated_need<M: Module>(cfg: &TrainConfig, model: &M) -> Result<Option<f64>> {
    Ok(fullest_rank(cfg, model)?.map(|peak| peak * cfg.mesh.world_size() as f64))
}

/// The cost model's peak of the fullest rank of `cfg` for `model`; `None`
/// when the model does not describe itself.
fn fullest_rank<M: Module>(cfg: &TrainConfig, model: &M) -> Result<Option<f64>> {
    let layout = planned_layout(cfg)?;
    let Ok(cost) = module::describe(model, layout.settings()) else { return Ok(None) };
    Ok(Some(memory(&cost, &layout)?.total()))
}

/// A warning, when the cost model says `cfg` will need more of the host's
/// memory than it has, naming the estimate and the fixes.
pub(crate) fn fit_warning<M: Module>(cfg: &TrainConfig, model: &M) -> Result<Option<String>> {
    let (Some(need), Some(have)) = (estimated_need(cfg, model)?, available()) else { return Ok(None) };
    if need <= have {
        return Ok(None);
    }
    Ok(Some(format!(
        "warning: this run will probably not fit in memory: the planner estimates {:.1} GiB over its {} ranks at their peak, and {:.1} GiB are available; \
         `tessera plan --model CONFIG --cluster PROFILE` finds a layout that fits, or shorten batch.micro_batch or batch.seq_len, set recompute.mode = \"full\", \
         or shard the state with zero.stage",
        need / GIB,
        cfg.mesh.world_size(),
        have / GIB
    )))
}

/// A warning, when the cost model says the fullest rank of `cfg` will need
/// more than one GPU's `gpu_bytes` (every rank has a GPU of its own),
/// naming the estimate and the fixes.
pub(crate) fn gpu_fit_warning<M: Module>(cfg: &TrainConfig, model: &M, gpu_bytes: f64) -> Result<Option<String>> {
    let Some(need) = fullest_rank(cfg, model)? else { return Ok(None) };
    if need <= gpu_bytes {
        return Ok(None);
    }
    Ok(Some(format!(
        "warning: this run will probably not fit on its GPUs: the planner estimates {:.1} GiB for the fullest rank at its peak, and a GPU has {:.1} GiB; \
         `tessera plan --model CONFIG --cluster PROFILE` finds a layout that fits, or shorten batch.micro_batch or batch.seq_len, set recompute.mode = \"full\", \
         shard the state with zero.stage, or split the model further with mesh.tp or mesh.pp",
        need / GIB,
        gpu_bytes / GIB
    )))
}

/// Bytes per GiB, for messages.
const GIB: f64 = (1u64 << 30) as f64;

/// A lower bound of the host memory `cfg` needs for a model of `params`
/// parameters and a vocabulary of `vocab`, with what it is made of.
pub(crate) struct Need {
    pub model_state: f64,
    pub logits: f64,
}

impl Need {
    pub fn of(cfg: &TrainConfig, params: u64, vocab: usize) -> Need {
        // Context-parallel ranks hold the model's state like data replicas.
        let (p, dp) = (params as f64, (cfg.mesh.dp * cfg.mesh.cp) as f64);
        let stage = cfg.zero.stage;
        // Parameters, gradients and the optimizer's state (AdamW's two
        // moments, and the f32 master copy of parameters held in half
        // precision), each held once per data replica unless ZeRO shards it
        // over the replicas: 4 + 4 + 8 bytes per parameter in f32, 2 + 2 + 12
        // in half precision.
        let copies = |sharded_from: u8| if stage >= sharded_from { 1.0 } else { dp };
        // (ZeRO-Offload keeps an f32 master copy on the host whatever the
        // parameters are held in, and CPU ranks share that memory too.)
        let (held, optimizer) = match (cfg.precision.half_params().unwrap_or(false), cfg.zero.offload) {
            (true, _) => (2.0, 12.0),
            (false, true) => (4.0, 12.0),
            (false, false) => (4.0, 8.0),
        };
        let mut model_state = held * p * copies(3) + held * p * copies(2) + optimizer * p * copies(1);
        // Local SGD keeps the global parameters and the outer momentum in
        // f32 on every replica.
        if let Ok(Some(outer)) = cfg.local_sgd.outer() {
            model_state += if outer.momentum > 0.0 { 8.0 } else { 4.0 } * p * dp;
        }
        // Every replica holds at least one microbatch's logits and their
        // gradient, in f32 (split over tensor-parallel ranks, whole in sum).
        let replicas = (cfg.mesh.dp * cfg.mesh.ep) as f64;
        let logits = 2.0 * 4.0 * (cfg.batch.micro_batch * cfg.batch.seq_len) as f64 * vocab as f64 * replicas;
        Need { model_state, logits }
    }

    pub fn total(&self) -> f64 {
        self.model_state + self.logits
    }
}

/// The host memory available for new allocations, from `/proc/meminfo`
/// (`None` where there is no such file).
fn available() -> Option<f64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// Refuses `cfg` with the figures and the fixes when the lower bound of its
/// memory need exceeds what the host has available. `model` is the model
/// before it is materialised (its parameters are shapes, no memory yet).
pub(crate) fn check<M: Module>(cfg: &TrainConfig, model: &M, vocab: usize) -> Result<()> {
    let Some(have) = available() else { return Ok(()) };
    let params: u64 = module::distinct_params(model)?.iter().map(|n| n.param.global_shape().elem_count() as u64).sum();
    let need = Need::of(cfg, params, vocab);
    if need.total() <= have {
        return Ok(());
    }
    Err(Error::InsufficientMemory {
        detail: format!(
            "this run needs at least {:.1} GiB of host memory but {:.1} GiB are available: {:.1} GiB of weights, gradients and AdamW state \
             ({params} parameters, over {} data replicas{}) and {:.1} GiB of logits (batch.micro_batch {} × batch.seq_len {} × vocabulary {vocab}, \
             with their gradient, per replica); make the model smaller, shorten batch.seq_len or batch.micro_batch, use fewer data replicas, \
             or shard the state with zero.stage",
            need.total() / GIB,
            have / GIB,
            need.model_state / GIB,
            cfg.mesh.dp,
            if cfg.zero.stage > 0 { format!(", ZeRO stage {}", cfg.zero.stage) } else { String::new() },
            need.logits / GIB,
            cfg.batch.micro_batch,
            cfg.batch.seq_len,
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_the_cost_model_says_will_not_fit_is_warned_about() {
        // An embedding's output: 4096 f32 per token, kept by nothing but
        // alive as the output; 2^20 sequences of 1024 tokens is 16 TiB.
        let model = tessera_nn::Embedding::new(16, 4096).unwrap();
        let small = TrainConfig::parse("[batch]\nmicro_batch = 1\nseq_len = 8\n", &[]).unwrap();
        assert!(estimated_need(&small, &model).unwrap().unwrap() < 1e9);
        assert_eq!(fit_warning(&small, &model).unwrap(), None);
        let huge = TrainConfig::parse("[batch]\nmicro_batch = 1048576\nseq_len = 1024\n", &[]).unwrap();
        assert!(estimated_need(&huge, &model).unwrap().unwrap() > 1e13);
        if available().is_some() {
            let warning = fit_warning(&huge, &model).unwrap().expect("a warning");
            assert!(warning.contains("will probably not fit") && warning.contains("tessera plan") && warning.contains("GiB"), "{warning}");
        }
    }

    #[test]
    fn a_rank_the_cost_model_says_will_not_fit_its_gpu_is_warned_about() {
        let model = tessera_nn::Embedding::new(16, 4096).unwrap();
        let cfg = TrainConfig::parse("[batch]\nmicro_batch = 64\nseq_len = 1024\n", &[]).unwrap();
        // The output (and its gradient) alone: 64 × 1024 × 4096 f32 = 1 GiB each.
        let need = memory(&module::describe(&model, planned_layout(&cfg).unwrap().settings()).unwrap(), &planned_layout(&cfg).unwrap()).unwrap().total();
        assert!(need > 1e9, "{need}");
        assert_eq!(gpu_fit_warning(&cfg, &model, 2.0 * need).unwrap(), None);
        let warning = gpu_fit_warning(&cfg, &model, 0.5 * need).unwrap().expect("a warning");
        assert!(warning.contains("not fit on its GPUs") && warning.contains("fullest rank") && warning.contains("tessera plan"), "{warning}");
    }

    #[test]
    fn the_bound_counts_state_per_replica_and_zero_shards_it() {
        let mut cfg = TrainConfig::parse("[mesh]\ndp = 4\n[batch]\nmicro_batch = 2\nseq_len = 8\n", &[]).unwrap();
        let plain = Need::of(&cfg, 1000, 10);
        assert_eq!(plain.model_state, 16.0 * 1000.0 * 4.0);
        assert_eq!(plain.logits, 2.0 * 4.0 * 16.0 * 10.0 * 4.0);
        cfg.zero.stage = 3;
        assert_eq!(Need::of(&cfg, 1000, 10).model_state, 16.0 * 1000.0);
        cfg.zero.stage = 1;
        assert_eq!(Need::of(&cfg, 1000, 10).model_state, (8.0 * 4.0 + 8.0) * 1000.0);
        // Half precision, summed over the 4 replicas: at stage 2 the
        // parameters whole on each (2 bytes), gradients and optimizer state
        // (2 + 12) sharded; at stage 1 the gradients whole too.
        cfg.precision.compute = "bf16".into();
        cfg.zero.stage = 2;
        assert_eq!(Need::of(&cfg, 1000, 10).model_state, (2.0 * 4.0 + 2.0 + 12.0) * 1000.0);
        cfg.zero.stage = 1;
        assert_eq!(Need::of(&cfg, 1000, 10).model_state, (4.0 * 4.0 + 12.0) * 1000.0);
    }
}
