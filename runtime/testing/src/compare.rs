//! Gathering gradients from the ranks of a run and comparing them with the
//! single-rank run.

use super::run::RankResult;
use super::{ParallelRun, Report};
use std::collections::BTreeMap;
use tessera_core::Result;
use tessera_dist::mesh::Axis;
use tessera_nn::module::{self, Module, Shard};

/// One parameter's gradient as one rank holds it.
#[derive(Clone, Debug)]
pub(super) struct Slot {
    pub name: String,
    pub shard: Shard,
    pub global: Vec<usize>,
    /// `None` when the rank holds the parameter but received no gradient.
    pub grad: Option<Vec<f64>>,
}

/// Every parameter this rank holds, in visit order.
#[derive(Clone, Debug, Default)]
pub(super) struct RankGrads(Vec<Slot>);

/// The gradients `model` holds on this rank (parameters of other pipeline
/// stages are left out).
pub(super) fn rank_grads<M: Module>(model: &M) -> Result<RankGrads> {
    let mut out = Vec::new();
    for p in module::distinct_params(model)? {
        if p.param.is_remote() {
            continue;
        }
        let grad = p.param.grad().map(|g| g.to_f64_vec()).transpose()?;
        out.push(Slot { name: p.name().to_string(), shard: p.param.shard(), global: p.param.global_shape().dims().to_vec(), grad });
    }
    Ok(RankGrads(out))
}

/// Writes `part`, part `k` of `n` along `dim` of a tensor of shape `global`, into `full`.
fn place(full: &mut [f64], global: &[usize], dim: usize, k: usize, n: usize, part: &[f64]) {
    let outer: usize = global[..dim].iter().product();
    let inner: usize = global[dim + 1..].iter().product();
    let local = global[dim] / n;
    for o in 0..outer {
        for j in 0..local {
            let src = (o * local + j) * inner;
            let dst = (o * global[dim] + k * local + j) * inner;
            full[dst..dst + inner].copy_from_slice(&part[src..src + inner]);
        }
    }
}

/// A run's loss and its gradients assembled into whole tensors.
pub(super) struct Gathered {
    loss: f64,
    grads: BTreeMap<String, Vec<f64>>,
    /// Problems found while gathering (ranks that disagree, missing gradients).
    problems: Vec<String>,
}

impl Gathered {
    pub fn new(run: &ParallelRun, ranks: &[RankResult]) -> Result<Gathered> {
        // Each context-parallel rank counts its tokens' part of the loss
        // `cp` times (see `rank_step`), so that averaging gradients over the
        // data-parallel group (dp × cp) sums them over cp.
        let replicas = (run.degrees.get(Axis::Dp) * run.degrees.get(Axis::Cp)) as f64;
        let loss = ranks.iter().map(|r| r.loss).sum::<f64>() / replicas;
        let mut problems = Vec::new();
        // Every copy of every part: (name, part index) -> (holder, values).
        let mut copies: BTreeMap<(String, usize), Vec<(usize, &Slot)>> = BTreeMap::new();
        for (rank, r) in ranks.iter().enumerate() {
            for slot in &r.grads.0 {
                let k = match slot.shard {
                    Shard::Split { rank, .. } => rank,
                    Shard::Full => 0,
                };
                copies.entry((slot.name.clone(), k)).or_default().push((rank, slot));
            }
        }
        let mut grads: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        for ((name, k), holders) in &copies {
            let (first_rank, first) = holders[0];
            let Some(values) = &first.grad else {
                problems.push(format!("`{run}`: rank {first_rank} holds `{name}` but received no gradient for it"));
                continue;
            };
            // Every rank holding this part (tensor-parallel ranks of a
            // replicated parameter, data replicas, the stages sharing a tied
            // weight) must hold the same bits.
            for &(rank, other) in &holders[1..] {
                match &other.grad {
                    None => problems.push(format!("`{run}`: rank {rank} holds `{name}` but received no gradient for it")),
                    Some(v) => {
                        if let Some(i) = v.iter().zip(values).position(|(a, b)| a.to_bits() != b.to_bits()) {
                            problems.push(format!(
                                "`{run}`: the gradient of `{name}` differs between ranks {first_rank} and {rank}, which both hold it (element {i}: {} vs {}); replicas would drift apart",
                                values[i], v[i]
                            ));
                        }
                    }
                }
            }
            let total: usize = first.global.iter().product();
            let full = grads.entry(name.clone()).or_insert_with(|| vec![f64::NAN; total]);
            match first.shard {
                Shard::Split { dim, degree, .. } => place(full, &first.global, dim, *k, degree, values),
                Shard::Full => full.copy_from_slice(values),
            }
        }
        Ok(Gathered { loss, grads, problems })
    }

    /// Compares with the reference; records the errors in `report`, returns the failures.
    /// `rounding`, when given, is the reference computed in f64 and how many
    /// times the reference's own distance from it each comparison also accepts.
    pub fn compare(
        self,
        run: &ParallelRun,
        reference: &RankResult,
        rounding: Option<(&RankResult, f64)>,
        tolerance: f64,
        report: &mut Report,
    ) -> std::result::Result<(), String> {
        let mut problems = self.problems;
        let ref_loss = reference.loss;
        // Relative to the sum of the loss's terms' magnitudes, which bounds its rounding.
        let loss_scale = reference.loss_scale.max(f64::MIN_POSITIVE);
        let loss_err = (self.loss - ref_loss).abs() / loss_scale;
        let tolerance_loss = match rounding {
            Some((exact, k)) => tolerance.max(k * (ref_loss - exact.loss).abs() / loss_scale),
            None => tolerance,
        };
        report.errors.push((format!("{run}: loss"), loss_err));
        if !within(loss_err, tolerance_loss) {
            problems.push(format!("`{run}`: the loss is {} but one rank computes {ref_loss} (relative error {loss_err:.3e})", self.loss));
        }
        // A tensor's error is relative to its norm, ‖got − want‖ / ‖want‖;
        // an exactly zero reference (a bias that cancels out) is compared
        // against the model's overall gradient norm instead.
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        let overall = reference.grads.0.iter().filter_map(|s| s.grad.as_deref()).map(norm).fold(0.0f64, f64::max);
        let (mut worst, mut worst_name) = (0.0f64, String::new());
        let reference = &reference.grads;
        for slot in &reference.0 {
            let Some(want) = &slot.grad else { continue };
            let Some(got) = self.grads.get(&slot.name) else {
                problems.push(format!("`{run}`: no rank holds a gradient for `{}`", slot.name));
                continue;
            };
            let diff: Vec<f64> = got.iter().zip(want).map(|(a, b)| a - b).collect();
            let scale = norm(want).max(1e-6 * overall).max(f64::MIN_POSITIVE);
            let err = norm(&diff) / scale;
            if err.is_nan() || err > worst {
                (worst, worst_name) = (err, slot.name.clone());
            }
            // What rounding alone does to this tensor in one rank's run.
            let own = rounding.and_then(|(exact, k)| {
                let e = exact.grads.0.iter().find(|s| s.name == slot.name)?.grad.as_ref()?;
                Some(k * norm(&want.iter().zip(e).map(|(a, b)| a - b).collect::<Vec<_>>()) / scale)
            });
            if !within(err, tolerance.max(own.unwrap_or(0.0))) {
                let i = (0..diff.len()).fold(0, |m, i| if diff[i].is_nan() || diff[i].abs() > diff[m].abs() { i } else { m });
                problems.push(format!(
                    "`{run}`: the gradient of `{}` differs from one rank's by {err:.3e} of its norm (most at element {i}: {} instead of {})",
                    slot.name, got[i], want[i]
                ));
            }
        }
        for name in self.grads.keys() {
            if !reference.0.iter().any(|s| s.name == *name) {
                problems.push(format!("`{run}`: `{name}` has a gradient, but the single-rank model has no such parameter"));
            }
        }
        report.errors.push((format!("{run}: gradients (worst: `{worst_name}`)"), worst));
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("\n"))
        }
    }
}

/// `err ≤ tolerance`, false for NaN (a NaN anywhere is a failure).
fn within(err: f64, tolerance: f64) -> bool {
    err <= tolerance
}
