//! Counting the matrix FLOPs the ops run, per thread.
//!
//! Every matrix product and attention op adds the FLOPs its algorithm needs
//! (two per multiply-add, from the operands' shapes, counted when the op is
//! called) to a counter of the calling thread: a rank's forward and backward
//! run on the rank's thread, so the counter holds that rank's work. The
//! planner's cost model predicts the same figure from a model's structure
//! (`Module::describe`), and its tests compare the two.
//!
//! What counts: [`matmul`](super::matmul) and [`matmul_bias`](super::matmul_bias)
//! (`2·m·k·n` per batch), [`matmul_rows_nt`](super::matmul_rows_nt), the
//! quantized products, and attention: `4·d` per (query, visible key) pair
//! and head forward (`QKᵀ` and `PV`), `10·d` backward (the scores
//! recomputed, then four products; the CPU kernel forms some tiles twice
//! for determinism, which is not counted). Element-wise ops count nothing.

use std::cell::Cell;

thread_local! {
    static FLOPS: Cell<f64> = const { Cell::new(0.0) };
}

/// Adds `flops` to this thread's count.
pub(crate) fn add(flops: f64) {
    FLOPS.with(|c| c.set(c.get() + flops));
}

/// The matrix FLOPs this thread's ops have run since it started.
pub fn flops_counted() -> f64 {
    FLOPS.with(Cell::get)
}

/// Query–key pairs a query block of `seq_q` sees of `seq_kv` keys: all of
/// them, or under a causal mask those up to each query's own position
/// (the last query sees all `seq_kv`).
pub(crate) fn attention_pairs(seq_q: usize, seq_kv: usize, causal: bool) -> f64 {
    let (q, kv) = (seq_q as f64, seq_kv as f64);
    if causal {
        q * (kv - q) + q * (q + 1.0) / 2.0
    } else {
        q * kv
    }
}
