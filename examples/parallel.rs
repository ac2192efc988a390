//! Trains a small GPT on in-process CPU ranks with a hybrid mesh
//! (data × tensor × pipeline parallelism) and reports, per rank, memory,
//! gradient communication (in all, and the part the backward did not hide)
//! and the pipeline bubble.
//!
//! Each stage materialises only its own layers; data-parallel gradients go
//! in buckets all-reduced while the backward runs, as in the trainer.
//! `--compare` also runs the same steps with every bucket sent after the
//! backward, and sets the step time overlap saved beside what the
//! communication figures claim.
//!
//! Run: `cargo run --release --example parallel -- --dp 2 --tp 2 --pp 2 --schedule interleaved --compare`

use anyhow::{bail, ensure, Result};
use clap::Parser;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera::dist::inproc::{mesh_groups, InProcess};
use tessera::dist::mesh::{Axis, Mesh};
use tessera::module::{self, Groups};
use tessera::nn::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward, CausalAttention, Embedding, LayerNorm, Linear, Stack};
use tessera::optim::{AdamW, AdamWConfig};
use tessera::parallel::data::DataParallel;
use tessera::parallel::pipeline::{run_stage, sync_tied_grads, Costs, ScheduleKind};
use tessera::prelude::*;

#[derive(Parser, Clone)]
#[command(about = "Train a small GPT on CPU ranks with data, tensor and pipeline parallelism")]
struct Args {
    /// Data-parallel replicas.
    #[arg(long, default_value_t = 2)]
    dp: usize,
    /// Tensor-parallel degree (divides the heads and the vocabulary).
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Pipeline stages (divide the layers).
    #[arg(long, default_value_t = 2)]
    pp: usize,
    /// Context-parallel degree: each sequence split over this many ranks,
    /// attention around their ring (2 · cp must divide the 16 tokens).
    #[arg(long, default_value_t = 1)]
    cp: usize,
    /// Sequence parallelism on the tensor-parallel group.
    #[arg(long)]
    sp: bool,
    /// With --sp, 2 or more: overlap each tensor-parallel all-gather with
    /// the own slice's product and cut each reduce-scatter into this many
    /// pieces that overlap the products (1: whole).
    #[arg(long, default_value_t = 1)]
    tp_overlap: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Microbatches per replica and step (one sequence each).
    #[arg(long, default_value_t = 4)]
    microbatches: usize,
    /// Pipeline schedule: gpipe, 1f1b, interleaved or zb-h1.
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Model chunks per stage under the interleaved schedule.
    #[arg(long, default_value_t = 2)]
    chunks: usize,
    /// Data-parallel bucket size in bytes.
    #[arg(long, default_value_t = 4096)]
    bucket_bytes: usize,
    /// Also run the same steps with the gradients sent after the backward,
    /// and compare.
    #[arg(long)]
    compare: bool,
    /// With --compare: runs of each kind, alternating; the fastest of each
    /// is compared (the machine's noise only ever slows a run down).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

impl Args {
    fn schedule(&self) -> Result<ScheduleKind> {
        Ok(match self.schedule.as_str() {
            "gpipe" => ScheduleKind::GPipe,
            "1f1b" => ScheduleKind::OneFOneB,
            "interleaved" => ScheduleKind::Interleaved { chunks: self.chunks },
            "zb-h1" => ScheduleKind::ZeroBubbleH1,
            other => bail!("unknown schedule `{other}`; use gpipe, 1f1b, interleaved or zb-h1"),
        })
    }
}

const VOCAB: usize = 32;
const SEQ: usize = 16;
const DIM: usize = 32;
const HEADS: usize = 4;
const LAYERS: usize = 4;

#[derive(Module)]
pub struct Block {
    ln1: LayerNorm,
    #[shard(column)]
    qkv: Linear,
    attn: CausalAttention,
    #[shard(row)]
    proj: Linear,
    ln2: LayerNorm,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl Block {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + all_reduce(self.proj(self.attn(self.qkv(self.ln1(x)))));
        h + all_reduce(self.down(gelu(self.up(self.ln2(h)))))
    }
}

#[derive(Module)]
pub struct Gpt {
    #[stage(first)]
    #[shard(vocab)]
    tok: Embedding,
    #[stage(split)]
    blocks: Stack<Block>,
    #[stage(last)]
    norm: LayerNorm,
    #[stage(last)]
    #[shard(vocab)]
    #[tied(tok)]
    head: Linear,
}

#[forward]
impl Gpt {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        let h = all_reduce(self.tok(ids));
        self.head(self.norm(self.blocks(h)))
    }
}

fn gpt() -> tessera::Result<Gpt> {
    let block = |_| -> tessera::Result<Block> {
        Ok(Block {
            ln1: LayerNorm::new(DIM, 1e-5, true)?,
            qkv: Linear::new(DIM, 3 * DIM, false)?,
            attn: CausalAttention::new(HEADS, HEADS, DIM / HEADS)?.with_rope(10_000.0, SEQ)?,
            proj: Linear::new(DIM, DIM, true)?,
            ln2: LayerNorm::new(DIM, 1e-5, true)?,
            up: Linear::new(DIM, 4 * DIM, true)?,
            down: Linear::new(4 * DIM, DIM, true)?,
        })
    };
    Ok(Gpt {
        tok: Embedding::new(VOCAB, DIM)?,
        blocks: Stack::from_fn(LAYERS, block)?,
        norm: LayerNorm::new(DIM, 1e-5, true)?,
        head: Linear::new(DIM, VOCAB, false)?,
    })
}

/// Sequence `n` of step `step`: counting from a start by a stride of 1 to 3
/// (mod the vocabulary); the model must read the stride from the context.
fn sequence(step: usize, n: usize) -> (Vec<u32>, Vec<u32>) {
    let h = (step * 7919 + n * 104_729) as u64;
    let (start, stride) = ((h % VOCAB as u64) as usize, 1 + (h / 7 % 3) as usize);
    let tok = |i: usize| ((start + i * stride) % VOCAB) as u32;
    ((0..SEQ).map(tok).collect(), (1..=SEQ).map(tok).collect())
}

/// What a rank reports at the end.
struct RankReport {
    rank: usize,
    coords: String,
    peak_bytes: usize,
    /// Bytes of parameters this rank holds (its stage's, its tp shards).
    param_bytes: usize,
    /// Gradient communication in flight, summed over steps.
    dp_comm: Duration,
    /// The part of it the backward did not hide.
    dp_exposed: Duration,
    compute: Duration,
    waiting: Duration,
    /// Wall time of the steps after the first few (which warm the
    /// allocator and start the communication threads).
    timed: Duration,
}

/// Steps left out of the timing.
fn warm_up_steps(steps: usize) -> usize {
    (steps / 10).min(5)
}

/// When the data-parallel buckets go.
#[derive(Clone, Copy, PartialEq)]
enum Sync {
    /// Each as soon as its gradients are final, while the backward runs.
    Overlapped,
    /// All after the backward.
    After,
}

fn run_rank(args: &Args, sync: Sync, world: &InProcess, mesh: &Mesh, rank: usize, log: &Mutex<Vec<(usize, f64)>>) -> Result<RankReport> {
    let dev = Device::cpu();
    let c = mesh.coords(rank)?;
    let (d, t, stage, k) = (c[Axis::Dp], c[Axis::Tp], c[Axis::Pp], c[Axis::Cp]);
    let groups: Groups = mesh_groups(world, mesh, rank, &dev)?;
    let (tp, dp) = (groups.tp.clone(), groups.dp.clone());
    let kind = args.schedule()?;
    let chunks = kind.chunks();
    // Each stage materialises only its own layers.
    let mut cx =
        Cx::new(dev.clone()).with_seed(1).with_groups(groups).with_sequence_parallel(args.sp).with_tp_overlap(args.tp_overlap).with_pipeline_chunks(chunks);
    let model = module::build(gpt()?, &cx)?;
    let param_bytes: usize =
        module::distinct_params(&model)?.iter().filter(|n| !n.param.is_remote()).map(|n| n.param.local_shape().elem_count() * std::mem::size_of::<f32>()).sum();
    // The trainer's data parallelism: buckets all-reduced as the backward
    // finishes their gradients (installed as hooks), or all after it.
    let engine = Arc::new(DataParallel::new(&model, dp.clone(), args.bucket_bytes)?);
    if sync == Sync::Overlapped {
        cx = cx.with_hooks(engine.clone());
    }
    let mut opt = AdamW::new(&model, AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() })?;
    let schedule = kind.build(args.pp, args.microbatches)?;
    let (mut dp_comm, mut dp_exposed, mut compute, mut waiting) = (Duration::ZERO, Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let mut timing_from = Instant::now();
    for step in 0..args.steps {
        if step == warm_up_steps(args.steps) {
            timing_from = Instant::now();
        }
        // Each context-parallel rank keeps its chunks of every sequence.
        let seqs: Vec<_> = (0..args.microbatches).map(|i| sequence(step, d * args.microbatches + i)).collect();
        let local = |v: &[u32]| cx.context_split().local_of(&Tensor::from_vec(v.to_vec(), [1, SEQ], &dev)?, 1);
        let inputs: Vec<Tensor> = seqs.iter().map(|(x, _)| local(x)).collect::<tessera::Result<_>>()?;
        let targets: Vec<Tensor> = seqs.iter().map(|(_, y)| local(y)).collect::<tessera::Result<_>>()?;
        let m = args.microbatches as f64;
        let report = run_stage(&model, &mut cx, &schedule, stage, &inputs, |mb, out| {
            let (l, saved) = vocab_parallel_cross_entropy(&*tp, out, &targets[mb], VOCAB, None)?;
            let dl = vocab_parallel_cross_entropy_backward(out, &targets[mb], VOCAB, None, &saved, 1.0 / m)?;
            Ok((l.to_scalar()?, dl))
        })?;
        compute += report.compute;
        waiting += report.waiting;
        // The tied embedding and head sum over their stages, then every
        // bucket not sent yet goes and the averages come back.
        sync_tied_grads(&model, &cx)?;
        let stats = engine.finish()?;
        dp_comm += stats.comm;
        dp_exposed += stats.exposed;
        let lr = 3e-3 * (1.0 - step as f64 / args.steps as f64).max(0.1);
        opt.step(lr)?;
        opt.zero_grad();
        if stage == args.pp - 1 {
            let local = report.losses.iter().map(|(_, l)| l).sum::<f64>() / m;
            // Over the data-parallel group: the replicas and their cp ranks.
            let mean = dp.all_reduce_sum(&Tensor::from_vec(vec![local], [1], &dev)?)?.to_scalar()? / dp.size() as f64;
            if d == 0 && t == 0 && k == 0 {
                log.lock().expect("log").push((step, mean));
            }
        }
    }
    let timed = timing_from.elapsed();
    Ok(RankReport {
        rank,
        coords: if args.cp > 1 { format!("dp{d} cp{k} tp{t} pp{stage}") } else { format!("dp{d} tp{t} pp{stage}") },
        peak_bytes: dev.memory_stats().peak,
        param_bytes,
        dp_comm,
        dp_exposed,
        compute,
        waiting,
        timed,
    })
}

/// What one run measured.
struct Run {
    reports: Vec<RankReport>,
    losses: Vec<(usize, f64)>,
    elapsed: Duration,
}

impl Run {
    /// Milliseconds per step after the warm-up, on the slowest rank.
    fn step_ms(&self, steps: usize) -> f64 {
        let timed = self.reports.iter().map(|r| r.timed).max().unwrap_or_default();
        timed.as_secs_f64() * 1e3 / (steps - warm_up_steps(steps)) as f64
    }
}

fn run(args: &Args, sync: Sync, mesh: &Mesh) -> Result<Run> {
    let world_size = mesh.world();
    let world = InProcess::new(world_size)?;
    let log = Mutex::new(Vec::new());
    let started = Instant::now();
    let reports: Vec<Result<RankReport>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (world, log) = (&world, &log);
                s.spawn(move || {
                    let r = run_rank(args, sync, world, mesh, rank, log);
                    if let Err(e) = &r {
                        world.abort(rank, &e.to_string());
                    }
                    r
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    let elapsed = started.elapsed();
    let mut losses = log.into_inner().expect("log");
    losses.sort_by_key(|(s, _)| *s);
    let mut reports = reports.into_iter().collect::<Result<Vec<_>>>()?;
    reports.sort_by_key(|r| r.rank);
    Ok(Run { reports, losses, elapsed })
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(args.dp > 0 && args.tp > 0 && args.pp > 0 && args.cp > 0 && args.steps > 0, "--dp, --tp, --pp, --cp and --steps must each be at least 1");
    ensure!(SEQ.is_multiple_of(2 * args.cp), "--cp {} cuts the {SEQ}-token sequences into 2 · cp chunks; use 1, 2, 4 or 8", args.cp);
    ensure!(args.tp_overlap > 0, "--tp-overlap must be at least 1 (1: whole collectives)");
    ensure!(
        args.tp_overlap == 1 || (args.sp && args.tp > 1),
        "--tp-overlap overlaps the collectives of sequence parallelism with the products; add --sp and --tp 2 (or more)"
    );
    let kind = args.schedule()?;
    let virtual_stages = args.pp * kind.chunks();
    ensure!(
        LAYERS.is_multiple_of(virtual_stages),
        "{LAYERS} layers do not split over {virtual_stages} virtual pipeline stages; use a --pp (times --chunks when interleaved) that divides {LAYERS}"
    );
    let world_size = args.dp * args.cp * args.tp * args.pp;
    let mesh = Mesh::parse(&format!("dp{},cp{},tp{},pp{}", args.dp, args.cp, args.tp, args.pp), world_size, world_size)?;
    println!(
        "training a {LAYERS}-layer GPT (hidden {DIM}, vocab {VOCAB}) on {world_size} ranks: {mesh}{}, {} schedule",
        if args.sp { " + sequence parallel" } else { "" },
        args.schedule
    );
    let overlapped = run(&args, Sync::Overlapped, &mesh)?;
    for (step, loss) in overlapped.losses.iter().filter(|(s, _)| s % 25 == 0 || *s + 1 == args.steps) {
        println!("step {step:>4}  loss {loss:.4}");
    }
    let per_step = |d: Duration| d.as_secs_f64() * 1e3 / args.steps as f64;
    println!("\n{:>4}  {:<14} {:>11} {:>12} {:>14} {:>14} {:>8}", "rank", "coordinates", "parameters", "peak memory", "dp comm/step", "exposed/step", "bubble");
    for r in &overlapped.reports {
        let bubble = r.waiting.as_secs_f64() / (r.compute + r.waiting).as_secs_f64().max(1e-12);
        println!(
            "{:>4}  {:<14} {:>8.1} kB {:>9.2} MB {:>11.2} ms {:>11.2} ms {:>7.1}%",
            r.rank,
            r.coords,
            r.param_bytes as f64 / 1e3,
            r.peak_bytes as f64 / 1e6,
            per_step(r.dp_comm),
            per_step(r.dp_exposed),
            100.0 * bubble
        );
    }
    let sim = kind.build(args.pp, args.microbatches)?.simulate(&Costs::new(1.0, 2.0))?;
    println!(
        "\n{} with {} stages and {} microbatches: theoretical bubble {:.1}% (equal stage costs); {:.1}s in all",
        args.schedule,
        args.pp,
        args.microbatches,
        100.0 * sim.bubble_fraction(),
        overlapped.elapsed.as_secs_f64()
    );
    if let (Some(first), Some(last)) = (overlapped.losses.first(), overlapped.losses.last()) {
        println!("loss {:.3} -> {:.3}", first.1, last.1);
    }
    if args.compare && args.dp > 1 {
        // The same steps with every bucket sent after the backward: the
        // step time overlap saved, against the communication the overlapped
        // run says ran during the backward (comm − exposed), which is an
        // upper bound: on CPU ranks the collectives share the cores. The
        // kinds alternate, after-then-overlapped, and the fastest run of
        // each is compared, so neither gains from going second.
        let mut overlapped = overlapped;
        let mut after: Option<Run> = None;
        for _ in 0..args.rounds.max(1) {
            let a = run(&args, Sync::After, &mesh)?;
            if after.as_ref().is_none_or(|b| a.step_ms(args.steps) < b.step_ms(args.steps)) {
                after = Some(a);
            }
            let o = run(&args, Sync::Overlapped, &mesh)?;
            if o.step_ms(args.steps) < overlapped.step_ms(args.steps) {
                overlapped = o;
            }
        }
        let after = after.expect("at least one round");
        let mean = |run: &Run, f: fn(&RankReport) -> Duration| per_step(run.reports.iter().map(f).sum::<Duration>()) / run.reports.len() as f64;
        let (with, without) = (overlapped.step_ms(args.steps), after.step_ms(args.steps));
        let saved = without - with;
        let claimed = mean(&overlapped, |r| r.dp_comm) - mean(&overlapped, |r| r.dp_exposed);
        let serial = mean(&after, |r| r.dp_exposed);
        println!(
            "\noverlap: {with:.2} ms/step against {without:.2} ms/step with the buckets sent after the backward, whose communication took {serial:.2} ms/step"
        );
        println!("saved {saved:.2} ms/step; the overlapped run's figures put {claimed:.2} ms/step of communication under the backward (an upper bound)");
        println!(
            "{}",
            serde_json::json!({
                "bench": "dp_overlap",
                "mesh": mesh.to_string(),
                "schedule": args.schedule,
                "overlapped_ms_per_step": with,
                "after_ms_per_step": without,
                "serial_comm_ms_per_step": serial,
                "saved_ms_per_step": saved,
                "hidden_ms_per_step": claimed,
                "saved_over_serial_comm": saved / serial.max(1e-9),
                "hidden_over_comm": claimed / mean(&overlapped, |r| r.dp_comm).max(1e-9),
            })
        );
    }
    Ok(())
}
