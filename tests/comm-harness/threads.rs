//! Ranks as threads of the test process.

use std::thread;

/// Runs `f(rank)` for every rank of `n`, each on its own thread, and returns
/// the results in rank order; a rank that panics fails the caller.
pub fn on_threads<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..n).map(|r| s.spawn(move || f(r))).collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}
