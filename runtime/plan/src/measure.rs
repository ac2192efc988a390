//! Measuring this machine: the device's matrix-product rates by shape and
//! dtype and its memory bandwidth, and a communicator's collectives fitted
//! to a link's latency and bandwidth, as a profile records them.
//!
//! Each figure is the best of several timed runs after a warm-up (a peak
//! is what a profile states; the noise of a shared machine only ever makes
//! a run slower), each run waiting for the device to finish its work, and
//! optionally with several threads (ranks) doing the same work at once.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tessera_core::{ops, DType, Device, Error, Result, Tensor};
use tessera_dist::Communicator;

use crate::collective::Collective;
use crate::profile::GroupFit;

/// A measured matrix-product rate: `[m, k] × [k, n]` in `dtype`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatmulRate {
    /// Rows of the product.
    pub m: usize,
    /// Columns of the product.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// The operands' dtype (`f32`, `bf16`, `f16`).
    pub dtype: String,
    /// Flop/s (`2·m·n·k` per product).
    pub flops: f64,
}

/// How long each figure is measured for, at least (and at least three runs).
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    /// Time spent timing one figure.
    pub per_figure: Duration,
}

impl Default for Budget {
    fn default() -> Self {
        Budget { per_figure: Duration::from_millis(300) }
    }
}

/// The time of one `work` when `ranks` threads run it at once, sustained:
/// each timed run repeats `work` for at least [`SUSTAINED`] (several of the
/// scheduler's time slices, so threads that outnumber the cores really do
/// share them, as a training step's ranks do), all threads start it
/// together (a barrier), and it lasts until the slowest has finished and
/// the device is idle. One call alone, after a warm-up, sizes the runs and
/// says how many fit `budget` (at least three); the figure is the median
/// run over its repetitions. With one thread, no sharing.
pub fn sustained_time(device: &Device, ranks: usize, budget: Budget, work: impl Fn(usize) -> Result<()> + Sync) -> Result<f64> {
    work(0)?;
    device.synchronize()?;
    let start = Instant::now();
    work(0)?;
    device.synchronize()?;
    let once = start.elapsed().as_secs_f64().max(1e-9);
    let reps = ((SUSTAINED.as_secs_f64() / once).ceil() as usize).clamp(1, 100_000);
    let runs = ((budget.per_figure.as_secs_f64() / (once * reps as f64 * ranks.max(1) as f64)) as usize).clamp(3, 50);
    let barrier = Barrier::new(ranks.max(1));
    let times: Vec<Result<Vec<f64>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks.max(1))
            .map(|rank| {
                let (work, barrier) = (&work, &barrier);
                s.spawn(move || {
                    let mut times = Vec::with_capacity(runs);
                    let mut failed = None;
                    for _ in 0..runs {
                        barrier.wait();
                        let t = Instant::now();
                        // A failure still waits at every barrier, so the
                        // others are not left waiting for this thread.
                        if failed.is_none() {
                            if let Err(e) = (0..reps).try_for_each(|_| work(rank)).and_then(|()| device.synchronize()) {
                                failed = Some(e);
                            }
                        }
                        times.push(t.elapsed().as_secs_f64());
                    }
                    failed.map_or(Ok(times), Err)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::invalid("measure::sustained_time", "a measuring thread panicked")))).collect()
    });
    let times: Vec<Vec<f64>> = times.into_iter().collect::<Result<_>>()?;
    let mut slowest: Vec<f64> = (0..runs).map(|run| times.iter().map(|t| t[run]).fold(0.0, f64::max)).collect();
    slowest.sort_by(f64::total_cmp);
    Ok(slowest[runs / 2] / reps as f64)
}

/// How long one timed run of [`sustained_time`] lasts at least.
pub const SUSTAINED: Duration = Duration::from_millis(20);

/// The rate of `[m, k] × [k, n]` products in `dtype` on `device`, per
/// thread of `ranks` running them at once.
pub fn matmul_rate(device: &Device, dtype: DType, m: usize, n: usize, k: usize, ranks: usize, budget: Budget) -> Result<MatmulRate> {
    if m == 0 || n == 0 || k == 0 {
        return Err(Error::invalid("measure::matmul_rate", format!("a {m}×{k} by {k}×{n} product does no work; give sizes above 0")));
    }
    let a = Tensor::full(0.5, [m, k], dtype, device)?;
    let b = Tensor::full(0.25, [k, n], dtype, device)?;
    let seconds = sustained_time(device, ranks, budget, |_| ops::matmul(&a, &b).map(drop))?;
    Ok(MatmulRate { m, n, k, dtype: dtype.to_string(), flops: 2.0 * (m * n * k) as f64 / seconds })
}

/// The rate of causal self-attention (forward and backward together, the
/// FLOPs [`tessera_core::ops::flops_counted`] counts) on `batch` sequences
/// of `seq` tokens with `heads` heads of `head_dim`, in `dtype`, per thread
/// of `ranks` running it at once.
pub fn attention_rate(device: &Device, dtype: DType, (batch, seq, heads, head_dim): (usize, usize, usize, usize), ranks: usize, budget: Budget) -> Result<f64> {
    use tessera_core::ops::{AttnOpts, QkvHeads};
    if batch * seq * heads * head_dim == 0 {
        return Err(Error::invalid("measure::attention_rate", "every size must be positive"));
    }
    let h = QkvHeads { q_heads: heads, kv_heads: heads, head_dim };
    let qkv = Tensor::rand(tessera_core::Init::Uniform { lo: -1.0, hi: 1.0 }, tessera_core::RngKey::new(3, 0), [batch, seq, h.width()], dtype, device)?;
    let (out, lse) = ops::attention_packed(&qkv, h, AttnOpts::causal())?;
    let before = ops::flops_counted();
    ops::attention_packed(&qkv, h, AttnOpts::causal())?;
    ops::attention_packed_backward(&qkv, &out, &lse, &out, h, AttnOpts::causal())?;
    let flops = ops::flops_counted() - before;
    let seconds = sustained_time(device, ranks, budget, |_| {
        let (o, l) = ops::attention_packed(&qkv, h, AttnOpts::causal())?;
        ops::attention_packed_backward(&qkv, &o, &l, &o, h, AttnOpts::causal()).map(drop)
    })?;
    Ok(flops / seconds)
}

/// Elements per second of gelu forward and of its backward on `elements`
/// f32 values, per thread of `ranks` running them at once: the
/// transcendental element-wise functions, bound by arithmetic on a CPU.
pub fn nonlinear_rate(device: &Device, elements: usize, ranks: usize, budget: Budget) -> Result<crate::profile::NonlinearRate> {
    if elements == 0 {
        return Err(Error::invalid("measure::nonlinear_rate", "0 elements measure nothing"));
    }
    let x = Tensor::rand(tessera_core::Init::Uniform { lo: -3.0, hi: 3.0 }, tessera_core::RngKey::new(4, 0), [elements], DType::F32, device)?;
    let forward = sustained_time(device, ranks, budget, |_| ops::gelu(&x).map(drop))?;
    let backward = sustained_time(device, ranks, budget, |_| ops::gelu_backward(&x, &x).map(drop))?;
    Ok(crate::profile::NonlinearRate { forward: elements as f64 / forward, backward: elements as f64 / backward })
}

/// Parameters per second AdamW updates (f32 parameters, gradients and
/// moments) over `params` parameters, per thread of `ranks` running it at once.
pub fn optimizer_rate(device: &Device, params: usize, ranks: usize, budget: Budget) -> Result<f64> {
    if params == 0 {
        return Err(Error::invalid("measure::optimizer_rate", "0 parameters measure nothing"));
    }
    let per_rank: Vec<[Tensor; 4]> = (0..ranks.max(1))
        .map(|_| {
            Ok([
                Tensor::full(0.5, [params], DType::F32, device)?,
                Tensor::full(0.1, [params], DType::F32, device)?,
                Tensor::zeros([params], DType::F32, device)?,
                Tensor::zeros([params], DType::F32, device)?,
            ])
        })
        .collect::<Result<_>>()?;
    let step = ops::AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step: 1, grad_scale: 1.0 };
    let seconds = sustained_time(device, ranks, budget, |rank| {
        let [p, g, m, v] = &per_rank[rank];
        ops::adamw_update(&step, p, g, m, v)
    })?;
    Ok(params as f64 / seconds)
}

/// Bytes/s of an element-wise sum of two f32 tensors of `bytes` each (two
/// read, one written), per thread of `ranks` running it at once: the
/// bandwidth the optimizer's and the norms' passes over memory see.
pub fn memory_bandwidth(device: &Device, bytes: usize, ranks: usize, budget: Budget) -> Result<f64> {
    let elements = bytes / 4;
    if elements == 0 {
        return Err(Error::invalid("measure::memory_bandwidth", format!("{bytes} bytes hold no f32; give at least 4")));
    }
    let a = Tensor::full(1.0, [elements], DType::F32, device)?;
    let b = Tensor::full(2.0, [elements], DType::F32, device)?;
    let seconds = sustained_time(device, ranks, budget, |_| ops::add(&a, &b).map(drop))?;
    Ok(3.0 * (elements * 4) as f64 / seconds)
}

/// One rank's best time of an all-reduce of `bytes` (f32) over `comm`, of
/// `runs` timed runs after a warm-up. Collective: every rank of the group
/// calls it with the same arguments (so that all run the same number of
/// collectives); a barrier starts each run together.
pub fn all_reduce_time(comm: &dyn Communicator, device: &Device, bytes: usize, runs: usize) -> Result<f64> {
    let t = Tensor::full(1.0, [(bytes / 4).max(1)], DType::F32, device)?;
    comm.all_reduce_sum(&t)?;
    let mut best = f64::INFINITY;
    for _ in 0..runs.max(1) {
        comm.barrier()?;
        let start = Instant::now();
        comm.all_reduce_sum(&t)?;
        device.synchronize()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// The latency and bandwidth of a group of `size` that best explain the
/// measured all-reduce `times` (message bytes, seconds) under the ring
/// model of [`Collective::seconds`]: least squares of the relative errors,
/// so that the small messages, whose time is mostly latency, weigh as much
/// as the large ones, whose time is bandwidth (plain least squares lets the
/// largest message decide both and leaves the latency to chance); the
/// latency held at 0 should the best fit want it negative.
pub fn fit_all_reduce(size: usize, times: &[(f64, f64)]) -> Result<GroupFit> {
    const OP: &str = "measure::fit_all_reduce";
    if size < 2 || times.len() < 2 {
        return Err(Error::invalid(OP, format!("a fit needs a group of 2 or more ({size}) and 2 or more message sizes ({})", times.len())));
    }
    // t = steps·α + volume·(1/β), one (steps, volume) per measurement.
    let rows: Vec<(f64, f64, f64)> = times
        .iter()
        .filter(|&&(_, t)| t.is_finite() && t > 0.0)
        .map(|&(bytes, t)| {
            // Each row divided by its time: the residual is then relative.
            let (steps, volume) = Collective::AllReduce.ring(size, bytes);
            (steps / t, volume / t, 1.0)
        })
        .collect();
    let (mut ss, mut sv, mut vv, mut st, mut vt) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(s, v, t) in &rows {
        (ss, sv, vv, st, vt) = (ss + s * s, sv + s * v, vv + v * v, st + s * t, vt + v * t);
    }
    let det = ss * vv - sv * sv;
    let (mut alpha, mut inv_beta) = if det.abs() > f64::EPSILON * ss * vv { ((st * vv - vt * sv) / det, (ss * vt - sv * st) / det) } else { (0.0, vt / vv) };
    if alpha < 0.0 {
        alpha = 0.0;
        inv_beta = vt / vv;
    }
    if !(inv_beta.is_finite() && inv_beta > 0.0) {
        return Err(Error::invalid(OP, format!("the times {times:?} do not grow with the message; measure larger messages")));
    }
    Ok(GroupFit { size, latency: alpha, bandwidth: 1.0 / inv_beta })
}

#[cfg(test)]
mod tests {
    use super::*;

    const QUICK: Budget = Budget { per_figure: Duration::from_millis(20) };

    #[test]
    fn rates_are_positive_and_a_product_too_small_to_use_the_machine_is_slower() {
        let dev = Device::cpu();
        // A 256³ product keeps the cores' vector units busy; an 8³ one is
        // call overhead. Orders of magnitude apart on any machine, but a
        // shared machine can stall one short measurement: up to three tries.
        let (mut small, mut large) = (None, None);
        for _ in 0..3 {
            let s = matmul_rate(&dev, DType::F32, 8, 8, 8, 1, QUICK).unwrap();
            let l = matmul_rate(&dev, DType::F32, 256, 256, 256, 1, QUICK).unwrap();
            assert!(s.flops > 0.0 && l.flops.is_finite());
            let apart = l.flops > 4.0 * s.flops;
            (small, large) = (Some(s), Some(l));
            if apart {
                break;
            }
        }
        let (small, large) = (small.unwrap(), large.unwrap());
        assert!(large.flops > 4.0 * small.flops, "{small:?} vs {large:?}");
        assert_eq!((large.m, large.n, large.k, large.dtype.as_str()), (256, 256, 256, "f32"));
        let bw = memory_bandwidth(&dev, 16 << 20, 1, QUICK).unwrap();
        assert!(bw > 1e8 && bw < 1e13, "{bw} bytes/s is not a memory bandwidth");
    }

    #[test]
    fn a_fit_recovers_the_latency_and_bandwidth_that_made_the_times() {
        use crate::profile::Link;
        for (size, latency, bandwidth) in [(2, 5e-6, 3e11), (8, 2e-5, 2.5e10), (4, 0.0, 1e9)] {
            let link = Link { latency, bandwidth, by_size: Vec::new(), overlaps_compute: true };
            let times: Vec<(f64, f64)> = [4e3, 2.6e5, 4.2e6, 3.3e7].iter().map(|&b| (b, Collective::AllReduce.seconds(&link, size, b))).collect();
            let fit = fit_all_reduce(size, &times).unwrap();
            assert!((fit.latency - latency).abs() <= 1e-9 + 1e-6 * latency, "{fit:?}");
            assert!((fit.bandwidth / bandwidth - 1.0).abs() < 1e-6, "{fit:?}");
        }
        // Measured times are off by a few per cent either way; the latency
        // must still come from the small messages, not from the noise of
        // the large ones (a millisecond there is fifty latencies).
        let link = Link { latency: 2e-5, bandwidth: 1e9, by_size: Vec::new(), overlaps_compute: true };
        let noise = [1.03, 0.97, 1.02, 0.98, 1.03, 0.97];
        let sizes = [1e3, 1e4, 1e5, 1e6, 1e7, 3.3e7];
        let times: Vec<(f64, f64)> = sizes.iter().zip(noise).map(|(&b, e)| (b, e * Collective::AllReduce.seconds(&link, 2, b))).collect();
        let fit = fit_all_reduce(2, &times).unwrap();
        assert!((fit.latency / link.latency - 1.0).abs() < 0.1, "{fit:?}");
        assert!((fit.bandwidth / link.bandwidth - 1.0).abs() < 0.05, "{fit:?}");
        assert!(fit_all_reduce(1, &[(1.0, 1.0), (2.0, 2.0)]).is_err());
        assert!(fit_all_reduce(2, &[(1e6, 1e-3), (2e6, 1e-3)]).unwrap_err().to_string().contains("do not grow"));
    }

    #[test]
    fn in_process_all_reduces_fit_a_positive_link() {
        use tessera_dist::inproc::InProcess;
        let world = InProcess::new(2).unwrap();
        let sizes = [1 << 12, 1 << 16, 1 << 20, 1 << 22];
        let times: Vec<Vec<f64>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let world = &world;
                    s.spawn(move || {
                        let dev = Device::cpu();
                        let comm = world.communicator(rank, &dev).unwrap();
                        sizes.iter().map(|&b| all_reduce_time(&comm, &dev, b, 5).unwrap()).collect::<Vec<f64>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let measured: Vec<(f64, f64)> = sizes.iter().zip(&times[0]).map(|(&b, &t)| (b as f64, t)).collect();
        let fit = fit_all_reduce(2, &measured).unwrap();
        assert!(fit.bandwidth > 1e7 && fit.bandwidth < 1e13 && fit.latency < 0.1, "{fit:?} from {measured:?}");
    }

    #[test]
    fn empty_work_is_refused() {
        let dev = Device::cpu();
        assert!(matmul_rate(&dev, DType::F32, 0, 8, 8, 1, QUICK).unwrap_err().to_string().contains("no work"));
        assert!(memory_bandwidth(&dev, 3, 1, QUICK).is_err());
    }
}
