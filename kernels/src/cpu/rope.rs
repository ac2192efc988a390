//! Rotary position embedding (RoPE), "rotate half" convention.
//!
//! Within each head vector of even length `head_dim`, element `i` and element
//! `i + head_dim/2` (for `i < head_dim/2`) form a pair that is rotated by the
//! angle `pos · theta^(−2i / head_dim)`, as in the GPT-NeoX / Llama
//! formulation. A rotation is orthogonal, so the backward is the inverse
//! rotation (by the negated angle) applied to the upstream gradient.
//!
//! Angles are computed once in `f64` into a [`RopeTable`]: `pos · freq` for
//! large positions loses too many digits in `f32`.

use crate::Real;
use rayon::prelude::*;

/// Below this many elements the work stays on the calling thread.
const PAR_MIN_ELEMS: usize = 32 * 1024;
/// Rough number of elements one parallel task should cover.
const TASK_ELEMS: usize = 16 * 1024;

/// Precomputed `cos`/`sin` of every rotation angle, for positions
/// `0..max_position` and pair indices `0..head_dim/2`.
///
/// Layout: `cos[pos * head_dim/2 + i]`, likewise `sin`.
#[derive(Clone, Debug)]
pub struct RopeTable<T> {
    cos: Vec<T>,
    sin: Vec<T>,
    head_dim: usize,
    max_position: usize,
}

impl<T: Real> RopeTable<T> {
    /// Builds the table for positions `0..max_position` of heads of length
    /// `head_dim` (even, asserted) with base `theta` (10000 in most models);
    /// angles are evaluated in `f64` and rounded once to `T`.
    pub fn new(max_position: usize, head_dim: usize, theta: f64) -> Self {
        assert!(head_dim > 0 && head_dim.is_multiple_of(2), "rope head_dim must be even and positive, got {head_dim}");
        assert!(theta > 0.0, "rope theta must be positive");
        let half = head_dim / 2;
        let inv_freq: Vec<f64> = (0..half).map(|i| theta.powf(-2.0 * i as f64 / head_dim as f64)).collect();
        let mut cos = Vec::with_capacity(max_position * half);
        let mut sin = Vec::with_capacity(max_position * half);
        for p in 0..max_position {
            for &f in &inv_freq {
                let (s, c) = (p as f64 * f).sin_cos();
                cos.push(T::lit(c));
                sin.push(T::lit(s));
            }
        }
        Self { cos, sin, head_dim, max_position }
    }

    /// Length of the head vectors this table rotates.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Number of positions covered: valid positions are `0..max_position`.
    pub fn max_position(&self) -> usize {
        self.max_position
    }
}

/// Which head vectors of a buffer rotate, and by which position.
#[derive(Clone, Copy)]
struct Rows {
    /// Consecutive head vectors that share a position (1 for `[.., seq, head_dim]`).
    per_position: usize,
    /// Head vectors repeat in a pattern of this many, of which the last
    /// `period - rotated` are copied unrotated (values in a fused projection).
    period: usize,
    rotated: usize,
}

impl Rows {
    /// Every vector of a `[batch_heads, seq, head_dim]` buffer.
    const ALL: Rows = Rows { per_position: 1, period: 1, rotated: 1 };
}

/// Rotates the head vectors of `src` into `dst` (copying those `rows` leaves
/// alone); `sign` = +1 rotates by the position's angle, −1 by its negation.
fn rotate<T: Real>(table: &RopeTable<T>, src: &[T], seq: usize, positions: &[u32], rows: Rows, dst: &mut [T], sign: T) {
    let d = table.head_dim;
    let half = d / 2;
    assert!(src.len().is_multiple_of(seq.max(1) * rows.per_position * d), "rope input length");
    assert_eq!(dst.len(), src.len(), "rope output length");
    assert_eq!(positions.len(), seq, "rope positions length");
    if let Some(&p) = positions.iter().find(|&&p| p as usize >= table.max_position) {
        panic!("rope position {p} outside the table (max_position {})", table.max_position);
    }

    let one = |(r, (s, o)): (usize, (&[T], &mut [T]))| {
        if r % rows.period >= rows.rotated {
            o.copy_from_slice(s);
            return;
        }
        let p = positions[(r / rows.per_position) % seq] as usize;
        let c = &table.cos[p * half..(p + 1) * half];
        let sn = &table.sin[p * half..(p + 1) * half];
        let (x1, x2) = s.split_at(half);
        let (y1, y2) = o.split_at_mut(half);
        for ((((a, b), (&u, &v)), &ci), &si) in y1.iter_mut().zip(y2.iter_mut()).zip(x1.iter().zip(x2)).zip(c).zip(sn) {
            let si = sign * si;
            *a = u * ci - v * si;
            *b = v * ci + u * si;
        }
    };
    if src.len() < PAR_MIN_ELEMS {
        src.chunks(d).zip(dst.chunks_mut(d)).enumerate().for_each(one);
    } else {
        src.par_chunks(d).zip(dst.par_chunks_mut(d)).enumerate().with_min_len((TASK_ELEMS / d).max(1)).for_each(one);
    }
}

/// Applies RoPE: for each head vector at sequence index `s` with position
/// `p = positions[s]`, `y[i] = x[i] cos − x[i+h] sin`, `y[i+h] = x[i+h] cos + x[i] sin`
/// with `h = head_dim/2` and angle `p · theta^(−2i/head_dim)`.
///
/// `x`, `y`: `batch_heads × seq × head_dim` (`y` overwritten); `positions`:
/// `seq`, each below `table.max_position()` (asserted).
pub fn rope_forward<T: Real>(table: &RopeTable<T>, x: &[T], batch_heads: usize, seq: usize, positions: &[u32], y: &mut [T]) {
    assert_eq!(x.len(), batch_heads * seq * table.head_dim, "rope input length");
    rotate(table, x, seq, positions, Rows::ALL, y, T::one());
}

/// Backward of [`rope_forward`]: the inverse rotation (angle negated) of `dy`
/// into `dx` (overwritten). Same layouts as the forward.
pub fn rope_backward<T: Real>(table: &RopeTable<T>, dy: &[T], batch_heads: usize, seq: usize, positions: &[u32], dx: &mut [T]) {
    assert_eq!(dy.len(), batch_heads * seq * table.head_dim, "rope input length");
    rotate(table, dy, seq, positions, Rows::ALL, dx, -T::one());
}

/// The heads of a fused self-attention projection, `[batch, seq, kv_heads,
/// group + 2, head_dim]`: per position and kv head, `group` query heads, a
/// key head and a value head.
#[derive(Clone, Copy, Debug)]
pub struct PackedHeads {
    /// Key/value heads.
    pub kv_heads: usize,
    /// Query heads per key/value head.
    pub group: usize,
}

impl PackedHeads {
    fn rows(self) -> Rows {
        Rows { per_position: self.kv_heads * (self.group + 2), period: self.group + 2, rotated: self.group + 1 }
    }
}

/// [`rope_forward`] on the query and key heads of a fused projection
/// `x` (`[batch, seq, kv_heads, group + 2, head_dim]`, see [`PackedHeads`]);
/// value heads are copied to `y` unchanged.
pub fn rope_packed_forward<T: Real>(table: &RopeTable<T>, x: &[T], heads: PackedHeads, seq: usize, positions: &[u32], y: &mut [T]) {
    rotate(table, x, seq, positions, heads.rows(), y, T::one());
}

/// Backward of [`rope_packed_forward`]: the inverse rotation of the query and
/// key heads of `dy`, value heads copied.
pub fn rope_packed_backward<T: Real>(table: &RopeTable<T>, dy: &[T], heads: PackedHeads, seq: usize, positions: &[u32], dx: &mut [T]) {
    rotate(table, dy, seq, positions, heads.rows(), dx, -T::one());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, dot, numeric_grad, rand_vec};

    fn fwd(t: &RopeTable<f64>, x: &[f64], bh: usize, seq: usize, pos: &[u32]) -> Vec<f64> {
        let mut y = vec![f64::NAN; x.len()];
        rope_forward(t, x, bh, seq, pos, &mut y);
        y
    }

    #[test]
    fn forward_matches_direct_formula() {
        let (bh, seq, d) = (3, 5, 6);
        let t = RopeTable::<f64>::new(64, d, 10_000.0);
        assert_eq!((t.head_dim(), t.max_position()), (6, 64));
        let pos = [0u32, 7, 63, 1, 30];
        let x = rand_vec(1, bh * seq * d);
        let y = fwd(&t, &x, bh, seq, &pos);
        for b in 0..bh {
            for (s, &p) in pos.iter().enumerate() {
                let base = (b * seq + s) * d;
                for i in 0..d / 2 {
                    let ang = p as f64 * 10_000f64.powf(-2.0 * i as f64 / d as f64);
                    let (u, v) = (x[base + i], x[base + i + d / 2]);
                    assert!((y[base + i] - (u * ang.cos() - v * ang.sin())).abs() < 1e-14);
                    assert!((y[base + i + d / 2] - (v * ang.cos() + u * ang.sin())).abs() < 1e-14);
                }
            }
        }
        // Position 0 is the identity.
        assert_eq!(&y[..d], &x[..d]);
    }

    #[test]
    fn backward_matches_finite_differences() {
        for (k, &(bh, seq, d)) in [(1usize, 1usize, 2usize), (3, 17, 4), (2, 3, 18), (1, 5, 130)].iter().enumerate() {
            let t = RopeTable::<f64>::new(40, d, 500.0);
            let pos: Vec<u32> = (0..seq as u32).map(|s| (s * 11 + 3) % 40).collect();
            let x = rand_vec(10 + k as u64, bh * seq * d);
            let w = rand_vec(20 + k as u64, bh * seq * d);
            let mut dx = vec![f64::NAN; x.len()];
            rope_backward(&t, &w, bh, seq, &pos, &mut dx);
            let num = numeric_grad(|x| dot(&fwd(&t, x, bh, seq, &pos), &w), &x, 1e-6);
            assert_close(&dx, &num, 1e-8, 1e-7, &format!("rope bh={bh} seq={seq} d={d}"));
        }
    }

    #[test]
    fn backward_inverts_forward_and_pairs_keep_their_norm() {
        let (bh, seq, d) = (4, 9, 16);
        let t = RopeTable::<f64>::new(4096, d, 10_000.0);
        let pos: Vec<u32> = (0..seq as u32).map(|s| s * 511).collect();
        let x = rand_vec(3, bh * seq * d);
        let y = fwd(&t, &x, bh, seq, &pos);
        let mut back = vec![0.0; x.len()];
        rope_backward(&t, &y, bh, seq, &pos, &mut back);
        assert_close(&back, &x, 1e-14, 1e-14, "rope inverse");
        let mut moved = 0;
        for (xr, yr) in x.chunks(d).zip(y.chunks(d)) {
            for i in 0..d / 2 {
                let nx = xr[i].hypot(xr[i + d / 2]);
                let ny = yr[i].hypot(yr[i + d / 2]);
                assert!((nx - ny).abs() < 1e-14, "pair norm {nx} became {ny}");
                moved += usize::from((xr[i] - yr[i]).abs() > 1e-3);
            }
        }
        assert!(moved > 100, "rotation barely changed anything ({moved})");
    }

    #[test]
    fn f32_matches_f64_and_is_thread_count_independent() {
        let (bh, seq, d) = (16, 64, 64);
        let t64 = RopeTable::<f64>::new(8192, d, 10_000.0);
        let t32 = RopeTable::<f32>::new(8192, d, 10_000.0);
        let pos: Vec<u32> = (0..seq as u32).map(|s| 8000 + s).collect();
        let x = rand_vec(5, bh * seq * d);
        let y = fwd(&t64, &x, bh, seq, &pos);
        let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut y32 = vec![0f32; x32.len()];
                rope_forward(&t32, &x32, bh, seq, &pos, &mut y32);
                y32
            })
        };
        let (a, b) = (run(1), run(2));
        assert_eq!(a, b);
        let up: Vec<f64> = a.iter().map(|&v| v as f64).collect();
        assert_close(&up, &y, 1e-6, 1e-5, "rope f32");
    }

    #[test]
    #[should_panic(expected = "even")]
    fn odd_head_dim_is_rejected() {
        let _ = RopeTable::<f32>::new(4, 5, 10_000.0);
    }

    #[test]
    fn packed_layout_rotates_queries_and_keys_and_copies_values() {
        // [batch 2, seq 3, kv 2, group 2 + 2, d 4] against the per-head form.
        let (b, seq, kv, g, d) = (2, 3, 2, 2, 4);
        let t = RopeTable::<f64>::new(16, d, 100.0);
        let pos = [5u32, 0, 9];
        let heads = PackedHeads { kv_heads: kv, group: g };
        let x = rand_vec(30, b * seq * kv * (g + 2) * d);
        let mut y = vec![f64::NAN; x.len()];
        rope_packed_forward(&t, &x, heads, seq, &pos, &mut y);
        for bi in 0..b {
            for s in 0..seq {
                for slot in 0..kv * (g + 2) {
                    let at = ((bi * seq + s) * kv * (g + 2) + slot) * d;
                    let want = if slot % (g + 2) <= g { fwd(&t, &x[at..at + d], 1, 1, &pos[s..s + 1]) } else { x[at..at + d].to_vec() };
                    assert_eq!(&y[at..at + d], &want[..], "batch {bi} position {s} slot {slot}");
                }
            }
        }
        let mut back = vec![f64::NAN; x.len()];
        rope_packed_backward(&t, &y, heads, seq, &pos, &mut back);
        assert_close(&back, &x, 1e-14, 1e-14, "packed rope inverse");
    }
}
