//! The planner held against this machine: `tessera profile` measures it,
//! then ten layouts of a small GPT-2 on two CPU ranks are trained with
//! `tessera train` and estimated with `tessera plan --evaluate`. Each
//! estimate must be within 25 % of the measured step time and 5 % of the
//! measured peak memory of the fullest rank; and the plan the search ranks
//! first of every layout two ranks can take (`tessera plan`) must train
//! within 10 % of the fastest layout measured, each judged by its fastest
//! step over as many runs.
//!
//! Two ranks, because two is what every machine this runs on can give each
//! rank its own core: ranks that timeshare cores lose throughput to each
//! other that no per-rank profile captures (docs/planner.md). Alone in its
//! test binary, so no other test competes for the cores while it times.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use tessera::testing::Scratch;

/// GPT-2 of 4 blocks of width 256 on the bundled task: 16 sequences of
/// 104 tokens per step, whatever the layout.
const MODEL: &str = "[run]\nsteps = 6\nseed = 1\nprogress = false\n\n[model]\nkind = \"gpt2\"\nn_layer = 4\nn_embd = 256\nn_head = 4\n\n\
[batch]\nmicro_batch = 8\nseq_len = 104\ngrad_accum = 2\n\n[optim]\nlr = 1e-3\n\n[checkpoint]\nevery = 1000\nkeep = 1\n\n[data]\nsource = \"bundled\"\nseed = 7\n";

/// The layouts measured: every parallelism two ranks can take, with and
/// without accumulation, ZeRO stages, recompute and pipeline schedules.
const LAYOUTS: &[(&str, &[&str])] = &[
    ("dp2", &["mesh.dp=2", "batch.micro_batch=4"]),
    ("dp2, one micro-batch", &["mesh.dp=2", "batch.grad_accum=1"]),
    ("dp2, micro-batches of 2", &["mesh.dp=2", "batch.micro_batch=2", "batch.grad_accum=4"]),
    ("dp2, ZeRO-1", &["mesh.dp=2", "batch.micro_batch=4", "zero.stage=1"]),
    ("dp2, ZeRO-3", &["mesh.dp=2", "batch.micro_batch=4", "zero.stage=3"]),
    ("tp2", &["mesh.tp=2"]),
    ("tp2, sp", &["mesh.tp=2", "mesh.sp=true"]),
    ("tp2, full recompute", &["mesh.tp=2", "recompute.mode=full"]),
    ("pp2, 1F1B", &["mesh.pp=2"]),
    ("pp2, GPipe, 4 micro-batches", &["mesh.pp=2", "mesh.schedule=gpipe", "batch.micro_batch=4", "batch.grad_accum=4"]),
];

fn tessera(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).env("RUST_BACKTRACE", "0").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "tessera {args:?} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

fn sets(layout: &[&str]) -> Vec<String> {
    layout.iter().flat_map(|s| ["--set".to_string(), s.to_string()]).collect()
}

/// A layout's timings: the median and the fastest of its steps after the
/// first, and the largest peak memory of any rank.
struct Measured {
    median: f64,
    fastest: f64,
    peak: f64,
}

/// Trains `config` with `layout` and measures it.
fn measure(dir: &Path, name: &str, config: &Path, layout: &[&str]) -> Measured {
    // A run directory of its own for every run (one that exists would resume).
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let out = dir.join(format!("{}-{}", name.replace([' ', ',', '-'], "_"), RUNS.fetch_add(1, Ordering::Relaxed)));
    let mut args = vec![
        "train".to_string(),
        "--config".into(),
        config.to_str().unwrap().into(),
        "--out".into(),
        out.to_str().unwrap().into(),
        "--eval".into(),
        "0".into(),
    ];
    args.extend(sets(layout));
    tessera(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(lines.len() >= 4, "{name}: {} steps logged", lines.len());
    let mut steps: Vec<f64> = lines[1..].iter().map(|l| l["step_time_s"].as_f64().unwrap()).collect();
    steps.sort_by(f64::total_cmp);
    let peak = lines.last().unwrap()["peak_memory"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).fold(0.0, f64::max);
    Measured { median: steps[steps.len() / 2], fastest: steps[0], peak }
}

/// `tessera plan --evaluate`'s step time and memory of `layout`.
fn predict(config: &Path, profile: &Path, layout: &[&str]) -> (f64, f64) {
    let mut args =
        vec!["plan".to_string(), "--model".into(), config.to_str().unwrap().into(), "--cluster".into(), profile.to_str().unwrap().into(), "--evaluate".into()];
    args.extend(sets(layout));
    let line: serde_json::Value = serde_json::from_str(&tessera(&args.iter().map(String::as_str).collect::<Vec<_>>())).unwrap();
    (line["step_s"].as_f64().unwrap(), line["memory_bytes"].as_f64().unwrap())
}

#[test]
fn the_planner_predicts_the_layouts_it_is_measured_on_and_its_first_plan_trains_within_10_percent_of_the_fastest() {
    let dir = Scratch::new("plan-accuracy");
    let config = dir.path().join("gpt2.toml");
    std::fs::write(&config, MODEL).unwrap();
    let profile = dir.path().join("cpu2.toml");

    // A machine shared with other work slows a profile or a run now and
    // then, by more than the bounds allow; a layout outside them is tried
    // again (with a new profile) up to twice. A model that is wrong misses
    // every time.
    let mut report = String::new();
    let mut measured = Vec::new();
    let mut left: Vec<usize> = (0..LAYOUTS.len()).collect();
    for attempt in 0..3 {
        if left.is_empty() {
            break;
        }
        tessera(&["profile", "--ranks", "2", "--seconds-per-figure", "0.1", "--out", profile.to_str().unwrap()]);
        report += &format!("attempt {attempt}:\n");
        left.retain(|&i| {
            let (name, layout) = LAYOUTS[i];
            let Measured { median: step, fastest, peak } = measure(dir.path(), name, &config, layout);
            let (p_step, p_peak) = predict(&config, &profile, layout);
            let (t, m) = (p_step / step, p_peak / peak);
            report += &format!("{name:30} step {step:.4} s, predicted {t:.2}×; peak {:.2} MB, predicted {m:.3}×\n", peak / 1e6);
            measured.push((name, layout, fastest));
            !((0.75..=1.25).contains(&t) && (0.95..=1.05).contains(&m))
        });
    }
    eprint!("{report}");
    let misses: Vec<&str> = left.iter().map(|&i| LAYOUTS[i].0).collect();
    assert!(misses.is_empty(), "outside 25 % of the step time or 5 % of the peak memory three times: {misses:?}\n{report}");

    // The plan the whole search ranks first (`tessera plan` over every
    // layout two ranks can take, on the last profile), trained, against the
    // fastest layout measured. Steps on a shared machine move by tens of per
    // cent within one run (others' work only ever slows a step), so a
    // median of five swings by more than the 10 % asked: each side is judged
    // by its fastest step of as many runs, which converges on the time the
    // layout takes when nothing else interferes. The sweep's own figure of
    // the fastest layout is not one of them: picked as the least of ten
    // layouts' noisy figures, it is biased low by the picking (a layout
    // that measured 0.5759 s at the median was "fastest" at 0.5444 s once).
    // Both are timed afresh instead, three times each, in turn.
    let top = dir.path().join("top.toml");
    let table = tessera(&["plan", "--model", config.to_str().unwrap(), "--cluster", profile.to_str().unwrap(), "--top", "3", "--out", top.to_str().unwrap()]);
    report += &format!("the search's best plans:\n{table}");
    let (fastest_name, fastest_layout, _) = *measured.iter().min_by(|a, b| a.2.total_cmp(&b.2)).unwrap();
    let (mut first, mut fastest) = (f64::INFINITY, f64::INFINITY);
    for again in 0..3 {
        first = first.min(measure(dir.path(), &format!("ranked first {again}"), &top, &[]).fastest);
        fastest = fastest.min(measure(dir.path(), &format!("{fastest_name} {again}"), &config, fastest_layout).fastest);
    }
    let fastest = fastest.min(first);
    eprintln!("{}\nranked first: fastest step {first:.4} s; fastest layout measured ({fastest_name}): {fastest:.4} s", table.lines().nth(3).unwrap_or(""));
    assert!(first <= 1.10 * fastest, "the plan ranked first's fastest step takes {first:.4} s, over 10 % more than {fastest_name}'s {fastest:.4} s\n{report}");
}
