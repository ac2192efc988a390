//! Token embedding lookup and its scatter-add backward, vocab-parallel aware.
//!
//! A rank holds the table rows of vocabulary ids `[vocab_start, vocab_start +
//! rows)`. Ids outside that range look up a zero row, so summing the outputs of
//! all ranks of a vocab-parallel group yields the unsharded lookup, and each
//! rank's backward only touches the rows it owns.
//!
//! The backward has to add many token gradients into the same table row when
//! ids repeat. Rather than racing on rows, it groups token positions by row
//! with a stable counting sort; each table row is then owned by one task that
//! adds its tokens in token order, so the result is bit-identical whatever the
//! number of threads.

use crate::Real;
use rayon::prelude::*;

/// Below this many output elements the work stays on the calling thread.
const PAR_MIN_ELEMS: usize = 32 * 1024;
/// Rough number of elements one parallel task should cover.
const TASK_ELEMS: usize = 16 * 1024;

/// The local table row of `id`, or `None` when another rank owns it.
#[inline]
fn local_row(id: u32, vocab_start: u32, rows: usize) -> Option<usize> {
    let r = id.checked_sub(vocab_start)? as usize;
    (r < rows).then_some(r)
}

/// Embedding lookup: `out[i, :] = table[ids[i] − vocab_start, :]`, or zeros
/// when `ids[i]` is outside this rank's slice `[vocab_start, vocab_start + rows)`.
///
/// `table`: `rows × dim`; `ids`: `n`; `out`: `n × dim` (overwritten).
pub fn embedding_forward<T: Real>(table: &[T], rows: usize, dim: usize, vocab_start: u32, ids: &[u32], out: &mut [T]) {
    assert!(dim > 0, "embedding dim must be positive");
    assert_eq!(table.len(), rows * dim, "table length");
    assert_eq!(out.len(), ids.len() * dim, "out length");
    let one = |(o, &id): (&mut [T], &u32)| match local_row(id, vocab_start, rows) {
        Some(r) => o.copy_from_slice(&table[r * dim..(r + 1) * dim]),
        None => o.fill(T::zero()),
    };
    if out.len() < PAR_MIN_ELEMS {
        out.chunks_mut(dim).zip(ids).for_each(one);
    } else {
        out.par_chunks_mut(dim).zip(ids.par_iter()).with_min_len((TASK_ELEMS / dim).max(1)).for_each(one);
    }
}

/// Scatter-add: `dtable[id − vocab_start] += dout[i]` for every in-range id.
/// ACCUMULATES into dtable (the caller zeroes it). Deterministic and
/// thread-count independent even when ids repeat: each table row receives its
/// tokens' gradients in token order.
///
/// `ids`: `n`; `dout`: `n × dim`; `dtable`: `rows × dim`. Ids outside
/// `[vocab_start, vocab_start + rows)` are skipped (another rank owns them).
pub fn embedding_backward<T: Real>(ids: &[u32], dout: &[T], rows: usize, dim: usize, vocab_start: u32, dtable: &mut [T]) {
    assert!(dim > 0, "embedding dim must be positive");
    assert_eq!(dout.len(), ids.len() * dim, "dout length");
    assert_eq!(dtable.len(), rows * dim, "dtable length");

    // Stable counting sort of token positions by local row (CSR layout):
    // tokens of row r are order[start[r]..start[r + 1]], in increasing position.
    let mut start = vec![0usize; rows + 1];
    for &id in ids {
        if let Some(r) = local_row(id, vocab_start, rows) {
            start[r + 1] += 1;
        }
    }
    for r in 0..rows {
        start[r + 1] += start[r];
    }
    if start[rows] == 0 {
        return;
    }
    let mut next = start[..rows].to_vec();
    let mut order = vec![0usize; start[rows]];
    for (i, &id) in ids.iter().enumerate() {
        if let Some(r) = local_row(id, vocab_start, rows) {
            order[next[r]] = i;
            next[r] += 1;
        }
    }

    let add_row = |(r, drow): (usize, &mut [T])| {
        for &i in &order[start[r]..start[r + 1]] {
            for (d, &g) in drow.iter_mut().zip(&dout[i * dim..(i + 1) * dim]) {
                *d += g;
            }
        }
    };
    if dout.len() < PAR_MIN_ELEMS {
        dtable.chunks_mut(dim).enumerate().for_each(add_row);
    } else {
        // Most rows of a large vocabulary receive no token: let tasks span many rows.
        dtable.par_chunks_mut(dim).enumerate().with_min_len(64).for_each(add_row);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, dot, numeric_grad, rand_vec};

    fn fwd(table: &[f64], rows: usize, dim: usize, start: u32, ids: &[u32]) -> Vec<f64> {
        let mut out = vec![f64::NAN; ids.len() * dim];
        embedding_forward(table, rows, dim, start, ids, &mut out);
        out
    }

    #[test]
    fn forward_looks_up_rows_and_zeroes_foreign_ids() {
        let (rows, dim) = (3, 2);
        let table = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        // This rank owns ids 10, 11, 12.
        let out = fwd(&table, rows, dim, 10, &[11, 9, 12, 13, 10, 0, 11]);
        assert_eq!(out, vec![3.0, 4.0, 0.0, 0.0, 5.0, 6.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 3.0, 4.0]);
    }

    #[test]
    fn backward_matches_finite_differences() {
        // Repeated ids, ids below and above the local slice, odd sizes.
        for (k, &(rows, dim, start)) in [(5usize, 3usize, 4u32), (1, 1, 0), (17, 17, 100), (3, 129, 7)].iter().enumerate() {
            let ids: Vec<u32> = [0u32, 4, 5, 4, 8, 9, 3, 6, 4, 200, 100, 116, 100, 7, 9].iter().map(|&v| v + start.saturating_sub(4)).collect();
            let seed = 20 * k as u64;
            let table = rand_vec(seed, rows * dim);
            let w = rand_vec(seed + 1, ids.len() * dim);
            let mut dt = vec![0.0; rows * dim];
            embedding_backward(&ids, &w, rows, dim, start, &mut dt);
            let num = numeric_grad(|t| dot(&fwd(t, rows, dim, start, &ids), &w), &table, 1e-6);
            assert_close(&dt, &num, 1e-8, 1e-8, &format!("embedding rows={rows} dim={dim} start={start}"));
        }
    }

    #[test]
    fn backward_accumulates_and_counts_repeats() {
        let (rows, dim) = (4, 3);
        let ids = [2u32, 2, 5, 2, 3];
        let dout: Vec<f64> = (0..ids.len() * dim).map(|v| v as f64).collect();
        let mut dt = vec![1.0; rows * dim];
        embedding_backward(&ids, &dout, rows, dim, 2, &mut dt);
        // Local row 0 (id 2) gets tokens 0, 1, 3; row 1 (id 3) token 4; row 2 nothing; row 3 (id 5) token 2.
        assert_eq!(&dt[0..3], &[1.0 + 0.0 + 3.0 + 9.0, 1.0 + 1.0 + 4.0 + 10.0, 1.0 + 2.0 + 5.0 + 11.0]);
        assert_eq!(&dt[3..6], &[13.0, 14.0, 15.0]);
        assert_eq!(&dt[6..9], &[1.0; 3]);
        assert_eq!(&dt[9..12], &[7.0, 8.0, 9.0]);
    }

    #[test]
    fn two_vocab_halves_sum_to_the_whole() {
        let (vocab, dim) = (37, 5);
        let table = rand_vec(3, vocab * dim);
        let ids: Vec<u32> = (0..50u32).map(|i| (i * 7 + 3) % vocab as u32).collect();
        let whole = fwd(&table, vocab, dim, 0, &ids);
        let h = 18;
        let lo = fwd(&table[..h * dim], h, dim, 0, &ids);
        let hi = fwd(&table[h * dim..], vocab - h, dim, h as u32, &ids);
        let summed: Vec<f64> = lo.iter().zip(&hi).map(|(a, b)| a + b).collect();
        assert_eq!(summed, whole);

        let dout = rand_vec(4, ids.len() * dim);
        let mut dwhole = vec![0.0; vocab * dim];
        embedding_backward(&ids, &dout, vocab, dim, 0, &mut dwhole);
        let mut dlo = vec![0.0; h * dim];
        let mut dhi = vec![0.0; (vocab - h) * dim];
        embedding_backward(&ids, &dout, h, dim, 0, &mut dlo);
        embedding_backward(&ids, &dout, vocab - h, dim, h as u32, &mut dhi);
        dlo.extend_from_slice(&dhi);
        assert_eq!(dlo, dwhole);
    }

    #[test]
    fn f32_matches_f64() {
        let (rows, dim) = (11, 17);
        let ids: Vec<u32> = (0..40u32).map(|i| (i * i) % 13).collect();
        let dout = rand_vec(9, ids.len() * dim);
        let mut d64 = vec![0.0; rows * dim];
        embedding_backward(&ids, &dout, rows, dim, 1, &mut d64);
        let dout32: Vec<f32> = dout.iter().map(|&v| v as f32).collect();
        let mut d32 = vec![0f32; rows * dim];
        embedding_backward(&ids, &dout32, rows, dim, 1, &mut d32);
        let up: Vec<f64> = d32.iter().map(|&v| v as f64).collect();
        assert_close(&up, &d64, 1e-5, 1e-5, "embedding backward f32");
    }

    #[test]
    fn backward_is_thread_count_independent() {
        // Many repeats of few ids, large enough to run in parallel.
        let (rows, dim, n) = (300, 64, 4096);
        let ids: Vec<u32> = (0..n as u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % 320).collect();
        let dout: Vec<f32> = rand_vec(11, n * dim).iter().map(|&v| v as f32).collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut dt = vec![0f32; rows * dim];
                embedding_backward(&ids, &dout, rows, dim, 10, &mut dt);
                dt
            })
        };
        let (a, b) = (run(1), run(2));
        assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()), "1 vs 2 threads differ");
        // Row 0 (id 10) equals the in-order sum of its tokens' gradients.
        let mut want = vec![0f32; dim];
        for (i, &id) in ids.iter().enumerate() {
            if id == 10 {
                for (w, &g) in want.iter_mut().zip(&dout[i * dim..(i + 1) * dim]) {
                    *w += g;
                }
            }
        }
        assert!(want.iter().any(|&v| v != 0.0));
        assert_eq!(&a[..dim], &want[..]);
    }
}
