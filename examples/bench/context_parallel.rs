//! `bench context-parallel`: the longest sequence a fixed memory budget
//! trains, and the step time, with every sequence split over 1, 2, 4, ...
//! context-parallel ranks (ring attention) on CPU ranks (threads).
//!
//! The budget is what one rank needs for a training step (forward and
//! backward) of a Llama-style model on `--seq` tokens: its peak memory,
//! parameters and gradients included. For each cp degree the benchmark
//! then finds, by doubling and then bisection over lengths the split
//! allows, the longest sequence whose step keeps every rank's peak within
//! that budget, each length measured by running the step. It reports the
//! lengths and their ratio to cp = 1's, the step time of each degree on
//! the budget sequence against cp = 1's, and the ring's communication:
//! the time the ranks spent in its sends and receives in a step (what the
//! attention did not hide; the shortest total of any rank, since the rest
//! is a rank arriving late), against the same calls replayed alone
//! (what the ring carries), and the fraction hidden, `1 − exposed /
//! carried`.

use anyhow::{ensure, Result};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera::dist::inproc::InProcess;
use tessera::dist::mesh::Mesh;
use tessera::dist::{Communicator, Pending};
use tessera::module::{self, Act, ContextSplit, Cx};
use tessera::nn::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward};
use tessera::prelude::*;
use tessera_models::llama::{Llama, LlamaConfig};

#[derive(clap::Args)]
pub struct Args {
    /// Context-parallel degrees to measure (1 is the reference).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    cps: Vec<usize>,
    /// The sequence whose one-rank step sets the memory budget.
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 64)]
    dim: usize,
    /// Decoder layers.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Query heads (2 key/value heads).
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Timed steps per degree on the budget sequence (after one untimed step).
    #[arg(long, default_value_t = 3)]
    steps: usize,
}

const VOCAB: usize = 64;
/// The longest sequence the search tries, as a multiple of `--seq`.
const MAX_GROWTH: usize = 16;

/// A communicator that adds up the time its rank's thread spent in the
/// ring's `send`s (each copies a block out) and `recv`s (each waits for
/// one), and records them for the replay.
#[derive(Debug)]
struct Waits {
    inner: Arc<dyn Communicator>,
    waited: Mutex<Duration>,
    calls: Mutex<Vec<Call>>,
}

/// A point-to-point call of the ring, as the replay repeats it (a send by
/// the shape and dtype it sent: keeping the blocks themselves would hold
/// memory the step's peak would count).
#[derive(Debug)]
enum Call {
    Send(Shape, DType, usize),
    Recv(usize),
}

impl Waits {
    fn timed<T>(&self, call: Call, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        *self.waited.lock().expect("waits") += start.elapsed();
        self.calls.lock().expect("calls").push(call);
        out
    }
}

impl Communicator for Waits {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> tessera::Result<Tensor> {
        self.inner.all_reduce_sum(t)
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> tessera::Result<Tensor> {
        self.inner.all_gather(t, dim)
    }
    fn reduce_scatter_sum(&self, t: &Tensor, dim: usize) -> tessera::Result<Tensor> {
        self.inner.reduce_scatter_sum(t, dim)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> tessera::Result<Tensor> {
        self.inner.broadcast(t, root)
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> tessera::Result<Vec<Tensor>> {
        self.inner.all_to_all(parts)
    }
    fn barrier(&self) -> tessera::Result<()> {
        self.inner.barrier()
    }
    fn send(&self, t: &Tensor, peer: usize) -> tessera::Result<()> {
        self.timed(Call::Send(t.shape().clone(), t.dtype(), peer), || self.inner.send(t, peer))
    }
    fn recv(&self, peer: usize) -> tessera::Result<Tensor> {
        self.timed(Call::Recv(peer), || self.inner.recv(peer))
    }
    fn all_reduce_sum_async(&self, t: &Tensor) -> tessera::Result<Pending> {
        self.inner.all_reduce_sum_async(t)
    }
}

/// One degree's step on `seq` tokens, `steps` times after an untimed one:
/// the largest peak memory of any rank (bytes), the median step time over
/// the ranks' slowest, the median over steps of the shortest time any
/// rank spent in the ring's calls (the communication the attention left
/// exposed), and the same for the last step's calls replayed alone, `steps`
/// times (the communication the ring carries).
#[derive(Clone, Copy)]
struct Measured {
    peak: usize,
    step: Duration,
    waited: Duration,
    carried: Duration,
}

impl Measured {
    /// The fraction of the ring's communication the attention hid (none
    /// without a ring: one rank).
    fn hidden(&self, cp: usize) -> Option<f64> {
        (cp > 1 && !self.carried.is_zero()).then(|| 1.0 - self.waited.as_secs_f64() / self.carried.as_secs_f64())
    }
}

fn measure(args: &Args, cp: usize, seq: usize, steps: usize) -> Result<Measured> {
    let cfg = LlamaConfig::tiny(VOCAB, args.dim, args.heads, 2, 2 * args.dim, args.layers, seq);
    let mesh = Mesh::parse(&format!("cp{cp}"), cp, cp)?;
    let world = InProcess::new(cp)?;
    let barrier = std::sync::Barrier::new(cp);
    type RankRuns = (Vec<(usize, Duration, Duration)>, Vec<Duration>);
    let per_rank: Vec<RankRuns> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..cp)
            .map(|rank| {
                let (world, mesh, cfg, barrier) = (&world, &mesh, &cfg, &barrier);
                s.spawn(move || -> Result<RankRuns> {
                    let dev = Device::cpu();
                    let mut groups = tessera::dist::inproc::mesh_groups(world, mesh, rank, &dev)?;
                    let waits = Arc::new(Waits { inner: groups.cp.clone(), waited: Mutex::default(), calls: Mutex::default() });
                    groups.cp = waits.clone();
                    let mut cx = Cx::new(dev.clone()).with_seed(1).with_groups(groups);
                    let model = module::build(Llama::new(cfg)?, &cx)?;
                    let split = ContextSplit::new(rank, cp)?;
                    let ids = |salt: usize| -> tessera::Result<Tensor> {
                        let v: Vec<u32> = (0..seq).map(|i| ((i * 7 + salt) % VOCAB) as u32).collect();
                        split.local_of(&Tensor::from_vec(v, [1, seq], &dev)?, 1)
                    };
                    let (input, targets) = (ids(1)?, ids(5)?);
                    let mut out = Vec::new();
                    for _ in 0..=steps {
                        *waits.waited.lock().expect("waits") = Duration::ZERO;
                        waits.calls.lock().expect("calls").clear();
                        barrier.wait();
                        dev.reset_peak();
                        let start = Instant::now();
                        let (logits, saved) = model.forward(&mut cx, Act::new(input.clone()))?;
                        let (_, ce) = vocab_parallel_cross_entropy(cx.tp(), &logits, &targets, VOCAB, None)?;
                        let dl = vocab_parallel_cross_entropy_backward(&logits, &targets, VOCAB, None, &ce, 1.0)?;
                        drop(logits);
                        model.backward(&mut cx, saved, dl)?;
                        let took = start.elapsed();
                        out.push((dev.memory_stats().peak, took, *waits.waited.lock().expect("waits")));
                        module::visit_params(&model, |e| {
                            e.param.take_grad();
                            Ok(())
                        })?;
                    }
                    // The last step's ring alone, nothing to overlap.
                    let calls = std::mem::take(&mut *waits.calls.lock().expect("calls"));
                    // The sends with blocks of the shapes they sent, made before the timing.
                    let replay: Vec<(Option<Tensor>, usize)> = calls
                        .iter()
                        .map(|c| match c {
                            Call::Send(shape, dtype, peer) => Ok((Some(Tensor::zeros(shape.clone(), *dtype, &dev)?), *peer)),
                            Call::Recv(peer) => Ok((None, *peer)),
                        })
                        .collect::<tessera::Result<_>>()?;
                    let mut replays = Vec::new();
                    for _ in 0..steps {
                        barrier.wait();
                        let start = Instant::now();
                        for (block, peer) in &replay {
                            match block {
                                Some(t) => waits.inner.send(t, *peer)?,
                                None => drop(waits.inner.recv(*peer)?),
                            }
                        }
                        replays.push(start.elapsed());
                    }
                    Ok((out, replays))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect::<Result<Vec<_>>>()
    })?;
    // (No timed steps: only the peak is wanted.)
    let median = |mut v: Vec<Duration>| {
        v.sort();
        v.get(v.len() / 2).copied().unwrap_or_default()
    };
    let timed = 1..=steps;
    Ok(Measured {
        peak: per_rank.iter().flat_map(|(r, _)| r.iter().map(|x| x.0)).max().unwrap_or(0),
        step: median(timed.clone().map(|i| per_rank.iter().map(|(r, _)| r[i].1).max().unwrap_or_default()).collect()),
        waited: median(timed.map(|i| per_rank.iter().map(|(r, _)| r[i].2).min().unwrap_or_default()).collect()),
        carried: median((0..steps).map(|i| per_rank.iter().map(|(_, r)| r[i]).min().unwrap_or_default()).collect()),
    })
}

/// The longest sequence (a multiple of `quantum`) whose step on `cp` ranks
/// peaks within `budget` bytes on every rank.
fn longest(args: &Args, cp: usize, budget: usize, quantum: usize) -> Result<usize> {
    let fits = |seq: usize| -> Result<bool> { Ok(measure(args, cp, seq, 0)?.peak <= budget) };
    let (mut good, mut bad) = (0, quantum);
    while bad <= MAX_GROWTH * args.seq && fits(bad)? {
        good = bad;
        bad *= 2;
    }
    while bad - good > quantum {
        let mid = (good + bad) / 2 / quantum * quantum;
        if fits(mid)? {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Ok(good)
}

pub fn run(args: &Args) -> Result<()> {
    ensure!(args.cps.first() == Some(&1), "--cps must start with 1, the reference degree");
    ensure!(args.steps > 0 && args.seq > 0, "--steps and --seq must be at least 1");
    let quantum = 2 * args.cps.iter().copied().max().unwrap_or(1) * 8;
    ensure!(args.seq.is_multiple_of(quantum), "--seq ({}) must be a multiple of 16 × the largest degree ({quantum})", args.seq);
    let budget = measure(args, 1, args.seq, 0)?.peak;
    println!(
        "context-parallel: Llama of {} layers (hidden {}, {} query / 2 key-value heads); budget: one rank's step on {} tokens, {:.2} MB",
        args.layers,
        args.dim,
        args.heads,
        args.seq,
        budget as f64 / 1e6
    );
    let reference = measure(args, 1, args.seq, args.steps)?;
    let mut longest_one = 0;
    for &cp in &args.cps {
        let seq = longest(args, cp, budget, quantum)?;
        if cp == 1 {
            longest_one = seq;
        }
        let m = if cp == 1 { reference } else { measure(args, cp, args.seq, args.steps)? };
        let growth = seq as f64 / longest_one as f64;
        println!(
            "context-parallel: cp{cp}: longest sequence within the budget {seq} tokens ({growth:.2} × cp1's); on {} tokens: step {:.1} ms ({:.2} × cp1's), peak {:.2} MB per rank{}",
            args.seq,
            1e3 * m.step.as_secs_f64(),
            m.step.as_secs_f64() / reference.step.as_secs_f64(),
            m.peak as f64 / 1e6,
            match m.hidden(cp) {
                Some(h) => format!(
                    ", ring communication exposed {:.2} ms of {:.2} ms carried ({:.0} % hidden)",
                    1e3 * m.waited.as_secs_f64(),
                    1e3 * m.carried.as_secs_f64(),
                    100.0 * h
                ),
                None => String::new(),
            }
        );
        println!(
            "{}",
            serde_json::json!({
                "bench": "context-parallel",
                "case": format!("llama d{} L{} cp{cp}", args.dim, args.layers),
                "budget_bytes": budget,
                "longest_seq": seq,
                "longest_seq_ratio": growth,
                "step_ms": 1e3 * m.step.as_secs_f64(),
                "step_ratio": m.step.as_secs_f64() / reference.step.as_secs_f64(),
                "peak_bytes": m.peak,
                "ring_exposed_ms": 1e3 * m.waited.as_secs_f64(),
                "ring_carried_ms": 1e3 * m.carried.as_secs_f64(),
                "ring_hidden": m.hidden(cp),
            })
        );
    }
    Ok(())
}
