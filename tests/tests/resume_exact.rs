//! Everything a run needs is in its checkpoints: a run stopped and resumed
//! at every step, rollbacks and all, or killed in the middle of a save,
//! ends exactly as the run that was never interrupted, line for line and
//! bit for bit.

mod common;
use common::training::*;
use std::path::Path;
use tessera::observe::{read_metrics, Event};
use tessera::train::TrainConfig;

/// Trains `cfg` in one job, and again in one job per step (each resuming
/// the last, `stop_after` one step further); both must agree exactly.
fn stop_and_resume_everywhere(name: &str, text: &str, steps: u64, extra: &[&str], poisoned: std::ops::Range<u64>) -> Vec<Event> {
    stop_and_resume_every(name, text, steps, 1, extra, poisoned)
}

/// [`stop_and_resume_everywhere`], each job `stride` steps further than the last.
fn stop_and_resume_every(name: &str, text: &str, steps: u64, stride: u64, extra: &[&str], poisoned: std::ops::Range<u64>) -> Vec<Event> {
    let (a, b) = (scratch(&format!("{name}-straight")), scratch(&format!("{name}-stepwise")));
    let steps_set = format!("run.steps={steps}");
    let with = |out: &Path, more: &[&str]| -> TrainConfig {
        let mut all = vec![steps_set.as_str()];
        all.extend_from_slice(extra);
        all.extend_from_slice(more);
        config(out, text, &all)
    };
    let straight = train(with(&a, &[]), poisoned.clone());
    for k in (stride..=steps).step_by(stride as usize) {
        let stop = format!("run.stop_after={k}");
        train(with(&b, &[&stop]), poisoned.clone());
    }
    let (want, got) = (trajectory(&a), trajectory(&b));
    assert_eq!(got.len(), want.len(), "{name}: lines {:?} vs {:?}", got.iter().map(|l| l.0).collect::<Vec<_>>(), want.iter().map(|l| l.0).collect::<Vec<_>>());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g, w, "{name}: the first line that differs");
    }
    let last = tessera::ckpt::Checkpointer::open(b.join("checkpoints"), 10).unwrap().latest_valid().unwrap().unwrap();
    let mut resumed = straight.clone();
    resumed.checkpoint = last;
    assert_eq!(final_params(&resumed), final_params(&straight), "{name}: final parameters");
    let events = straight.events.iter().map(|(_, e)| e.clone()).collect();
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
    events
}

#[test]
fn a_run_with_rollbacks_resumed_at_every_step_equals_the_uninterrupted_run() {
    // Draws 44 and 45 (step 23) are scrambled: a loss spike long after the
    // monitor's warm-up, and a rollback to the step-20 checkpoint. A resumed
    // job that forgot the monitor's averages would be back in warm-up and
    // miss it; one that rolled back to the checkpoint its predecessor wrote
    // on stopping (step 22) would take another path.
    let text = "[batch]\nmicro_batch = 8\n[checkpoint]\nevery = 4\nkeep = 2\n[stability]\nspike_factor = 1.5\nwindow = 10\nwarmup = 5\n";
    let events = stop_and_resume_everywhere("rollbacks", text, 26, &["optim.lr=1e-2"], 44..46);
    assert!(events.contains(&Event::Rollback { to_step: 20, skipped_batches: 6 }), "the spike is caught and rolled back: {events:?}");
}

#[test]
fn fp16_data_parallel_training_resumed_at_every_step_equals_the_uninterrupted_run() {
    // The loss scaler's state (scale, good steps, hysteresis) travels too:
    // a scale that starts too high and backs off after two overflows.
    let text = "[mesh]\ndp = 2\n[batch]\nmicro_batch = 2\n[precision]\ncompute = \"fp16\"\ninitial_scale = 1e12\nhysteresis = 2\n[checkpoint]\nevery = 3\n";
    let events = stop_and_resume_everywhere("fp16", text, 10, &[], 0..0);
    assert!(events.iter().any(|e| matches!(e, Event::Overflow { .. })), "the scale backs off: {events:?}");
}

#[test]
fn a_diloco_run_resumed_at_every_meeting_equals_the_uninterrupted_run() {
    // DiLoCo's outer momentum (0.9) travels in the checkpoints: a resumed
    // job that restarted it at zero would take another path from the first
    // meeting after its start. AdamW with β1 = β2 = 0 keeps no history
    // across steps, so the moments of replica 1, which checkpoints do not
    // hold, cannot tell the runs apart.
    let text = "[mesh]\ndp = 2\n[batch]\nmicro_batch = 2\n[local_sgd]\nevery = 2\n[checkpoint]\nevery = 2\n[optim]\nbeta1 = 0.0\nbeta2 = 0.0\nlr = 1e-2\n";
    stop_and_resume_every("diloco", text, 8, 2, &[], 0..0);
}

/// The child half of a test that kills its own process: set, this test
/// binary runs the configuration at `TESSERA_CHILD_RUN` with its faults.
const CHILD: &str = "TESSERA_CHILD_RUN";

#[test]
fn a_kill_during_the_final_save_loses_no_metrics_line() {
    let text = "[batch]\nmicro_batch = 4\n[checkpoint]\nevery = 4\n";
    if let Ok(out) = std::env::var(CHILD) {
        // In the child: the process is killed while the step-8 checkpoint is written.
        train(config(Path::new(&out), text, &["run.steps=8", "faults.kill={rank=0,step=8,at=\"save\",process=true}"]), 0..0);
        unreachable!("the fault kills this process");
    }
    let (a, b) = (scratch("kill-straight"), scratch("kill-resumed"));
    train(config(&a, text, &["run.steps=8"]), 0..0);
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["a_kill_during_the_final_save_loses_no_metrics_line", "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, b.as_os_str())
        .status()
        .unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "the child dies of SIGKILL: {status:?}");
    // The killed job wrote every line, its step-8 checkpoint never completed.
    assert_eq!(read_metrics(b.join("metrics.jsonl")).unwrap().len(), 8);
    assert!(!b.join("checkpoints").join("step-8").exists());
    // The next job resumes from step 4, replays 5 to 8, and the log holds
    // each step once, as the uninterrupted run's does.
    let resumed = train(config(&b, text, &["run.steps=8"]), 0..0);
    assert_eq!(resumed.resumed_from, 4);
    assert_eq!(trajectory(&b), trajectory(&a));
    let lines = read_metrics(b.join("metrics.jsonl")).unwrap();
    assert!(lines[4].events.contains(&Event::Resumed { from_step: 4, dropped_lines: 4 }), "{:?}", lines[4].events);
    assert!(lines[4].events.iter().any(|e| matches!(e, Event::Cleaned { .. })), "the dead job's unfinished save is cleaned: {:?}", lines[4].events);
    let _ = (std::fs::remove_dir_all(&a), std::fs::remove_dir_all(&b));
}
