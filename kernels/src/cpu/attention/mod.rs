//! Fused causal self-attention with grouped-query heads, on the CPU.
//!
//! `out = softmax(scale · Q·Kᵀ + mask) · V` per (batch, query head), computed
//! FlashAttention-2 style: queries are cut into blocks of [`BLOCK_Q`] rows and
//! keys/values are streamed past them in blocks of [`BLOCK_KV`] rows with an
//! online softmax, so the `seq_q × seq_kv` score matrix never exists. The
//! forward saves only `out` and the per-query log-sum-exp `lse`; the backward
//! recomputes the probabilities tile by tile from `q`, `k` and `lse`.
//!
//! Memory: besides the caller's buffers, each worker thread holds scratch of
//! `O(BLOCK_Q·BLOCK_KV + (BLOCK_Q + BLOCK_KV)·head_dim)` elements (a few score
//! tiles, a transposed key/query block, an output accumulator), independent of
//! the sequence length. The backward also allocates one `lse`-sized vector
//! (`rowsum(dout ∘ out)` per query).
//!
//! Causal mode skips key blocks that every query of a block is masked from
//! (about half the tiles when `seq_q == seq_kv`), and only masks element-wise
//! in the tiles the diagonal crosses.

mod backward;
#[cfg(target_arch = "x86_64")]
mod dot_bf16;
mod exp;
mod forward;
mod layout;
mod merge;
mod tile;

pub use backward::{attention_backward, attention_backward_packed};
pub use forward::{attention_forward, attention_forward_packed};
pub use merge::attention_merge;

use crate::Real;
use half::bf16;
use layout::{Layout, SharedOut};

/// Whether the bf16 entry points ([`attention_forward_bf16`] and the others)
/// run their tile products on the CPU's bf16 dot-product instruction.
pub fn bf16_dot_products() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        dot_bf16::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`attention_forward`] on bf16 operands (f32 log-sum-exp). With
/// [`bf16_dot_products`], the tile products run on the bf16 dot-product
/// instruction: scores from the bf16 queries and keys summed in f32, and the
/// probabilities rounded once to bf16 before they weight the values (the
/// softmax itself and every sum stay in f32). Otherwise the f32 kernel reads
/// the bf16 operands, giving its bits rounded once. Either way the results
/// do not depend on the number of threads.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_bf16(d: &AttnDims, q: &[bf16], k: &[bf16], v: &[bf16], out: &mut [bf16], lse: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if dot_bf16::available() {
        d.check();
        assert_eq!(q.len(), d.q_len(), "attention_forward: q length");
        assert_eq!(k.len(), d.kv_len(), "attention_forward: k length");
        assert_eq!(v.len(), d.kv_len(), "attention_forward: v length");
        assert_eq!(out.len(), d.q_len(), "attention_forward: out length");
        return dot_bf16::forward(d, &Layout::heads(d), q, k, v, out, lse);
    }
    attention_forward(d, q, k, v, out, lse)
}

/// [`attention_forward_packed`] on bf16 operands: see [`attention_forward_bf16`].
pub fn attention_forward_packed_bf16(d: &AttnDims, qkv: &[bf16], out: &mut [bf16], lse: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if dot_bf16::available() {
        d.check();
        assert_eq!(d.seq_q, d.seq_kv, "attention_forward_packed: self-attention needs seq_q == seq_kv");
        assert_eq!(qkv.len(), d.packed_len(), "attention_forward_packed: qkv length");
        assert_eq!(out.len(), d.q_len(), "attention_forward_packed: out length");
        return dot_bf16::forward(d, &Layout::packed(d), qkv, qkv, qkv, out, lse);
    }
    attention_forward_packed(d, qkv, out, lse)
}

/// [`attention_backward`] on bf16 operands (f32 log-sum-exp). With
/// [`bf16_dot_products`], the tile products run on the bf16 dot-product
/// instruction, the probabilities and score gradients rounded once to bf16
/// before they multiply (see [`attention_forward_bf16`]), and one task per
/// (batch, kv head) computes every gradient. Otherwise the f32 kernel reads
/// the bf16 operands.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_bf16(
    d: &AttnDims,
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    out: &[bf16],
    lse: &[f32],
    dout: &[bf16],
    dq: &mut [bf16],
    dk: &mut [bf16],
    dv: &mut [bf16],
) {
    #[cfg(target_arch = "x86_64")]
    if dot_bf16::available() {
        d.check();
        for (x, len, what) in [(q, d.q_len(), "q"), (k, d.kv_len(), "k"), (v, d.kv_len(), "v"), (out, d.q_len(), "out"), (dout, d.q_len(), "dout")] {
            assert_eq!(x.len(), len, "attention_backward: {what} length");
        }
        assert_eq!((dq.len(), dk.len(), dv.len()), (d.q_len(), d.kv_len(), d.kv_len()), "attention_backward: gradient lengths");
        let grads = dot_bf16::Grads { dq: SharedOut::new(dq), dk: SharedOut::new(dk), dv: SharedOut::new(dv) };
        return dot_bf16::backward(d, &Layout::heads(d), q, k, v, out, lse, dout, grads);
    }
    attention_backward(d, q, k, v, out, lse, dout, dq, dk, dv)
}

/// [`attention_backward_packed`] on bf16 operands: see [`attention_backward_bf16`].
pub fn attention_backward_packed_bf16(d: &AttnDims, qkv: &[bf16], out: &[bf16], lse: &[f32], dout: &[bf16], dqkv: &mut [bf16]) {
    #[cfg(target_arch = "x86_64")]
    if dot_bf16::available() {
        d.check();
        assert_eq!(d.seq_q, d.seq_kv, "attention_backward_packed: self-attention needs seq_q == seq_kv");
        assert_eq!(qkv.len(), d.packed_len(), "attention_backward_packed: qkv length");
        assert_eq!((out.len(), dout.len()), (d.q_len(), d.q_len()), "attention_backward_packed: out and dout lengths");
        assert_eq!(dqkv.len(), d.packed_len(), "attention_backward_packed: dqkv length");
        let g = SharedOut::new(dqkv);
        return dot_bf16::backward(d, &Layout::packed(d), qkv, qkv, qkv, out, lse, dout, dot_bf16::Grads { dq: g, dk: g, dv: g });
    }
    attention_backward_packed(d, qkv, out, lse, dout, dqkv)
}

/// Query rows per block (one forward task, one backward `dq` task).
pub const BLOCK_Q: usize = 64;
/// Key/value rows per block (one backward `dk`/`dv` task).
pub const BLOCK_KV: usize = 64;

/// Below this many multiply-adds of `Q·Kᵀ` a call runs on the calling thread:
/// spreading a few microseconds of work over a pool costs more than it saves.
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// Sizes of one attention call. Layouts (contiguous, row-major):
///   q, out, dq: `[batch, q_heads, seq_q, head_dim]`
///   k, v, dk, dv: `[batch, kv_heads, seq_kv, head_dim]`
///   lse: `[batch, q_heads, seq_q]` (log-sum-exp of each query's scaled
///   scores, saved by forward; `-inf` for a query that sees no key)
///
/// `q_heads` must be a multiple of `kv_heads` (grouped-query attention: query
/// head `h` reads kv head `h / (q_heads / kv_heads)`). With `causal`, query `i`
/// attends keys `j <= i + (seq_kv - seq_q)` (queries are the last `seq_q`
/// positions, which is what a KV cache needs; `seq_q == seq_kv` is ordinary
/// causal training). `scale` multiplies `q·k` (usually `1/sqrt(head_dim)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnDims {
    /// Independent sequences.
    pub batch: usize,
    /// Query heads (and output heads).
    pub q_heads: usize,
    /// Key/value heads; divides `q_heads`.
    pub kv_heads: usize,
    /// Query positions per sequence.
    pub seq_q: usize,
    /// Key/value positions per sequence.
    pub seq_kv: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Whether query `i` is masked from keys after position `i + seq_kv - seq_q`.
    pub causal: bool,
    /// Multiplier of the raw scores `q·k`.
    pub scale: f64,
}

impl AttnDims {
    /// Elements of `q`, `out` and `dq`.
    pub fn q_len(&self) -> usize {
        self.batch * self.q_heads * self.seq_q * self.head_dim
    }

    /// Elements of `k`, `v`, `dk` and `dv`.
    pub fn kv_len(&self) -> usize {
        self.batch * self.kv_heads * self.seq_kv * self.head_dim
    }

    /// Elements of the fused `qkv` buffer of
    /// [`attention_forward_packed`]: `batch · seq · (q_heads + 2·kv_heads) · head_dim`.
    pub fn packed_len(&self) -> usize {
        self.batch * self.seq_q * (self.q_heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Elements of `lse`.
    pub fn lse_len(&self) -> usize {
        self.batch * self.q_heads * self.seq_q
    }

    /// Query heads sharing one kv head.
    fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }

    /// Number of keys query `i` attends: keys `0..key_end(i)`.
    fn key_end(&self, i: usize) -> usize {
        if !self.causal {
            return self.seq_kv;
        }
        // j <= i + seq_kv - seq_q  <=>  j < i + 1 + seq_kv - seq_q
        (i + 1 + self.seq_kv).saturating_sub(self.seq_q).min(self.seq_kv)
    }

    /// First query that attends key `j` (`seq_q` if none does).
    fn first_query(&self, j: usize) -> usize {
        if !self.causal {
            return 0;
        }
        (j + self.seq_q).saturating_sub(self.seq_kv).min(self.seq_q)
    }

    /// Multiply-adds of one `Q·Kᵀ` over all heads, ignoring the mask: the size
    /// measure that decides whether to go parallel.
    fn work(&self) -> usize {
        self.batch.saturating_mul(self.q_heads).saturating_mul(self.seq_q).saturating_mul(self.seq_kv).saturating_mul(self.head_dim)
    }

    #[track_caller]
    fn check(&self) {
        assert!(self.kv_heads > 0, "attention: kv_heads must be positive");
        assert!(self.q_heads.is_multiple_of(self.kv_heads), "attention: q_heads {} is not a multiple of kv_heads {}", self.q_heads, self.kv_heads);
        assert!(self.head_dim > 0, "attention: head_dim must be positive");
        assert!(self.scale.is_finite(), "attention: scale must be finite");
    }
}

/// The naive reference of [`attention_forward`]: materialises each query's
/// full row of scores, then softmax and the weighted sum of values. Same
/// layouts and masking as [`AttnDims`] describes; a query that sees no key gets
/// a zero output. For tests, and as the plain statement of what the fused
/// kernels compute.
pub fn attention_reference_forward<T: Real>(d: &AttnDims, q: &[T], k: &[T], v: &[T], out: &mut [T]) {
    d.check();
    assert_eq!(q.len(), d.q_len(), "attention: q length");
    assert_eq!(k.len(), d.kv_len(), "attention: k length");
    assert_eq!(v.len(), d.kv_len(), "attention: v length");
    assert_eq!(out.len(), d.q_len(), "attention: out length");
    let hd = d.head_dim;
    let scale = T::lit(d.scale);
    let mut scores = vec![T::zero(); d.seq_kv];
    for b in 0..d.batch {
        for h in 0..d.q_heads {
            let kv_base = (b * d.kv_heads + h / d.group()) * d.seq_kv * hd;
            for i in 0..d.seq_q {
                let row = ((b * d.q_heads + h) * d.seq_q + i) * hd;
                let qi = &q[row..row + hd];
                let o = &mut out[row..row + hd];
                o.fill(T::zero());
                let n = d.key_end(i);
                if n == 0 {
                    continue;
                }
                let mut mx = T::neg_infinity();
                for (j, s) in scores[..n].iter_mut().enumerate() {
                    let kj = &k[kv_base + j * hd..kv_base + (j + 1) * hd];
                    *s = scale * qi.iter().zip(kj).map(|(&a, &b)| a * b).sum::<T>();
                    mx = mx.max(*s);
                }
                let mut sum = T::zero();
                for s in &mut scores[..n] {
                    *s = (*s - mx).exp();
                    sum += *s;
                }
                for (j, &p) in scores[..n].iter().enumerate() {
                    let vj = &v[kv_base + j * hd..kv_base + (j + 1) * hd];
                    for (oe, &ve) in o.iter_mut().zip(vj) {
                        *oe += p / sum * ve;
                    }
                }
            }
        }
    }
}

/// Shared inputs of the forward and backward tests.
#[cfg(test)]
pub(super) mod test_inputs {
    use super::AttnDims;
    use crate::testing::rand_vec;

    pub fn dims(batch: usize, q_heads: usize, kv_heads: usize, seq_q: usize, seq_kv: usize, head_dim: usize, causal: bool) -> AttnDims {
        AttnDims { batch, q_heads, kv_heads, seq_q, seq_kv, head_dim, causal, scale: 1.0 / (head_dim as f64).sqrt() }
    }

    /// Random `(q, k, v)` in `[-2, 2)` so that softmax rows are far from uniform.
    pub fn qkv(d: &AttnDims, seed: u64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let s = |x: Vec<f64>| x.into_iter().map(|e| 2.0 * e).collect::<Vec<_>>();
        (s(rand_vec(seed, d.q_len())), s(rand_vec(seed + 1, d.kv_len())), rand_vec(seed + 2, d.kv_len()))
    }

    pub fn to_f32(x: &[f64]) -> Vec<f32> {
        x.iter().map(|&e| e as f32).collect()
    }

    pub fn to_f64(x: &[f32]) -> Vec<f64> {
        x.iter().map(|&e| e as f64).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::test_inputs::dims;

    #[test]
    fn key_ranges_follow_the_kv_cache_convention() {
        let d = dims(1, 1, 1, 3, 5, 4, true);
        // Queries are the last three of five positions.
        assert_eq!((0..3).map(|i| d.key_end(i)).collect::<Vec<_>>(), vec![3, 4, 5]);
        assert_eq!((0..5).map(|j| d.first_query(j)).collect::<Vec<_>>(), vec![0, 0, 0, 1, 2]);
        // More queries than keys: the first ones see nothing.
        let d = dims(1, 1, 1, 5, 2, 4, true);
        assert_eq!((0..5).map(|i| d.key_end(i)).collect::<Vec<_>>(), vec![0, 0, 0, 1, 2]);
        assert_eq!((0..2).map(|j| d.first_query(j)).collect::<Vec<_>>(), vec![3, 4]);
        let d = dims(1, 1, 1, 5, 2, 4, false);
        assert_eq!(d.key_end(0), 2);
        assert_eq!(d.first_query(1), 0);
    }

    #[test]
    #[should_panic(expected = "multiple of kv_heads")]
    fn rejects_heads_that_do_not_group() {
        let d = dims(1, 3, 2, 4, 4, 4, false);
        let z = vec![0f32; 64];
        super::attention_reference_forward(&d, &z[..d.q_len()], &z[..d.kv_len()], &z[..d.kv_len()], &mut vec![0f32; d.q_len()]);
    }

    /// The fused layout reads and writes the same values as separate
    /// tensors, and, summing in the same order, gives the same bits: forward
    /// and backward, with grouped queries, on one thread (fused backward
    /// schedule) and on several (two-pass schedule where the pairs are few).
    #[test]
    fn packed_layout_is_bit_identical_to_separate_tensors() {
        use super::test_inputs::{qkv, to_f32};
        use super::{attention_backward, attention_backward_packed, attention_forward, attention_forward_packed};
        use crate::testing::rand_vec;
        for d in [dims(2, 4, 2, 70, 70, 8, true), dims(1, 3, 1, 150, 150, 16, true), dims(2, 2, 2, 33, 33, 4, false)] {
            let (r, hd, t) = (d.q_heads / d.kv_heads, d.head_dim, d.seq_q);
            let (q, k, v) = qkv(&d, 21);
            let (q, k, v) = (to_f32(&q), to_f32(&k), to_f32(&v));
            // [b, h, t, hd] -> [b, t, kv, r + 2, hd]
            let mut packed = vec![f32::NAN; d.packed_len()];
            let slot = |b: usize, ti: usize, g: usize, s: usize| (((b * t + ti) * d.kv_heads + g) * (r + 2) + s) * hd;
            for b in 0..d.batch {
                for ti in 0..t {
                    for g in 0..d.kv_heads {
                        for s in 0..r + 2 {
                            let src = match s {
                                s if s < r => &q[((b * d.q_heads + g * r + s) * t + ti) * hd..][..hd],
                                s if s == r => &k[((b * d.kv_heads + g) * t + ti) * hd..][..hd],
                                _ => &v[((b * d.kv_heads + g) * t + ti) * hd..][..hd],
                            };
                            packed[slot(b, ti, g, s)..][..hd].copy_from_slice(src);
                        }
                    }
                }
            }
            // [b, h, t, hd] <-> [b, t, h, hd] for the output side.
            let to_bthd = |x: &[f32]| {
                let mut y = vec![0f32; x.len()];
                for b in 0..d.batch {
                    for h in 0..d.q_heads {
                        for ti in 0..t {
                            let src = ((b * d.q_heads + h) * t + ti) * hd;
                            let dst = ((b * t + ti) * d.q_heads + h) * hd;
                            y[dst..dst + hd].copy_from_slice(&x[src..src + hd]);
                        }
                    }
                }
                y
            };
            let dout = to_f32(&rand_vec(22, d.q_len()));
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| {
                    let (mut out, mut lse) = (vec![0f32; d.q_len()], vec![0f32; d.lse_len()]);
                    attention_forward(&d, &q, &k, &v, &mut out, &mut lse);
                    let (mut pout, mut plse) = (vec![f32::NAN; d.q_len()], vec![f32::NAN; d.lse_len()]);
                    attention_forward_packed(&d, &packed, &mut pout, &mut plse);
                    let bits = |x: &[f32]| x.iter().map(|e| e.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&pout), bits(&to_bthd(&out)), "packed out, {threads} threads, {d:?}");
                    assert_eq!(bits(&plse), bits(&lse), "packed lse, {threads} threads");

                    let (mut dq, mut dk, mut dv) = (vec![0f32; d.q_len()], vec![0f32; d.kv_len()], vec![0f32; d.kv_len()]);
                    attention_backward(&d, &q, &k, &v, &out, &lse, &dout, &mut dq, &mut dk, &mut dv);
                    let mut dpacked = vec![f32::NAN; d.packed_len()];
                    attention_backward_packed(&d, &packed, &pout, &plse, &to_bthd(&dout), &mut dpacked);
                    for b in 0..d.batch {
                        for ti in 0..t {
                            for g in 0..d.kv_heads {
                                for s in 0..r + 2 {
                                    let want = match s {
                                        s if s < r => &dq[((b * d.q_heads + g * r + s) * t + ti) * hd..][..hd],
                                        s if s == r => &dk[((b * d.kv_heads + g) * t + ti) * hd..][..hd],
                                        _ => &dv[((b * d.kv_heads + g) * t + ti) * hd..][..hd],
                                    };
                                    let got = &dpacked[slot(b, ti, g, s)..][..hd];
                                    assert_eq!(bits(got), bits(want), "packed grad slot {s}, {threads} threads, {d:?}");
                                }
                            }
                        }
                    }
                });
            }
        }
    }

    /// Operands stored as bf16: the same bits as the f32 kernels on the
    /// widened operands with their outputs rounded, for both layouts and
    /// both backward schedules (one (batch, kv head) pair runs the two-pass
    /// schedule on several threads, eight pairs the fused one).
    #[test]
    fn bf16_storage_gives_the_bits_of_the_widening_path() {
        use super::test_inputs::qkv;
        use super::{attention_backward, attention_backward_packed, attention_forward, attention_forward_packed};
        use half::bf16;
        let h = |x: &[f64]| x.iter().map(|&v| bf16::from_f64(v)).collect::<Vec<bf16>>();
        let w = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        let round = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect::<Vec<u16>>();
        let bits = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<u16>>();
        for (d, threads) in [(dims(1, 4, 1, 200, 200, 32, true), 2), (dims(2, 4, 2, 150, 120, 16, true), 3), (dims(2, 4, 4, 130, 130, 8, false), 1)] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (q, k, v) = qkv(&d, 21);
                let (q, k, v) = (h(&q), h(&k), h(&v));
                let dout = h(&crate::testing::rand_vec(22, d.q_len()));
                // Separate tensors.
                let (mut out32, mut lse32) = (vec![0f32; d.q_len()], vec![0f32; d.lse_len()]);
                attention_forward(&d, &w(&q), &w(&k), &w(&v), &mut out32, &mut lse32);
                let (mut out, mut lse) = (vec![bf16::ZERO; d.q_len()], vec![0f32; d.lse_len()]);
                attention_forward(&d, &q, &k, &v, &mut out, &mut lse);
                assert_eq!(bits(&out), round(&out32), "forward {d:?}");
                assert_eq!(lse, lse32, "lse {d:?}");
                let (mut dq32, mut dk32, mut dv32) = (vec![0f32; d.q_len()], vec![0f32; d.kv_len()], vec![0f32; d.kv_len()]);
                attention_backward(&d, &w(&q), &w(&k), &w(&v), &w(&out), &lse, &w(&dout), &mut dq32, &mut dk32, &mut dv32);
                let (mut dq, mut dk, mut dv) = (vec![bf16::ZERO; d.q_len()], vec![bf16::ZERO; d.kv_len()], vec![bf16::ZERO; d.kv_len()]);
                attention_backward(&d, &q, &k, &v, &out, &lse, &dout, &mut dq, &mut dk, &mut dv);
                assert_eq!(bits(&dq), round(&dq32), "dq {d:?}");
                assert_eq!(bits(&dk), round(&dk32), "dk {d:?}");
                assert_eq!(bits(&dv), round(&dv32), "dv {d:?}");
                // The fused projection of self-attention.
                if d.seq_q == d.seq_kv {
                    let packed = h(&crate::testing::rand_vec(23, d.packed_len()));
                    let (mut out32, mut lse32) = (vec![0f32; d.q_len()], vec![0f32; d.lse_len()]);
                    attention_forward_packed(&d, &w(&packed), &mut out32, &mut lse32);
                    let (mut out, mut lse) = (vec![bf16::ZERO; d.q_len()], vec![0f32; d.lse_len()]);
                    attention_forward_packed(&d, &packed, &mut out, &mut lse);
                    assert_eq!(bits(&out), round(&out32), "packed forward {d:?}");
                    assert_eq!(lse, lse32, "packed lse {d:?}");
                    let mut g32 = vec![0f32; d.packed_len()];
                    attention_backward_packed(&d, &w(&packed), &w(&out), &lse, &w(&dout), &mut g32);
                    let mut g = vec![bf16::ZERO; d.packed_len()];
                    attention_backward_packed(&d, &packed, &out, &lse, &dout, &mut g);
                    assert_eq!(bits(&g), round(&g32), "packed backward {d:?}");
                }
            });
        }
    }
}
