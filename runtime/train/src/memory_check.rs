//! Refusing a run that cannot fit in memory before it allocates anything.
//!
//! Ranks on CPU share the host's memory, and an allocation the host cannot
//! satisfy aborts the process (SIGABRT) rather than returning an error. So
//! before the ranks start, the trainer adds up a lower bound of what the run
//! will hold and compares it with the memory the host has available: a run
//! refused here could never have fitted, and one that passes may still
//! need more (activations beyond the logits are not counted).

use super::TrainConfig;
use tessera_core::{Error, Result};
use tessera_nn::module::{self, Module};

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
        let (p, dp) = (params as f64, cfg.mesh.dp as f64);
        let stage = cfg.zero.stage;
        // Parameters, gradients and the optimizer's state (AdamW's two
        // moments, and the f32 master copy of parameters held in half
        // precision), each held once per data replica unless ZeRO shards it
        // over the replicas: 4 + 4 + 8 bytes per parameter in f32, 2 + 2 + 12
        // in half precision.
        let copies = |sharded_from: u8| if stage >= sharded_from { 1.0 } else { dp };
        let (held, optimizer) = if cfg.precision.half_params().unwrap_or(false) { (2.0, 12.0) } else { (4.0, 8.0) };
        let model_state = held * p * copies(3) + held * p * copies(2) + optimizer * p * copies(1);
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
