//! Trains a small GPT on in-process CPU ranks with a hybrid mesh
//! (data × tensor × pipeline parallelism) and reports, per rank, memory,
//! communication time and the pipeline bubble.
//!
//! Run: `cargo run --release --example parallel -- --dp 2 --tp 2 --pp 2`

use anyhow::{ensure, Result};
use clap::Parser;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tessera::dist::inproc::{mesh_groups, InProcess};
use tessera::dist::mesh::{Axis, Mesh};
use tessera::module::{self, Groups, Param};
use tessera::nn::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward, CausalAttention, Embedding, LayerNorm, Linear, Stack};
use tessera::ops;
use tessera::optim::{AdamW, AdamWConfig};
use tessera::parallel::pipeline::{run_stage, sync_tied_grads, Costs, ScheduleKind};
use tessera::prelude::*;

#[derive(Parser, Clone, Copy)]
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
    /// Sequence parallelism on the tensor-parallel group.
    #[arg(long)]
    sp: bool,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Microbatches per replica and step (one sequence each).
    #[arg(long, default_value_t = 4)]
    microbatches: usize,
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
    dp_comm: Duration,
    compute: Duration,
    waiting: Duration,
}

fn run_rank(args: Args, world: &InProcess, mesh: &Mesh, rank: usize, log: &Mutex<Vec<(usize, f64)>>) -> Result<RankReport> {
    let dev = Device::cpu();
    let c = mesh.coords(rank)?;
    let (d, t, stage) = (c[Axis::Dp], c[Axis::Tp], c[Axis::Pp]);
    let groups: Groups = mesh_groups(world, mesh, rank, &dev)?;
    let (tp, dp) = (groups.tp.clone(), groups.dp.clone());
    let mut cx = Cx::new(dev.clone()).with_seed(1).with_groups(groups).with_sequence_parallel(args.sp);
    let model = module::build(gpt()?, &cx)?;
    let mut opt = AdamW::new(&model, AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() })?;
    let schedule = ScheduleKind::OneFOneB.build(args.pp, args.microbatches)?;
    let mut params: Vec<Param> = Vec::new();
    module::visit_params(&model, |e| {
        if !params.iter().any(|p| p.same(e.param)) {
            params.push(e.param.clone());
        }
        Ok(())
    })?;
    let (mut dp_comm, mut compute, mut waiting) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for step in 0..args.steps {
        let seqs: Vec<_> = (0..args.microbatches).map(|i| sequence(step, d * args.microbatches + i)).collect();
        let inputs: Vec<Tensor> = seqs.iter().map(|(x, _)| Tensor::from_vec(x.clone(), [1, SEQ], &dev)).collect::<tessera::Result<_>>()?;
        let targets: Vec<Tensor> = seqs.iter().map(|(_, y)| Tensor::from_vec(y.clone(), [1, SEQ], &dev)).collect::<tessera::Result<_>>()?;
        let m = args.microbatches as f64;
        let report = run_stage(&model, &mut cx, &schedule, stage, &inputs, |mb, out| {
            let (l, saved) = vocab_parallel_cross_entropy(&*tp, out, &targets[mb], VOCAB, None)?;
            let dl = vocab_parallel_cross_entropy_backward(out, &targets[mb], VOCAB, None, &saved, 1.0 / m)?;
            Ok((l.to_scalar()?, dl))
        })?;
        compute += report.compute;
        waiting += report.waiting;
        sync_tied_grads(&model, &cx)?;
        let started = Instant::now();
        for p in &params {
            if let Some(g) = p.grad() {
                p.set_grad(ops::scale(&dp.all_reduce_sum(&g)?, 1.0 / args.dp as f64)?)?;
            }
        }
        dp_comm += started.elapsed();
        let lr = 3e-3 * (1.0 - step as f64 / args.steps as f64).max(0.1);
        opt.step(lr)?;
        opt.zero_grad();
        if stage == args.pp - 1 {
            let local = report.losses.iter().map(|(_, l)| l).sum::<f64>() / m;
            let mean = dp.all_reduce_sum(&Tensor::from_vec(vec![local], [1], &dev)?)?.to_scalar()? / args.dp as f64;
            if d == 0 && t == 0 {
                log.lock().expect("log").push((step, mean));
            }
        }
    }
    Ok(RankReport { rank, coords: format!("dp{d} tp{t} pp{stage}"), peak_bytes: dev.memory_stats().peak, dp_comm, compute, waiting })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let world_size = args.dp * args.tp * args.pp;
    ensure!(args.dp > 0 && args.tp > 0 && args.pp > 0, "--dp, --tp and --pp must each be at least 1");
    ensure!(LAYERS.is_multiple_of(args.pp), "{LAYERS} layers do not split over {} pipeline stages; use a --pp that divides {LAYERS}", args.pp);
    let mesh = Mesh::parse(&format!("dp{},tp{},pp{}", args.dp, args.tp, args.pp), world_size, world_size)?;
    let world = InProcess::new(world_size)?;
    println!("training a {LAYERS}-layer GPT (hidden {DIM}, vocab {VOCAB}) on {world_size} ranks: {mesh}{}", if args.sp { " + sequence parallel" } else { "" });
    let log = Mutex::new(Vec::new());
    let started = Instant::now();
    let reports: Vec<Result<RankReport>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (world, mesh, log) = (&world, &mesh, &log);
                s.spawn(move || {
                    let r = run_rank(args, world, mesh, rank, log);
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
    for (step, loss) in losses.iter().filter(|(s, _)| s % 25 == 0 || *s + 1 == args.steps) {
        println!("step {step:>4}  loss {loss:.4}");
    }
    println!("\n{:>4}  {:<14} {:>12} {:>12} {:>10}", "rank", "coordinates", "peak memory", "dp comm", "bubble");
    let mut reports = reports.into_iter().collect::<Result<Vec<_>>>()?;
    reports.sort_by_key(|r| r.rank);
    for r in &reports {
        let bubble = r.waiting.as_secs_f64() / (r.compute + r.waiting).as_secs_f64().max(1e-12);
        println!("{:>4}  {:<14} {:>9.2} MB {:>9.1} ms {:>9.1}%", r.rank, r.coords, r.peak_bytes as f64 / 1e6, r.dp_comm.as_secs_f64() * 1e3, 100.0 * bubble);
    }
    let sim = ScheduleKind::OneFOneB.build(args.pp, args.microbatches)?.simulate(&Costs::new(1.0, 2.0))?;
    println!(
        "\n1F1B with {} stages and {} microbatches: theoretical bubble {:.1}% (equal stage costs); {:.1}s in all",
        args.pp,
        args.microbatches,
        100.0 * sim.bubble_fraction(),
        elapsed.as_secs_f64()
    );
    if let (Some(first), Some(last)) = (losses.first(), losses.last()) {
        println!("loss {:.3} -> {:.3}", first.1, last.1);
    }
    Ok(())
}
