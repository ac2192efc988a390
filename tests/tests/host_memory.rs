//! The process's memory follows the accounting: after many steps of a
//! multi-rank bf16 run, the resident memory it gained stays within a small
//! margin of the ranks' accounted peaks. Freed buffers are kept for reuse
//! only up to what the accounting has already seen in use, so a pool of dead
//! buffers cannot grow beside the tensors. (Alone in its binary: the
//! resident memory of the process is the measurement.)

mod common;
use common::models::Gpt;
use common::training::*;
use tessera::module::Cx;
use tessera::observe::read_metrics;
use tessera::train::{Batches, ModelFacts, Trainer};

/// The resident memory of this process, in bytes (Linux).
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[test]
fn resident_memory_stays_near_the_accounted_peaks() {
    let Some(before) = resident_bytes() else {
        eprintln!("skipped: no /proc/self/status to read the resident memory from");
        return;
    };
    let out = scratch("host-memory");
    let (ranks, steps) = (4, 60);
    let cfg = config(
        &out,
        &format!("[mesh]\ndp = {ranks}\n[precision]\ncompute = \"bf16\"\n[batch]\nmicro_batch = 4\ngrad_accum = 1\n"),
        &[&format!("run.steps={steps}"), "batch.seq_len=8", "checkpoint.every=0", "run.trace_steps=0"],
    );
    let facts = ModelFacts { vocab: VOCAB, flops_per_token: 1e5 };
    // Wide enough that activations and gradients are large buffers (the
    // ones a pool keeps), small enough to stay quick.
    Trainer::new(
        cfg,
        facts,
        |_cx: &Cx, _, _| Gpt::new(VOCAB, 256, 4, 2),
        |replica| Ok(Box::new(Counting { replica, micro_batch: 4, drawn: 0, poisoned: 0..0 }) as Box<dyn Batches>),
    )
    .unwrap()
    .run()
    .unwrap();
    let after = resident_bytes().unwrap();
    let metrics = read_metrics(out.join("metrics.jsonl")).unwrap();
    let peaks: u64 = (0..ranks).map(|r| metrics.iter().map(|m| m.peak_memory[r] as u64).max().unwrap_or(0)).sum();
    let gained = after.saturating_sub(before);
    let margin = 256 << 20;
    eprintln!("resident memory gained {} MiB; accounted peaks {} MiB", gained >> 20, peaks >> 20);
    assert!(
        gained <= peaks + margin,
        "the process gained {} MiB of resident memory over {steps} steps, the ranks' accounted peaks sum to {} MiB",
        gained >> 20,
        peaks >> 20
    );
}
