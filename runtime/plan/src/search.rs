//! The search: every layout of a model over a cluster that Tessera can run,
//! each estimated, those over memory dropped, the rest ranked by step time.

use crate::estimate::{estimate, Estimate, Layout};
use crate::fixed::Fixed;
use crate::memory::ZeroStage;
use crate::profile::ClusterProfile;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use tessera_core::{DType, Error, Result};
use tessera_nn::module::{CostSettings, ModelCost, RecomputeOverride};
use tessera_parallel::pipeline::ScheduleKind;

/// A model as the planner sees it: its description for any settings
/// (memoised: a description walks every layer), and its training FLOPs.
pub struct Model<'a> {
    describe: Box<dyn Fn(CostSettings) -> Result<ModelCost> + 'a>,
    cache: RefCell<HashMap<String, Option<Rc<ModelCost>>>>,
    /// Whether the model has experts (otherwise the expert-parallel degree is 1).
    pub has_experts: bool,
}

impl<'a> Model<'a> {
    /// A model described by `describe` (which fails for settings the model
    /// cannot take: a degree that does not divide its heads, say).
    pub fn new(has_experts: bool, describe: impl Fn(CostSettings) -> Result<ModelCost> + 'a) -> Model<'a> {
        Model { describe: Box::new(describe), cache: RefCell::new(HashMap::new()), has_experts }
    }

    /// Its description for `settings`; `None` when the model cannot take them.
    pub fn cost(&self, settings: CostSettings) -> Option<Rc<ModelCost>> {
        let key = format!("{settings:?}");
        if let Some(c) = self.cache.borrow().get(&key) {
            return c.clone();
        }
        let c = (self.describe)(settings).ok().map(Rc::new);
        self.cache.borrow_mut().insert(key, c.clone());
        c
    }

    /// Training FLOPs per token as one device runs them (forward and
    /// backward, no recompute) at sequences of `seq_len` in `dtype`.
    pub fn flops_per_token(&self, seq_len: usize, dtype: DType) -> Result<f64> {
        let settings = CostSettings { dtype, recompute: RecomputeOverride::Off, ..CostSettings::single(seq_len) };
        let cost = self.cost(settings).ok_or_else(|| Error::invalid("plan", "the model cannot be described on one device"))?;
        Ok(cost.forward_flops() + cost.backward_flops())
    }

    /// Layers of its pipelined stack (1 when it has none).
    fn layers(&self, seq_len: usize, dtype: DType) -> usize {
        let settings = CostSettings { dtype, ..CostSettings::single(seq_len) };
        self.cost(settings)
            .and_then(|c| {
                c.layers.iter().find_map(|l| match l.stage {
                    tessera_nn::module::StagePart::Layer { count, .. } => Some(count),
                    _ => None,
                })
            })
            .unwrap_or(1)
    }
}

/// What to search for.
#[derive(Clone, Debug)]
pub struct Request {
    /// Nodes of the cluster.
    pub nodes: usize,
    /// Sequences per step.
    pub global_batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// The compute dtype.
    pub compute: DType,
    /// Whether parameters are held in the compute dtype (an f32 master copy in the optimizer).
    pub half_params: bool,
    /// Bytes of a data-parallel gradient bucket.
    pub bucket_bytes: usize,
    /// The parts of a layout the search may not change.
    pub fixed: Fixed,
    /// The share of a device's memory a plan may fill (the rest is left
    /// to the allocator's fragmentation and the runtime).
    pub memory_fraction: f64,
}

/// The result of a search: the layouts that fit, best first, and how many did not.
#[derive(Clone, Debug)]
pub struct Ranked {
    /// Estimates of the layouts that fit in memory, fastest first.
    pub fits: Vec<Estimate>,
    /// Layouts estimated in all.
    pub considered: usize,
    /// The smallest memory need among those that did not fit (bytes), if any did not.
    pub over_memory: Option<Estimate>,
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// The least of each sequence a context-parallel rank keeps when the
/// search picks the degree: a ring step's attention grows with the square
/// of its chunk and its transfer only linearly, and below this the
/// transfer stops hiding behind the attention on today's devices.
pub const MIN_CONTEXT_SHARE: usize = 2048;

/// Whether the search tries context-parallel degree `cp` beside tensor
/// degree `tp`: 1 always; more when it cuts the sequences into `2·cp`
/// equal chunks and, unless the request fixes it, when the ring shares a
/// node with the tensor-parallel group and each rank keeps at least
/// [`MIN_CONTEXT_SHARE`] tokens of every sequence.
fn context_degree_tried(cp: usize, tp: usize, cluster: &ClusterProfile, request: &Request) -> bool {
    if cp == 1 {
        return true;
    }
    if !request.seq_len.is_multiple_of(2 * cp) {
        return false;
    }
    request.fixed.cp == Some(cp) || (tp * cp <= cluster.gpus_per_node && request.seq_len / cp >= MIN_CONTEXT_SHARE)
}

/// Every layout of `model` on `request.nodes` nodes of `cluster` that
/// Tessera runs: data, tensor, pipeline, expert and context degrees whose
/// product is the cluster's devices (a context degree that cuts the
/// sequences into `2·cp` equal chunks, shares a node with the
/// tensor-parallel group and leaves each rank at least
/// [`MIN_CONTEXT_SHARE`] tokens, or one the request fixes), sequence
/// parallelism, the pipeline schedules (and
/// virtual stages), micro-batch sizes that divide the batch, the recompute
/// policies and the ZeRO stages; each estimated, ranked by step time.
pub fn search(model: &Model<'_>, cluster: &ClusterProfile, request: &Request) -> Result<Ranked> {
    let world = request.nodes * cluster.gpus_per_node;
    if world == 0 || request.global_batch == 0 || request.seq_len == 0 {
        return Err(Error::invalid("plan", "nodes, the global batch and the sequence length must all be positive"));
    }
    if request.nodes > 1 {
        // A job over several nodes has groups that cross them, the
        // data-parallel one at least: refuse up front a profile that cannot
        // say what crossing costs, rather than every layout one by one.
        cluster.link(world, 1, world)?;
    }
    let model_flops = model.flops_per_token(request.seq_len, request.compute)?;
    let layers = model.layers(request.seq_len, request.compute);
    let budget = cluster.device.memory_bytes as f64 * request.memory_fraction;
    // A node's host memory, which its ranks' offloaded state shares.
    let host_budget = cluster.host_memory_bytes.map(|b| b as f64 * request.memory_fraction);
    let mut fits = Vec::new();
    let mut over: Option<Estimate> = None;
    let mut considered = 0;
    for tp in divisors(world) {
        for pp in divisors(world / tp).into_iter().filter(|&pp| pp <= layers) {
            let eps = if model.has_experts { divisors(world / tp / pp) } else { vec![1] };
            for ep in eps {
                let cps = divisors(world / tp / pp / ep).into_iter().filter(|&cp| context_degree_tried(cp, tp, cluster, request));
                for cp in cps.collect::<Vec<_>>() {
                    let dp = world / tp / pp / ep / cp;
                    let replicas = dp * ep;
                    if !request.global_batch.is_multiple_of(replicas) {
                        continue;
                    }
                    let per_replica = request.global_batch / replicas;
                    for sp in if tp > 1 { vec![false, true] } else { vec![false] } {
                        for recompute in [RecomputeOverride::Off, RecomputeOverride::AsDeclared, RecomputeOverride::Full] {
                            let settings = CostSettings { tp, sp, ep, cp, seq_len: request.seq_len, dtype: request.compute, recompute };
                            let Some(cost) = model.cost(settings) else { continue };
                            for micro_batch in divisors(per_replica) {
                                let grad_accum = per_replica / micro_batch;
                                let schedules = if pp == 1 {
                                    vec![ScheduleKind::OneFOneB]
                                } else {
                                    let mut s = vec![ScheduleKind::OneFOneB, ScheduleKind::GPipe, ScheduleKind::ZeroBubbleH1];
                                    for chunks in [2, 4] {
                                        if layers >= pp * chunks && grad_accum.is_multiple_of(pp) {
                                            s.push(ScheduleKind::Interleaved { chunks });
                                        }
                                    }
                                    s
                                };
                                for schedule in schedules {
                                    if pp > 1 && grad_accum < pp && !matches!(schedule, ScheduleKind::GPipe) {
                                        // Fewer micro-batches than stages leaves 1F1B no steady state; GPipe covers it.
                                        continue;
                                    }
                                    let zeros: &[ZeroStage] = if replicas * cp > 1 {
                                        &[ZeroStage::None, ZeroStage::One, ZeroStage::Two, ZeroStage::Three]
                                    } else {
                                        &[ZeroStage::None]
                                    };
                                    for &zero in zeros {
                                        let layout = Layout {
                                            dp,
                                            tp,
                                            pp,
                                            ep,
                                            cp,
                                            sp,
                                            schedule,
                                            micro_batch,
                                            grad_accum,
                                            seq_len: request.seq_len,
                                            recompute,
                                            zero,
                                            compute: request.compute,
                                            half_params: request.half_params,
                                            bucket_bytes: request.bucket_bytes,
                                            offload: false,
                                        };
                                        // ZeRO-Offload is tried where the layout does not
                                        // fit on the devices alone (it costs host
                                        // transfers, so it never wins where that fits).
                                        let offloaded = (zero >= ZeroStage::One && host_budget.is_some()).then_some(Layout { offload: true, ..layout });
                                        for layout in std::iter::once(layout).chain(offloaded) {
                                            if !request.fixed.admits(&layout) {
                                                continue;
                                            }
                                            let Ok(e) = estimate(&cost, model_flops, &layout, cluster) else { continue };
                                            considered += 1;
                                            let host_fits = host_budget.is_none_or(|h| e.memory.host * cluster.gpus_per_node.min(world) as f64 <= h);
                                            if e.memory.total() <= budget && host_fits {
                                                fits.push(e);
                                                break;
                                            } else if over.as_ref().is_none_or(|o| e.memory.total() < o.memory.total()) {
                                                over = Some(e);
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    // Fastest first; layouts whose times round to the same 0.1 % are a
    // tie, which the one needing less memory wins.
    let bucket = |e: &Estimate| (e.time.step.max(1e-30).ln() / 1e-3).round() as i64;
    fits.sort_by(|a, b| bucket(a).cmp(&bucket(b)).then(a.memory.total().total_cmp(&b.memory.total())).then(a.time.step.total_cmp(&b.time.step)));
    Ok(Ranked { fits, considered, over_memory: over })
}
