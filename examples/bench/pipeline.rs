//! `bench pipeline`: ZB-H1 against 1F1B, run for real on CPU pipeline
//! stages (threads, each on a thread pool of its own), with the idle time of
//! every stage traced.
//!
//! A GPT-2 of `stages × layers-per-stage` blocks is cut into stages; the
//! schedules alternate within each round, each running `steps` training
//! steps (forward and backward, no optimizer) from a barrier. A stage's idle
//! time in a step is the step's span (first start to last end over all
//! stages) less the time it computed; the medians over every timed step are
//! compared (shared machines slow single steps down at random).
//! Microbatches are large enough that a forward costs far more than handing
//! an activation to the next stage, the regime the schedules' theory
//! assumes; the simulator's prediction from the measured `F`, `Bx` and `Bw`
//! is printed beside the measurement.

use anyhow::{ensure, Result};
use std::sync::{Arc, Barrier};
use std::time::Instant;
use tessera::dist::inproc::InProcess;
use tessera::module::{self, Act, Cx, Groups};
use tessera::ops;
use tessera::parallel::pipeline::{run_stage, Action, Costs, ScheduleKind, StageReport};
use tessera::prelude::*;
use tessera_models::gpt2::{Gpt2, Gpt2Config};

#[derive(clap::Args)]
pub struct Args {
    /// Pipeline stages (threads).
    #[arg(long, default_value_t = 2)]
    stages: usize,
    /// Microbatches per step (at least the stages).
    #[arg(long, default_value_t = 8)]
    microbatches: usize,
    /// Transformer blocks per stage.
    #[arg(long, default_value_t = 2)]
    layers_per_stage: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 256)]
    dim: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Sequences per microbatch.
    #[arg(long, default_value_t = 2)]
    rows: usize,
    /// Threads each stage computes on.
    #[arg(long, default_value_t = 1)]
    threads_per_stage: usize,
    /// Steps per schedule and round (after one untimed step).
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Rounds; the schedules alternate within each.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

const VOCAB: usize = 512;
const KINDS: [ScheduleKind; 2] = [ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1];

/// One stage's part of one timed step.
struct StageStep {
    start: Instant,
    end: Instant,
    report: StageReport,
}

pub fn run(args: &Args) -> Result<()> {
    ensure!(args.stages >= 2, "--stages must be at least 2: one stage has no bubble");
    ensure!(args.microbatches >= args.stages, "--microbatches must be at least --stages ({}): the schedules' steady state needs them", args.stages);
    ensure!(
        args.rounds > 0 && args.steps > 0 && args.rows > 0 && args.threads_per_stage > 0,
        "--rounds, --steps, --rows and --threads-per-stage must be at least 1"
    );
    let (p, m) = (args.stages, args.microbatches);
    let layers = p * args.layers_per_stage;
    let cfg = Gpt2Config::tiny(VOCAB, args.dim, (args.dim / 64).max(1), layers, args.seq);
    let schedules: Vec<_> = KINDS.iter().map(|k| k.build(p, m)).collect::<tessera::Result<_>>()?;
    println!(
        "pipeline: GPT-2 of {layers} blocks (hidden {}, {} tokens × {} sequences a microbatch) on {p} stages × {} thread(s), {m} microbatches, {} rounds of {} steps",
        args.dim, args.seq, args.rows, args.threads_per_stage, args.rounds, args.steps
    );

    let world = InProcess::new(p)?;
    let barrier = Barrier::new(p);
    // per stage: [round][kind][step]
    let per_stage: Vec<Vec<Vec<Vec<StageStep>>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..p)
            .map(|stage| {
                let (world, barrier, schedules, cfg) = (&world, &barrier, &schedules, &cfg);
                s.spawn(move || -> Result<Vec<Vec<Vec<StageStep>>>> {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(args.threads_per_stage).build()?;
                    pool.install(|| {
                        let dev = Device::cpu();
                        let mut groups = Groups::single();
                        groups.pp = Arc::new(world.communicator(stage, &dev)?);
                        let mut cx = Cx::new(dev.clone()).with_seed(1).with_groups(groups).with_pipeline_chunks(1);
                        let model = module::build(Gpt2::new(cfg)?, &cx)?;
                        let ids = |mb: usize, salt: usize| -> tessera::Result<Tensor> {
                            let v: Vec<u32> = (0..args.rows * args.seq).map(|i| ((mb * 31 + i * 7 + salt) % VOCAB) as u32).collect();
                            Tensor::from_vec(v, [args.rows, args.seq], &dev)
                        };
                        let inputs = (0..m).map(|mb| ids(mb, 1)).collect::<tessera::Result<Vec<_>>>()?;
                        let targets = (0..m).map(|mb| ids(mb, 5)).collect::<tessera::Result<Vec<_>>>()?;
                        let mut step = |schedule| -> Result<StageStep> {
                            barrier.wait();
                            let start = Instant::now();
                            let report = run_stage(&model, &mut cx, schedule, stage, &inputs, |mb, out: &Act<_>| {
                                let (l, saved) = ops::cross_entropy(out.tensor(), &targets[mb], None)?;
                                let d = ops::cross_entropy_backward(out.tensor(), &targets[mb], None, &saved, 1.0 / m as f64)?;
                                Ok((l.to_scalar()?, Act::new(d)))
                            })?;
                            let end = Instant::now();
                            module::visit_params(&model, |e| {
                                e.param.take_grad();
                                Ok(())
                            })?;
                            Ok(StageStep { start, end, report })
                        };
                        for schedule in schedules {
                            step(schedule)?;
                        }
                        let mut rounds = Vec::new();
                        for _ in 0..args.rounds {
                            let mut kinds = Vec::new();
                            for schedule in schedules {
                                kinds.push((0..args.steps).map(|_| step(schedule)).collect::<Result<Vec<_>>>()?);
                            }
                            rounds.push(kinds);
                        }
                        Ok(rounds)
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a stage panicked")).collect::<Result<Vec<_>>>()
    })?;

    // Per kind: every timed step's span and each stage's idle in it.
    let mut idle = vec![vec![Vec::new(); p]; KINDS.len()];
    let mut span = vec![Vec::new(); KINDS.len()];
    let timed = (0..args.rounds).flat_map(|round| (0..KINDS.len()).flat_map(move |k| (0..args.steps).map(move |i| (round, k, i))));
    for (round, k, i) in timed {
        let steps: Vec<&StageStep> = per_stage.iter().map(|stage| &stage[round][k][i]).collect();
        let first = steps.iter().map(|x| x.start).min().expect("stages");
        let last = steps.iter().map(|x| x.end).max().expect("stages");
        let makespan = (last - first).as_secs_f64();
        span[k].push(makespan);
        let idles: Vec<f64> = steps.iter().map(|x| makespan - x.report.compute.as_secs_f64()).collect();
        for (s, t) in idles.iter().enumerate() {
            idle[k][s].push(*t);
        }
        let text: Vec<String> = idles.iter().map(|t| format!("{:.1}", 1e3 * t)).collect();
        println!("pipeline: round {round} {:<6} step {:>7.1} ms, idle per stage [{}] ms", schedules[k].name(), 1e3 * makespan, text.join(", "));
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let idle_ms: Vec<Vec<f64>> = idle.iter().map(|stages| stages.iter().map(|r| 1e3 * median(r)).collect()).collect();
    let step_ms: Vec<f64> = span.iter().map(|r| 1e3 * median(r)).collect();
    let ratios: Vec<f64> = (0..p).map(|s| idle_ms[1][s] / idle_ms[0][s].max(1e-9)).collect();

    // The simulator with the halves' costs measured in the ZB-H1 runs (the
    // slowest stage's mean of each), for the theory's figure beside the measurement.
    let mean_of = |what: fn(&Action) -> bool| -> f64 {
        (0..p)
            .map(|s| {
                let spans: Vec<f64> = per_stage[s]
                    .iter()
                    .flat_map(|round| round[1].iter())
                    .flat_map(|x| x.report.spans.iter())
                    .filter(|sp| what(&sp.action))
                    .map(|sp| (sp.end - sp.start).as_secs_f64())
                    .collect();
                spans.iter().sum::<f64>() / spans.len().max(1) as f64
            })
            .fold(0.0, f64::max)
    };
    let f = mean_of(|a| matches!(a, Action::Forward { .. }));
    let bx = mean_of(|a| matches!(a, Action::BackwardInput { .. }));
    let bw = mean_of(|a| matches!(a, Action::BackwardWeight { .. }));
    let costs = Costs::new(f, bx + bw).with_weight(bw);
    let sim_idle: Vec<f64> = schedules.iter().map(|s| s.simulate(&costs).map(|sim| sim.stages()[0].idle)).collect::<tessera::Result<_>>()?;

    for k in 0..KINDS.len() {
        let idles: Vec<String> = idle_ms[k].iter().map(|t| format!("{t:.1}")).collect();
        println!("pipeline: {:<6} median step {:>7.1} ms, idle per stage [{}] ms", schedules[k].name(), step_ms[k], idles.join(", "));
    }
    println!(
        "pipeline: measured F {:.2} ms, Bx {:.2} ms, Bw {:.2} ms; the simulator gives each stage {:.1} ms idle under 1F1B and {:.1} ms under ZB-H1 ({:.2}x)",
        1e3 * f,
        1e3 * bx,
        1e3 * bw,
        1e3 * sim_idle[0],
        1e3 * sim_idle[1],
        sim_idle[1] / sim_idle[0].max(1e-12)
    );
    let ratio_text: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
    println!("pipeline: ZB-H1 idle / 1F1B idle per stage [{}]; step time ZB-H1 / 1F1B {:.3}", ratio_text.join(", "), step_ms[1] / step_ms[0]);
    println!(
        "{}",
        serde_json::json!({
            "bench": "pipeline",
            "case": "zb-h1 vs 1f1b",
            "stages": p,
            "microbatches": m,
            "idle_ms_1f1b": idle_ms[0],
            "idle_ms_zb_h1": idle_ms[1],
            "idle_ratio_per_stage": ratios,
            "idle_ratio_worst_stage": ratios.iter().copied().fold(0.0, f64::max),
            "step_ms_1f1b": step_ms[0],
            "step_ms_zb_h1": step_ms[1],
            "step_ratio": step_ms[1] / step_ms[0],
            "f_ms": 1e3 * f,
            "bx_ms": 1e3 * bx,
            "bw_ms": 1e3 * bw,
            "sim_idle_ratio": sim_idle[1] / sim_idle[0].max(1e-12),
        })
    );
    Ok(())
}
