//! `bench offload`: what ZeRO-Offload and activation offload save of a
//! rank's device memory and what they cost in step time, on CPU ranks
//! (threads) whose "host" is a second memory pool.
//!
//! A GPT-2 trains on `--dp` data-parallel ranks under ZeRO (stages 2 and
//! 3), with and without optimizer offload, and with full recompute with
//! and without activation offload. For each case the benchmark reports,
//! per rank, the device's peak during a step, the device bytes held
//! between steps (the model state), the host pool's peak, the median step
//! time and its ratio to the same stage without offload, and for the
//! optimizer offload the share of the host update that the next forward
//! hid (1 − time blocked on it / its run time).
//!
//! On CPU ranks the host update and the model's kernels share the same
//! cores, so the overlap buys parallelism, not a second processor.

use anyhow::{ensure, Result};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera::dist::inproc::InProcess;
use tessera::dist::Communicator;
use tessera::module::{self, Act, Cx, Groups, RecomputeOverride};
use tessera::nn::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward};
use tessera::parallel::zero::{Stage, Zero, ZeroConfig};
use tessera::prelude::*;
use tessera_models::gpt2::{Gpt2, Gpt2Config};

#[derive(clap::Args)]
pub struct Args {
    /// Data-parallel ranks.
    #[arg(long, default_value_t = 2)]
    dp: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 128)]
    dim: usize,
    /// Decoder layers.
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Sequences per rank and step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Timed steps per case (after two untimed ones).
    #[arg(long, default_value_t = 3)]
    steps: usize,
}

const VOCAB: usize = 512;
const HEADS: usize = 4;
/// Gradient bytes per reduce-scatter: small, so the gradients leave the
/// device as the backward goes and the activations' share of the peak shows.
const BUCKET: usize = 1 << 20;

/// A case: the ZeRO stage, whether the optimizer is offloaded, and whether
/// the layers recompute fully with their inputs offloaded (or kept).
#[derive(Clone, Copy)]
struct Case {
    stage: Stage,
    offload: bool,
    recompute: Option<bool>,
}

impl Case {
    fn name(&self) -> String {
        let stage = match self.stage {
            Stage::One => 1,
            Stage::Two => 2,
            Stage::Three => 3,
        };
        let mut name = format!("zero{stage}");
        if self.offload {
            name += " optimizer-offload";
        }
        match self.recompute {
            Some(true) => name += " recompute activation-offload",
            Some(false) => name += " recompute",
            None => {}
        }
        name
    }
}

/// What a case measured, each figure the largest (memory) or slowest
/// (time) over the ranks.
struct Measured {
    device_peak: usize,
    device_between: usize,
    host_peak: usize,
    step: Duration,
    /// The host update's run time and the time blocked on it, over the timed steps.
    update: Duration,
    waited: Duration,
}

fn measure(args: &Args, case: Case) -> Result<Measured> {
    let cfg = Gpt2Config::tiny(VOCAB, args.dim, HEADS, args.layers, args.seq);
    let world = InProcess::new(args.dp)?;
    let barrier = std::sync::Barrier::new(args.dp);
    type Rank = (Vec<(usize, usize, usize, Duration)>, Duration, Duration);
    let per_rank: Vec<Rank> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.dp)
            .map(|rank| {
                let (world, cfg, barrier) = (&world, &cfg, &barrier);
                s.spawn(move || -> Result<Rank> {
                    let dev = Device::cpu();
                    let acts = Device::cpu();
                    let comm: Arc<dyn Communicator> = Arc::new(world.communicator(rank, &dev)?);
                    let mut groups = Groups::single();
                    groups.dp = comm.clone();
                    let mut cx = Cx::new(dev.clone()).with_seed(1).with_groups(groups);
                    if let Some(offload) = case.recompute {
                        cx.set_recompute_override(RecomputeOverride::Full);
                        if offload {
                            cx = cx.with_activation_offload(acts.clone());
                        }
                    }
                    let model = module::build(Gpt2::new(cfg)?, &cx)?;
                    let zero = Arc::new(Zero::new(&model, comm, ZeroConfig::new(case.stage).with_bucket_bytes(BUCKET).with_offload(case.offload))?);
                    let mut cx = cx.with_hooks(zero.clone());
                    let ids = |salt: usize| -> tessera::Result<Tensor> {
                        let v: Vec<u32> = (0..args.batch * args.seq).map(|i| ((i * 7 + salt + 13 * rank) % VOCAB) as u32).collect();
                        Tensor::from_vec(v, [args.batch, args.seq], &dev)
                    };
                    let (input, targets) = (ids(1)?, ids(5)?);
                    let mut out = Vec::new();
                    let mut at_timing = zero.stats();
                    for step in 0..args.steps + 2 {
                        if step == 2 {
                            at_timing = zero.stats();
                        }
                        barrier.wait();
                        dev.reset_peak();
                        acts.reset_peak();
                        if let Some(h) = zero.host() {
                            h.reset_peak();
                        }
                        let start = Instant::now();
                        let (logits, saved) = model.forward(&mut cx, Act::new(input.clone()))?;
                        let (_, ce) = vocab_parallel_cross_entropy(cx.tp(), &logits, &targets, VOCAB, None)?;
                        let dl = vocab_parallel_cross_entropy_backward(&logits, &targets, VOCAB, None, &ce, 1.0)?;
                        drop(logits);
                        model.backward(&mut cx, saved, dl)?;
                        zero.step(1e-3)?;
                        let took = start.elapsed();
                        let host = zero.host().map_or(0, |h| h.memory_stats().peak) + acts.memory_stats().peak;
                        out.push((dev.memory_stats().peak, dev.memory_stats().in_use, host, took));
                    }
                    // The last update, finished, counts too.
                    zero.gather_parameters()?;
                    let end = zero.stats();
                    Ok((out, end.host_update - at_timing.host_update, end.host_update_waited - at_timing.host_update_waited))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect::<Result<Vec<_>>>()
    })?;
    let timed = 2..args.steps + 2;
    let mut steps: Vec<Duration> = timed.clone().map(|i| per_rank.iter().map(|r| r.0[i].3).max().unwrap_or_default()).collect();
    steps.sort();
    let most = |f: fn(&(usize, usize, usize, Duration)) -> usize| per_rank.iter().flat_map(|r| r.0[timed.clone()].iter().map(f)).max().unwrap_or(0);
    Ok(Measured {
        device_peak: most(|x| x.0),
        device_between: most(|x| x.1),
        host_peak: most(|x| x.2),
        step: steps[steps.len() / 2],
        update: per_rank.iter().map(|r| r.1).max().unwrap_or_default(),
        waited: per_rank.iter().map(|r| r.2).max().unwrap_or_default(),
    })
}

pub fn run(args: &Args) -> Result<()> {
    ensure!(args.dp > 0 && args.steps > 0 && args.seq > 0, "--dp, --steps and --seq must be at least 1");
    let params = 12 * args.layers * args.dim * args.dim + (VOCAB + args.seq) * args.dim;
    println!(
        "offload: GPT-2 of {} layers (hidden {}, about {:.1} M parameters) on {} data-parallel CPU ranks, {} x {} tokens per rank and step",
        args.layers,
        args.dim,
        params as f64 / 1e6,
        args.dp,
        args.batch,
        args.seq
    );
    let mb = |b: usize| b as f64 / 1e6;
    for stage in [Stage::Two, Stage::Three] {
        let pairs = [
            (Case { stage, offload: false, recompute: None }, Case { stage, offload: true, recompute: None }),
            // Activations against what remains on the device once the
            // optimizer is offloaded.
            (Case { stage, offload: true, recompute: Some(false) }, Case { stage, offload: true, recompute: Some(true) }),
        ];
        for (reference, case) in pairs {
            let r = measure(args, reference)?;
            let m = measure(args, case)?;
            let hidden = if m.update.is_zero() { None } else { Some(1.0 - m.waited.as_secs_f64() / m.update.as_secs_f64()) };
            for (c, x, ratio) in [(reference, &r, 1.0), (case, &m, m.step.as_secs_f64() / r.step.as_secs_f64())] {
                println!(
                    "offload: {}: device peak {:.2} MB, between steps {:.2} MB, host peak {:.2} MB, step {:.1} ms ({ratio:.2} × without offload)",
                    c.name(),
                    mb(x.device_peak),
                    mb(x.device_between),
                    mb(x.host_peak),
                    1e3 * x.step.as_secs_f64()
                );
            }
            if let Some(h) = hidden {
                println!(
                    "offload: {}: host update {:.1} ms per step, {:.0} % hidden behind the next forward",
                    case.name(),
                    1e3 * m.update.as_secs_f64() / args.steps as f64,
                    100.0 * h
                );
            }
            println!(
                "{}",
                serde_json::json!({
                    "bench": "offload",
                    "case": format!("gpt2 d{} L{} dp{} {}", args.dim, args.layers, args.dp, case.name()),
                    "device_peak_bytes": m.device_peak,
                    "device_peak_ratio": m.device_peak as f64 / r.device_peak as f64,
                    "device_between_steps_bytes": m.device_between,
                    "device_between_steps_ratio": m.device_between as f64 / r.device_between as f64,
                    "host_peak_bytes": m.host_peak,
                    "step_ms": 1e3 * m.step.as_secs_f64(),
                    "step_ratio": m.step.as_secs_f64() / r.step.as_secs_f64(),
                    "host_update_hidden": hidden,
                })
            );
        }
    }
    Ok(())
}
