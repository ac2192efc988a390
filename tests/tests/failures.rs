//! A run's failures, injected with `[faults]`: every one ends the run on
//! every rank within seconds with the first root cause as its error, or is
//! survived as the stability rules say.

mod common;
use common::training::*;
use std::time::{Duration, Instant};
use tessera::observe::{read_metrics, Event};
use tessera::train::TrainConfig;

/// A dp2 × tp2 run of `steps` steps with `overrides`; collectives give up
/// after 60 s, so a failure that is not propagated shows as a slow test.
fn cfg(out: &std::path::Path, steps: u64, overrides: &[&str]) -> TrainConfig {
    let steps = format!("run.steps={steps}");
    let mut all = vec![steps.as_str(), "mesh.timeout_s=60", "run.trace_steps=0"];
    all.extend_from_slice(overrides);
    config(out, "[mesh]\ndp = 2\ntp = 2\n[batch]\nmicro_batch = 2\n", &all)
}

/// Runs `cfg`, expecting a failure; returns its message and how long it took.
fn fails(cfg: TrainConfig) -> (String, Duration) {
    let started = Instant::now();
    let e = try_train(cfg, false).expect_err("the run fails").to_string();
    (e, started.elapsed())
}

#[test]
fn a_full_disk_during_the_final_save_stops_every_rank_at_once_with_its_cause() {
    // Rank 3 cannot write its part (nor its failure report) of the final
    // checkpoint; then rank 0, which commits, cannot either.
    for rank in [3, 0] {
        let out = scratch(&format!("full-disk-{rank}"));
        let fault = format!("faults.io_error={{rank={rank},step=4}}");
        let (e, took) = fails(cfg(&out, 4, &[&fault]));
        assert!(e.contains("No space left on device") && e.contains("injected"), "rank {rank}: {e}");
        assert!(e.contains("step-4"), "the error names the checkpoint: {e}");
        assert!(took < Duration::from_secs(20), "rank {rank}: took {took:?}");
        // Every step is in the metrics (a line is written before its checkpoint).
        assert_eq!(read_metrics(out.join("metrics.jsonl")).unwrap().len(), 4, "rank {rank}");
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn a_full_disk_during_a_background_save_stops_the_run_without_waiting_for_the_next_save() {
    let out = scratch("full-disk-background");
    // The step-2 save is written in the background while training goes
    // on; the next save (step 8) is far away.
    let (e, took) = fails(cfg(&out, 8, &["checkpoint.every=2", "checkpoint.background=true", "faults.io_error={rank=1,step=2}"]));
    assert!(
        e.contains("No space left on device")
            && e.starts_with("rank 1 failed: writing the checkpoint of step 2: ")
            && e.contains("rank pp0 dp0 ep0 tp1 cannot write its part"),
        "{e}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
    let steps = read_metrics(out.join("metrics.jsonl")).unwrap().len();
    assert!(steps < 8, "the run stopped early, after {steps} steps");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_read_only_checkpoint_directory_is_named_on_every_rank() {
    use std::os::unix::fs::PermissionsExt;
    let out = scratch("read-only");
    let dir = out.join("checkpoints");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::write(dir.join("probe"), b"x").is_ok() {
        eprintln!("skipped: this user (root?) can write a read-only directory");
        let _ = std::fs::remove_dir_all(&out);
        return;
    }
    let (e, took) = fails(cfg(&out, 2, &[]));
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(e.contains("Permission denied") && e.contains("checkpoints"), "{e}");
    assert!(!e.contains("their own errors say why"), "{e}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_killed_rank_is_found_gone_and_named() {
    let out = scratch("kill");
    let (e, took) = fails(cfg(&out, 6, &["faults.kill={rank=1,step=3}"]));
    assert!(e.contains("rank 1: killed as step 3 began"), "{e}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    // Step 1 finished on every rank before rank 1 could start step 3, so its
    // line is there. Step 2's is there unless ranks 2 and 3 were still in
    // their last collective of step 2 (the norm's tensor-parallel sum, which
    // ranks 0 and 1 do without them) when rank 0 found rank 1 gone: then
    // step 2 never finished everywhere, and no line may claim it did.
    let lines: Vec<u64> = read_metrics(out.join("metrics.jsonl")).unwrap().iter().map(|m| m.step).collect();
    assert!(lines == [1, 2] || lines == [1], "the lines of the steps every rank finished, in order: {lines:?}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_hung_rank_is_given_up_on_after_the_timeout_and_named() {
    let out = scratch("hang");
    let (e, took) = fails(cfg(&out, 6, &["faults.hang={rank=2,step=2}", "mesh.timeout_s=1"]));
    // The others time out waiting for rank 2 (or, first in rank order, its own report).
    assert!((e.contains("timed out") && e.contains("[2]")) || e.contains("rank 2: hung as step 2 began"), "{e}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_nan_loss_rolls_back_or_skips_the_step() {
    let out = scratch("nan");
    let text = "[batch]\nmicro_batch = 2\n[checkpoint]\nevery = 2\n";
    let summary = train(config(&out, text, &["run.steps=6", "faults.nan={step=5}"]), 0..0);
    let metrics = read_metrics(out.join("metrics.jsonl")).unwrap();
    let bad = metrics.iter().find(|m| m.events.iter().any(|e| matches!(e, Event::Anomaly { detail } if detail.contains("non-finite")))).expect("flagged");
    assert_eq!(bad.step, 5);
    assert!(bad.skipped && bad.loss.is_nan());
    assert!(bad.events.iter().any(|e| matches!(e, Event::Rollback { to_step: 4, .. })), "{:?}", bad.events);
    assert!(summary.losses.iter().filter(|(s, _)| *s == 6).all(|(_, l)| l.is_finite()));
    assert_eq!(metrics.last().unwrap().step, 6);

    // Without rollback the step is only skipped.
    let out2 = scratch("nan-skip");
    train(config(&out2, text, &["run.steps=6", "faults.nan={step=5}", "stability.rollback=false"]), 0..0);
    let metrics = read_metrics(out2.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.iter().map(|m| (m.step, m.skipped)).collect::<Vec<_>>(), vec![(1, false), (2, false), (3, false), (4, false), (5, true), (6, false)]);
    let _ = (std::fs::remove_dir_all(&out), std::fs::remove_dir_all(&out2));
}

#[test]
fn a_slow_rank_slows_the_run_and_changes_nothing_else() {
    let (a, b) = (scratch("fast"), scratch("slow"));
    let fast = train(cfg(&a, 3, &[]), 0..0);
    let slow = train(cfg(&b, 3, &["faults.slow={rank=3,ms=40}"]), 0..0);
    assert_eq!(fast.losses, slow.losses);
    let metrics = read_metrics(b.join("metrics.jsonl")).unwrap();
    assert!(metrics.iter().all(|m| m.step_time_s >= 0.04), "{:?}", metrics.iter().map(|m| m.step_time_s).collect::<Vec<_>>());
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}
