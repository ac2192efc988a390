//! Training with ranks as processes, run as a user runs it:
//! `tessera launch --nproc-per-node N -- tessera train CONFIG`.
//!
//! - the processes give the thread run's losses and gradient norms, bit for
//!   bit, on a 3-D mesh;
//! - a rank that is killed or hangs stops every rank, which names it, and
//!   the launcher exits non-zero, within the configured timeout;
//! - with `--max-restarts`, rank processes killed at three random moments
//!   (mid-step, mid-checkpoint, whenever) restart the job from its last
//!   complete checkpoint, and the run ends with the uninterrupted run's
//!   losses.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use tessera::testing::Scratch;

fn tessera() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tessera"));
    c.env("RUST_BACKTRACE", "0");
    c
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

/// A training configuration of `steps` steps into `out`, a small GPT-2 on
/// the bundled task, with `extra` TOML lines appended.
fn config(dir: &Path, out: &Path, mesh: &str, steps: u64, extra: &str) -> PathBuf {
    let text = format!(
        "[run]\nsteps = {steps}\nout = {out:?}\nprogress = false\ntrace_steps = 0\n\n[model]\nkind = \"gpt2\"\nn_layer = 2\nn_embd = 32\nn_head = 4\n\n[mesh]\n{mesh}\n\n[batch]\nmicro_batch = 2\nseq_len = 26\ngrad_accum = 2\n\n[optim]\nlr = 1e-2\nwarmup = 1\nclip = 1.0\n\n[checkpoint]\nevery = 1\nkeep = 2\n\n[data]\nsource = \"bundled\"\nseed = 7\n{extra}",
        out = out.display().to_string(),
    );
    let path = dir.join(format!("{}.toml", out.file_name().unwrap().to_string_lossy()));
    std::fs::write(&path, text).unwrap();
    path
}

/// `(step, loss bits, gradient-norm bits)` of every line of a run's metrics.
fn metrics(run: &Path) -> Vec<(u64, u64, u64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap().to_bits(), v["grad_norm"].as_f64().unwrap_or(f64::NAN).to_bits())
        })
        .collect()
}

fn train_threads(cfg: &Path) -> Output {
    let out = tessera().args(["train", "--config", cfg.to_str().unwrap(), "--eval", "0"]).output().unwrap();
    assert!(out.status.success(), "the thread run failed:\n{}\n{}", text(&out.stdout), text(&out.stderr));
    out
}

fn launch(n: usize, extra: &[&str], cfg: &Path) -> Command {
    let mut c = tessera();
    c.args(["launch", "--nproc-per-node", &n.to_string()]).args(extra).args([
        "--",
        env!("CARGO_BIN_EXE_tessera"),
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--eval",
        "0",
    ]);
    c
}

const MESH: &str = "dp = 2\ntp = 2\npp = 2";

#[test]
fn processes_train_like_threads_bit_for_bit() {
    let dir = Scratch::new("processes-bits");
    let threads = dir.path().join("threads");
    let procs = dir.path().join("procs");
    let traced = |run: &Path| {
        let cfg = config(dir.path(), run, MESH, 6, "");
        std::fs::write(&cfg, std::fs::read_to_string(&cfg).unwrap().replace("trace_steps = 0", "trace_steps = 2")).unwrap();
        cfg
    };
    train_threads(&traced(&threads));
    let out = launch(8, &[], &traced(&procs)).output().unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "the launched run failed:\n{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("[rank 0] training gpt2") && stdout.contains("one process each"), "{stdout}");
    assert!(!stdout.contains("[rank 1] training"), "only rank 0 reports:\n{stdout}");
    let (want, got) = (metrics(&threads), metrics(&procs));
    assert_eq!(want.len(), 6);
    assert_eq!(got, want, "losses and gradient norms, bit for bit");
    // One trace, with every rank's track, as the thread run writes it.
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(procs.join("trace.json")).unwrap()).unwrap();
    let mut tracks: Vec<u64> = trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "X").map(|e| e["tid"].as_u64().unwrap()).collect();
    tracks.sort_unstable();
    tracks.dedup();
    assert_eq!(tracks, (0..8).collect::<Vec<u64>>(), "spans of every rank in trace.json");
}

/// Runs the launched job to its end; returns its output and how long it took.
fn run_to_failure(cmd: &mut Command, limit: Duration) -> (Output, Duration) {
    let started = Instant::now();
    let out = cmd.output().unwrap();
    let took = started.elapsed();
    assert!(!out.status.success(), "the job should fail:\n{}", text(&out.stdout));
    assert!(took < limit, "the job took {took:?} to stop");
    (out, took)
}

#[test]
fn a_killed_or_hung_rank_stops_every_rank_which_names_it() {
    let dir = Scratch::new("processes-failures");
    // SIGKILL of rank 5's process as step 3 begins.
    let run = dir.path().join("killed");
    let cfg = config(dir.path(), &run, MESH, 50, "\n[faults]\nkill = { rank = 5, step = 3, process = true }\n");
    let (out, _) = run_to_failure(&mut launch(8, &["--grace-period", "5"], &cfg), Duration::from_secs(60));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("rank 5") && stderr.contains("SIGKILL"), "the launcher names the killed rank and how:\n{stderr}");
    let naming = stderr.lines().filter(|l| l.contains("rank 5 failed") || l.contains("rank 5,")).count();
    assert!(naming >= 1, "the other ranks' errors name rank 5:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    // Rank 2 hangs before step 3: its peers give up after mesh.timeout_s.
    let run = dir.path().join("hung");
    let cfg = config(dir.path(), &run, MESH, 50, "\n[faults]\nhang = { rank = 2, step = 3 }\n");
    let text_cfg = std::fs::read_to_string(&cfg).unwrap().replace("[mesh]\n", "[mesh]\ntimeout_s = 2\n");
    std::fs::write(&cfg, text_cfg).unwrap();
    let (out, took) = run_to_failure(&mut launch(8, &["--grace-period", "2"], &cfg), Duration::from_secs(60));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("rank 2"), "the ranks name the hung rank:\n{stderr}");
    assert!(took > Duration::from_secs(2), "stopped after {took:?}, before the timeout");
}

/// The launcher's children: the rank processes of its current attempt.
fn children(parent: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // The fields after the command name, which ends with the last ')'.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else { continue };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.get(1).and_then(|p| p.parse::<u32>().ok()) == Some(parent) && fields[0] != "Z" {
            pids.push(pid);
        }
    }
    pids
}

fn wait_for(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let started = Instant::now();
    while !ready() {
        assert!(started.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn restarts_resume_from_the_last_checkpoint_and_end_with_the_uninterrupted_losses() {
    let dir = Scratch::new("processes-restarts");
    const STEPS: u64 = 16;
    // Every step takes at least 120 ms, so that kills land mid-run.
    let slow = "\n[faults]\nslow = { rank = 0, ms = 120 }\n";
    let reference = dir.path().join("reference");
    train_threads(&config(dir.path(), &reference, "dp = 2\ntp = 2", STEPS, slow));
    let run = dir.path().join("restarted");
    let cfg = config(dir.path(), &run, "dp = 2\ntp = 2", STEPS, slow);
    let job: Child = launch(4, &["--max-restarts", "3", "--grace-period", "2"], &cfg).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let launcher = job.id();
    // Three kills, at progress points and of ranks drawn from a fixed seed.
    let mut seed = 0x5DEE_CE66u64;
    let mut draw = |n: u64| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) % n
    };
    for kill in 0..3 {
        let at = 2 + 4 * kill + draw(3);
        wait_for(&format!("step {at}"), Duration::from_secs(120), || metrics(&run).last().is_some_and(|m| m.0 >= at));
        let ranks = children(launcher);
        assert_eq!(ranks.len(), 4, "four rank processes run");
        let victim = ranks[draw(4) as usize];
        // Somewhere inside the step (or its checkpoint).
        std::thread::sleep(Duration::from_millis(draw(120)));
        kill_process(victim);
        // The launcher stops the others and starts four new processes.
        wait_for("the restart", Duration::from_secs(60), || {
            let now = children(launcher);
            now.len() == 4 && !now.contains(&victim) && now.iter().all(|p| !ranks.contains(p))
        });
    }
    let out = job.wait_with_output().unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "the job ends well after three restarts:\n{stdout}\n{stderr}");
    assert_eq!(stderr.matches("restart").count().min(3), 3, "three restarts:\n{stderr}");
    assert!(stdout.contains("resumed from the checkpoint of step"), "{stdout}");
    let (want, got) = (metrics(&reference), metrics(&run));
    assert_eq!(want.len() as u64, STEPS);
    assert_eq!(got, want, "the restarted run's losses and gradient norms are the uninterrupted run's, bit for bit");
}

/// Sends SIGKILL to `pid`, as the kernel's OOM killer or a lost node would.
fn kill_process(pid: u32) {
    let status = Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap();
    assert!(status.success());
}

/// Two "nodes" on one machine: two launchers of four ranks each form one
/// job of eight through the master's address, and give the single-process
/// run's losses.
#[test]
fn two_launchers_as_two_nodes_train_like_one_process() {
    let dir = Scratch::new("processes-two-nodes");
    let threads = dir.path().join("threads");
    let nodes = dir.path().join("nodes");
    train_threads(&config(dir.path(), &threads, MESH, 4, ""));
    let cfg = config(dir.path(), &nodes, MESH, 4, "");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let node = |rank: &str| {
        launch(4, &["--nnodes", "2", "--node-rank", rank, "--master-addr", "127.0.0.1", "--master-port", &port], &cfg)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // The second node may start first: its ranks wait for the master.
    let second = node("1");
    std::thread::sleep(Duration::from_millis(300));
    let first = node("0");
    for (name, child) in [("node 0", first), ("node 1", second)] {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{name} failed:\n{}\n{}", text(&out.stdout), text(&out.stderr));
        if name == "node 1" {
            assert!(text(&out.stderr).contains("starting ranks 4..=7 of 8"), "{}", text(&out.stderr));
        }
    }
    assert_eq!(metrics(&nodes), metrics(&threads), "losses and gradient norms, bit for bit");
}

/// An elastic job of two nodes of two ranks loses a node (its launcher is
/// killed, and its ranks with it): the other node's launcher goes on alone,
/// and its two ranks run the dp4 mesh as dp2 with twice the gradient
/// accumulation, resuming from the last complete checkpoint. Its losses are
/// those of a two-rank run resumed from that same checkpoint.
#[test]
fn an_elastic_job_that_loses_a_node_goes_on_with_the_rest() {
    let dir = Scratch::new("processes-elastic");
    const STEPS: u64 = 12;
    let extra = "\n[faults]\nslow = { rank = 0, ms = 100 }\n";
    let run = dir.path().join("elastic");
    let cfg = config(dir.path(), &run, "dp = 4\nelastic = true", STEPS, extra);
    let text_cfg = std::fs::read_to_string(&cfg).unwrap().replace("keep = 2", "keep = 100");
    std::fs::write(&cfg, text_cfg).unwrap();
    let port = {
        // Two free ports in a row: the launchers' and the ranks'.
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port().min(60000).to_string()
    };
    let node = |rank: &str| {
        launch(
            2,
            &[
                "--nnodes",
                "2",
                "--min-nodes",
                "1",
                "--node-rank",
                rank,
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port,
                "--last-call",
                "1",
                "--max-restarts",
                "1",
                "--grace-period",
                "2",
            ],
            &cfg,
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
    };
    let first = node("0");
    let mut second = node("1");
    wait_for("step 4", Duration::from_secs(120), || metrics(&run).last().is_some_and(|m| m.0 >= 4));
    // Node 1 is lost: its launcher dies, and its ranks with it.
    kill_process(second.id());
    let _ = second.wait();
    let out = first.wait_with_output().unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "node 0 goes on alone:\n{stdout}\n{stderr}");
    assert!(stderr.contains("attempt 1: 1 of 2 nodes"), "{stderr}");
    assert!(stdout.contains("elastic: 2 processes run the mesh with dp2 and 4 microbatches per step"), "{stdout}");
    let resumed: u64 = stdout
        .split("resumed from the checkpoint of step ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("the job resumed:\n{stdout}"));
    // The reference: two ranks (as threads) resumed from a copy of that checkpoint.
    let reference = dir.path().join("reference");
    let from = run.join("checkpoints").join(format!("step-{resumed}"));
    let to = reference.join("checkpoints").join(format!("step-{resumed}"));
    copy_dir(&from, &to);
    let ref_cfg = config(dir.path(), &reference, "dp = 2", STEPS, extra);
    let ref_text = std::fs::read_to_string(&ref_cfg).unwrap().replace("grad_accum = 2", "grad_accum = 4").replace("keep = 2", "keep = 100");
    std::fs::write(&ref_cfg, ref_text).unwrap();
    train_threads(&ref_cfg);
    let after = |m: Vec<(u64, u64, u64)>| m.into_iter().filter(|l| l.0 > resumed).collect::<Vec<_>>();
    let (want, got) = (after(metrics(&reference)), after(metrics(&run)));
    assert_eq!(want.len() as u64, STEPS - resumed);
    assert_eq!(got, want, "the elastic job's losses after step {resumed} are a two-rank run's from the same checkpoint");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let path = e.path();
        if path.is_dir() {
            copy_dir(&path, &to.join(e.file_name()));
        } else {
            std::fs::copy(&path, to.join(e.file_name())).unwrap();
        }
    }
}
