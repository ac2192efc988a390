//! `bench tp-overlap`: how much of the tensor-parallel communication of a
//! sequence-parallel GPT-2 the compute never waits for, with the collectives
//! whole and overlapping the products (`Cx::with_tp_overlap`: the gathers
//! beside the own slice's products, the row products' slices sent while the
//! next is computed, the input gradients' reduce-scatters cut into pieces),
//! on CPU ranks (threads, each on a thread pool of its own).
//!
//! Every rank's tensor-parallel communicator is wrapped to time what the
//! rank's thread spends in it: each blocking call (a receive included), and
//! each wait for a collective or a send started in the background. Part of such a wait is not
//! communication but the other rank arriving later (ranks drift apart by a
//! few percent when they share cores with the system); the rank that arrives
//! last waits only for the communication itself. So each wait counts with
//! the shortest time any rank spent in it (every rank makes the same calls
//! and waits in the same order), and their sum is the communication a step
//! leaves exposed. The communication a step carries is the same sequence of
//! collectives (recorded from one step) replayed alone, with nothing to
//! overlap, counted the same way. The fraction hidden is
//! `1 − exposed / carried`; the step times of both settings are printed
//! beside it, the figure that says whether hiding the communication also
//! made the step faster (with fewer cores than ranks plus their
//! communication threads, the copies the collectives make take cores from
//! the products, and it need not).
//! The settings alternate within each round and the medians of every timed
//! step are compared.

use anyhow::{ensure, Result};
use std::collections::BTreeMap;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};
use tessera::dist::inproc::InProcess;
use tessera::dist::{Communicator, Pending};
use tessera::module::{self, Act, Cx, Groups};
use tessera::nn::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward};
use tessera::prelude::*;
use tessera_models::gpt2::{Gpt2, Gpt2Config};

#[derive(clap::Args)]
pub struct Args {
    /// Tensor-parallel ranks (threads).
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 256)]
    dim: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 512)]
    seq: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 2)]
    rows: usize,
    /// Pieces each input gradient's reduce-scatter is cut into (`mesh.tp_overlap`).
    #[arg(long, default_value_t = 2)]
    pieces: usize,
    /// Threads each rank computes on.
    #[arg(long, default_value_t = 1)]
    threads_per_rank: usize,
    /// Steps per setting and round (after one untimed step).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Rounds; the settings alternate within each.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

const VOCAB: usize = 512;

/// A tensor-parallel call as the replay repeats it.
#[derive(Clone, Debug)]
enum Call {
    AllReduce(Tensor),
    AllGather(Tensor, usize),
    ReduceScatter(Tensor, usize),
}

/// The rank's communicator, timing what its thread spends waiting in it and
/// recording the calls.
#[derive(Debug)]
struct Timed {
    inner: Arc<dyn Communicator>,
    /// Each wait of the rank's thread, in order, with what it waited for.
    waited: Arc<Mutex<Vec<Wait>>>,
    calls: Mutex<Vec<Call>>,
}

impl Timed {
    fn time<T>(&self, what: &'static str, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.waited.lock().unwrap().push((what, t.elapsed()));
        out
    }
    fn record(&self, c: Call) {
        self.calls.lock().unwrap().push(c);
    }
    /// A handle whose wait is timed like a blocking call.
    fn timed<T: Send + 'static>(&self, what: &'static str, p: Pending<T>) -> Pending<T> {
        let inner = Arc::new(Mutex::new(Some(p)));
        let (probe, waited, rank) = (inner.clone(), self.waited.clone(), self.inner.rank());
        Pending::queued(
            "timed",
            rank,
            move || probe.lock().unwrap().as_ref().is_none_or(Pending::is_done),
            move || {
                let p = inner.lock().unwrap().take().expect("waited once");
                let t = Instant::now();
                let out = p.wait();
                waited.lock().unwrap().push((what, t.elapsed()));
                out
            },
        )
    }
    fn take_waited(&self) -> Vec<Wait> {
        std::mem::take(&mut *self.waited.lock().unwrap())
    }
    fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }
}

impl Communicator for Timed {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> tessera::Result<Tensor> {
        self.record(Call::AllReduce(t.clone()));
        self.time("all-reduce, blocking", || self.inner.all_reduce_sum(t))
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> tessera::Result<Tensor> {
        self.record(Call::AllGather(t.clone(), dim));
        self.time("all-gather, blocking", || self.inner.all_gather(t, dim))
    }
    fn reduce_scatter_sum(&self, t: &Tensor, dim: usize) -> tessera::Result<Tensor> {
        self.record(Call::ReduceScatter(t.clone(), dim));
        self.time("reduce-scatter, blocking", || self.inner.reduce_scatter_sum(t, dim))
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> tessera::Result<Tensor> {
        self.time("broadcast", || self.inner.broadcast(t, root))
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> tessera::Result<Vec<Tensor>> {
        self.time("all-to-all", || self.inner.all_to_all(parts))
    }
    fn barrier(&self) -> tessera::Result<()> {
        self.time("barrier", || self.inner.barrier())
    }
    fn all_reduce_sum_async(&self, t: &Tensor) -> tessera::Result<Pending> {
        self.record(Call::AllReduce(t.clone()));
        Ok(self.timed("all-reduce, background", self.inner.all_reduce_sum_async(t)?))
    }
    fn all_gather_async(&self, t: &Tensor, dim: usize) -> tessera::Result<Pending> {
        self.record(Call::AllGather(t.clone(), dim));
        Ok(self.timed("all-gather, background", self.inner.all_gather_async(t, dim)?))
    }
    fn reduce_scatter_sum_async(&self, t: &Tensor, dim: usize) -> tessera::Result<Pending> {
        self.record(Call::ReduceScatter(t.clone(), dim));
        Ok(self.timed("reduce-scatter, background", self.inner.reduce_scatter_sum_async(t, dim)?))
    }
    fn send(&self, t: &Tensor, peer: usize) -> tessera::Result<()> {
        self.time("send, blocking", || self.inner.send(t, peer))
    }
    fn send_async(&self, t: &Tensor, peer: usize) -> tessera::Result<Pending<()>> {
        Ok(self.timed("send, background", self.inner.send_async(t, peer)?))
    }
    fn recv(&self, peer: usize) -> tessera::Result<Tensor> {
        self.time("receive", || self.inner.recv(peer))
    }
}

/// One rank's part of one timed step.
struct RankStep {
    start: Instant,
    end: Instant,
    waits: Vec<Wait>,
}

/// A wait of a rank's thread: what it waited for, and how long.
type Wait = (&'static str, Duration);

/// The seconds of communication in a step whose ranks waited `waits` (one
/// list per rank, the same waits in the same order), by what was waited for:
/// each wait's shortest time over the ranks, summed.
fn shortest(waits: &[&[Wait]]) -> Result<BTreeMap<&'static str, f64>> {
    let n = waits[0].len();
    ensure!(
        waits.iter().all(|w| w.len() == n),
        "the ranks waited a different number of times ({:?}); they must make the same calls",
        waits.iter().map(|w| w.len()).collect::<Vec<_>>()
    );
    let mut by = BTreeMap::new();
    for i in 0..n {
        *by.entry(waits[0][i].0).or_default() += waits.iter().map(|w| w[i].1.as_secs_f64()).fold(f64::INFINITY, f64::min);
    }
    Ok(by)
}

/// One rank's timed steps (`[round][setting][step]`) and each replay's time per call.
type RankRuns = (Vec<Vec<Vec<RankStep>>>, Vec<Vec<Wait>>);

/// Settings: the collectives whole, then overlapped.
fn settings(args: &Args) -> [usize; 2] {
    [1, args.pieces]
}

pub fn run(args: &Args) -> Result<()> {
    ensure!(args.tp >= 2, "--tp must be at least 2: one rank has no tensor-parallel communication");
    ensure!(args.pieces >= 2, "--pieces must be at least 2 (1 is the whole collectives the benchmark compares against)");
    ensure!(args.seq.is_multiple_of(args.tp), "--seq ({}) must be a multiple of --tp ({})", args.seq, args.tp);
    ensure!(
        args.rounds > 0 && args.steps > 0 && args.rows > 0 && args.threads_per_rank > 0,
        "--rounds, --steps, --rows and --threads-per-rank must be at least 1"
    );
    let tp = args.tp;
    let heads = (args.dim / 64).max(tp);
    let cfg = Gpt2Config::tiny(VOCAB, args.dim, heads, args.layers, args.seq);
    println!(
        "tp-overlap: GPT-2 of {} blocks (hidden {}, {heads} heads, {} tokens × {} sequences) on tp{tp} with sequence parallelism, {} thread(s) per rank; collectives whole and overlapped (input gradients reduce-scattered in {} pieces), {} rounds of {} steps",
        args.layers, args.dim, args.seq, args.rows, args.threads_per_rank, args.pieces, args.rounds, args.steps
    );
    let world = InProcess::new(tp)?;
    let barrier = Barrier::new(tp);
    let per_rank: Vec<RankRuns> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..tp)
            .map(|rank| {
                let (world, barrier, cfg) = (&world, &barrier, &cfg);
                s.spawn(move || -> Result<_> {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(args.threads_per_rank).build()?;
                    pool.install(|| {
                        let dev = Device::cpu();
                        let inner: Arc<dyn Communicator> = Arc::new(world.communicator(rank, &dev)?);
                        let timed = Arc::new(Timed { inner: inner.clone(), waited: Arc::default(), calls: Mutex::default() });
                        let mut groups = Groups::single();
                        groups.tp = timed.clone();
                        let cx_for =
                            |pieces| Cx::new(dev.clone()).with_seed(1).with_groups(groups.clone()).with_sequence_parallel(true).with_tp_overlap(pieces);
                        let mut cxs: Vec<Cx> = settings(args).iter().map(|&p| cx_for(p)).collect();
                        let model = module::build(Gpt2::new(cfg)?, &cxs[0])?;
                        let ids = |salt: usize| -> tessera::Result<Tensor> {
                            let v: Vec<u32> = (0..args.rows * args.seq).map(|i| ((i * 7 + salt) % VOCAB) as u32).collect();
                            Tensor::from_vec(v, [args.rows, args.seq], &dev)
                        };
                        let (input, targets) = (ids(1)?, ids(5)?);
                        let step = |cx: &mut Cx| -> Result<RankStep> {
                            timed.take_calls();
                            timed.take_waited();
                            barrier.wait();
                            let start = Instant::now();
                            let (logits, saved) = model.forward(cx, Act::new(input.clone()))?;
                            let (_, ce) = vocab_parallel_cross_entropy(&*timed, &logits, &targets, VOCAB, None)?;
                            let dl = vocab_parallel_cross_entropy_backward(&logits, &targets, VOCAB, None, &ce, 1.0)?;
                            drop(logits);
                            model.backward(cx, saved, dl)?;
                            let end = Instant::now();
                            let waits = timed.take_waited();
                            module::visit_params(&model, |e| {
                                e.param.take_grad();
                                Ok(())
                            })?;
                            Ok(RankStep { start, end, waits })
                        };
                        for cx in cxs.iter_mut() {
                            step(cx)?;
                        }
                        let mut rounds = Vec::new();
                        for _ in 0..args.rounds {
                            let mut per_setting = Vec::new();
                            for cx in cxs.iter_mut() {
                                per_setting.push((0..args.steps).map(|_| step(cx)).collect::<Result<Vec<_>>>()?);
                            }
                            rounds.push(per_setting);
                        }
                        // The communication one step of the whole collectives carries, alone.
                        step(&mut cxs[0])?;
                        let calls = timed.take_calls();
                        let mut replays = Vec::new();
                        for _ in 0..args.rounds * args.steps {
                            barrier.wait();
                            let mut each = Vec::with_capacity(calls.len());
                            for c in &calls {
                                let t = Instant::now();
                                let what = match c {
                                    Call::AllReduce(x) => inner.all_reduce_sum(x).map(|_| "all-reduce")?,
                                    Call::AllGather(x, d) => inner.all_gather(x, *d).map(|_| "all-gather")?,
                                    Call::ReduceScatter(x, d) => inner.reduce_scatter_sum(x, *d).map(|_| "reduce-scatter")?,
                                };
                                each.push((what, t.elapsed()));
                            }
                            replays.push(each);
                        }
                        Ok((rounds, replays))
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect::<Result<Vec<_>>>()
    })?;

    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let names = ["whole", "overlapped"];
    let (mut step_ms, mut exposed_ms, mut exposed_by) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..2 {
        let (mut spans, mut exposed, mut by) = (Vec::new(), Vec::new(), BTreeMap::<&str, Vec<f64>>::new());
        for round in 0..args.rounds {
            for i in 0..args.steps {
                let steps: Vec<&RankStep> = per_rank.iter().map(|(r, _)| &r[round][k][i]).collect();
                let first = steps.iter().map(|x| x.start).min().expect("ranks");
                let last = steps.iter().map(|x| x.end).max().expect("ranks");
                spans.push(1e3 * (last - first).as_secs_f64());
                let waited = shortest(&steps.iter().map(|x| x.waits.as_slice()).collect::<Vec<_>>())?;
                exposed.push(1e3 * waited.values().sum::<f64>());
                for (what, t) in waited {
                    by.entry(what).or_default().push(1e3 * t);
                }
            }
        }
        step_ms.push(median(&spans));
        exposed_ms.push(median(&exposed));
        exposed_by.push(by.into_iter().map(|(what, t)| (what, median(&t))).collect::<BTreeMap<_, _>>());
    }
    let replays: Vec<f64> = (0..args.rounds * args.steps)
        .map(|i| Ok(1e3 * shortest(&per_rank.iter().map(|(_, r)| r[i].as_slice()).collect::<Vec<_>>())?.values().sum::<f64>()))
        .collect::<Result<_>>()?;
    let comm_ms = median(&replays);
    let hidden: Vec<f64> = exposed_ms.iter().map(|e| 1.0 - e / comm_ms).collect();
    for k in 0..2 {
        println!(
            "tp-overlap: {:<10} step {:>7.1} ms, communication exposed {:>6.2} ms of {:.2} ms carried: {:.0} % hidden",
            names[k],
            step_ms[k],
            exposed_ms[k],
            comm_ms,
            100.0 * hidden[k]
        );
        let by: Vec<String> = exposed_by[k].iter().map(|(what, t)| format!("{what} {t:.2}")).collect();
        println!("tp-overlap: {:<10} exposed by wait (medians, ms): {}", names[k], by.join("; "));
    }
    println!(
        "tp-overlap: overlapped ({} pieces) / whole: exposed communication {:.2}, step time {:.3}",
        args.pieces,
        exposed_ms[1] / exposed_ms[0],
        step_ms[1] / step_ms[0]
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "tp-overlap",
            "case": format!("gpt2 d{} L{} seq{} tp{} sp, {} pieces", args.dim, args.layers, args.seq, tp, args.pieces),
            "comm_ms": comm_ms,
            "exposed_ms_whole": exposed_ms[0],
            "exposed_ms_pieces": exposed_ms[1],
            "hidden_whole": hidden[0],
            "hidden_pieces": hidden[1],
            "exposed_ratio": exposed_ms[1] / exposed_ms[0],
            "step_ms_whole": step_ms[0],
            "step_ms_pieces": step_ms[1],
            "step_ratio": step_ms[1] / step_ms[0],
        })
    );
    Ok(())
}
