//! Attention on bf16 operands with the tile products on the AVX-512 BF16
//! dot-product instruction (`vdpbf16ps`, see the bf16 GEMM), used where the
//! CPU has it.
//!
//! The f32 kernels' tile products multiply and add 256-bit vectors in
//! separate instructions (so that every CPU gives the same bits): 8
//! multiply-adds per two instructions. `vdpbf16ps` does 32 in one. Here the
//! score tiles `Q·Kᵀ` (and `K·Qᵀ`, `V·dOᵀ` in the backward) take their
//! operands straight from bf16 storage, and the products with probabilities
//! or score gradients (`P·V`, `Pᵀ·dO`, `dSᵀ·Q`, `dS·K`) round those to bf16
//! first, as PyTorch's CPU flash attention does for bf16; every sum runs in
//! f32, and the softmax, its statistics and the score gradients are computed
//! in f32 as in the f32 kernels. So the results are not the f32 kernels'
//! bits: the extra error is one bf16 rounding (relative `2^-8`) of each
//! probability and score gradient before it is multiplied (see the tests for
//! the bounds).
//!
//! Schedule: the forward has one task per (batch, query head, query block),
//! as the f32 kernel; the backward always runs the fused schedule, one task
//! per (batch, kv head), owning every gradient row it writes. Each output is
//! one task's sum in a fixed order, so the results do not depend on the
//! number of threads.

use super::exp::{exp_minus, exp_minus_each};
use super::layout::{Layout, SharedOut};
use super::tile::{dot, max_of, sum_of};
use super::{AttnDims, BLOCK_KV, BLOCK_Q, PARALLEL_MIN_WORK};
use half::bf16;
use rayon::prelude::*;
use std::arch::x86_64::*;

/// Rows of a micro-tile: one 32-bit broadcast each per pair step.
const MR: usize = 8;
/// Columns of a micro-tile: two 16-lane f32 accumulators per row.
const NR: usize = 32;

/// Whether this CPU runs the dot-product path.
pub(super) fn available() -> bool {
    crate::cpu::matmul::bf16_native()
}

// Packing. The instruction pairs two consecutive elements of the
// contraction in each 32-bit word, so each operand is laid out as words of
// two bf16 values (low half first, as little-endian memory already holds a
// bf16 row):
// - left operands (`A`, `rows×k`): `rows` rounded up to [`MR`] rows of
//   `k.div_ceil(2)` words, word `q` of row `i` holding `(A(i,2q), A(i,2q+1))`;
// - right operands (`B`, `k×n`): strips of [`NR`] columns, each
//   `k.div_ceil(2)` rows of `NR` words, word `j` of row `q` holding
//   `(B(2q,j), B(2q+1,j))`;
// with zeros past `k`, past `rows` and past `n`. A bf16 row is already a
// packed left-operand row; everything else is interleaved, rounded from f32
// (probabilities, score gradients) or transposed, sixteen lanes at a time.

/// Resets `dst` to `len` zero words and returns it as bf16 bit slots.
fn zeroed_halves(dst: &mut Vec<u32>, len: usize) -> &mut [u16] {
    dst.clear();
    dst.resize(len, 0);
    bytemuck::cast_slice_mut(&mut dst[..])
}

/// Packs the left operand `A(i, p) = src[i·ld + p]` (`rows×k`) into `dst`.
fn pack_a_bf16(src: &[bf16], rows: usize, k: usize, ld: usize, dst: &mut Vec<u32>) {
    dst.clear();
    dst.resize(rows.next_multiple_of(MR) * k.div_ceil(2), 0);
    pack_a_rows(src, rows, k, ld, dst);
}

/// [`pack_a_bf16`] into `dst`, exactly its packed length.
fn pack_a_rows(src: &[bf16], rows: usize, k: usize, ld: usize, dst: &mut [u32]) {
    let kp = k.div_ceil(2);
    assert_eq!(dst.len(), rows.next_multiple_of(MR) * kp, "attention: packed length");
    dst.fill(0);
    let halves: &mut [u16] = bytemuck::cast_slice_mut(dst);
    let bits: &[u16] = bytemuck::cast_slice(src);
    for (i, row) in halves.chunks_exact_mut(2 * kp).take(rows).enumerate() {
        row[..k].copy_from_slice(&bits[i * ld..i * ld + k]);
    }
}

/// [`pack_a_bf16`] of f32 values, each rounded to bf16 (to nearest even).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
fn pack_a_f32(src: &[f32], rows: usize, k: usize, ld: usize, dst: &mut Vec<u32>) {
    let kp = k.div_ceil(2);
    let halves = zeroed_halves(dst, rows.next_multiple_of(MR) * kp);
    for (i, row) in halves.chunks_exact_mut(2 * kp).take(rows).enumerate() {
        let x = &src[i * ld..i * ld + k];
        for (c, o) in x.chunks(16).zip(row.chunks_mut(16)) {
            let mask: __mmask16 = ((1u32 << c.len()) - 1) as __mmask16;
            // SAFETY: the masked load reads the `c.len()` floats of `c`, the
            // masked store writes as many halves of `o` (at least as long).
            unsafe {
                let v = _mm512_maskz_loadu_ps(mask, c.as_ptr());
                _mm256_mask_storeu_epi16(o.as_mut_ptr() as *mut i16, mask, _mm512_cvtepi32_epi16(round_bits(v)));
            }
        }
    }
}

/// The bf16 bits (in the low half of each 32-bit lane) nearest to 16 f32
/// values, ties to even, exactly as the casts round (see the bf16 GEMM).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn round_bits(v: __m512) -> __m512i {
    let x = _mm512_castps_si512(v);
    let high = _mm512_srli_epi32::<16>(x);
    let lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)))
}

/// Packs the left operand `A(i, p) = src[p·ld + i]` (`rows×k`, stored the
/// other way round: the keys of a block as rows of features) into `dst`
/// (exactly its packed length): two key rows interleaved sixteen features
/// at a time, each word scattered to its row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
fn pack_a_cols(src: &[bf16], rows: usize, k: usize, ld: usize, dst: &mut [u32]) {
    let kp = k.div_ceil(2);
    assert_eq!(dst.len(), rows.next_multiple_of(MR) * kp, "attention: packed length");
    assert!(rows * kp < i32::MAX as usize, "attention: operand too large to scatter");
    dst.fill(0);
    let bits: &[u16] = bytemuck::cast_slice(src);
    let stride = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(kp as i32));
    for q in 0..kp {
        for i0 in (0..rows).step_by(16) {
            let lanes = (rows - i0).min(16);
            let mask: __mmask16 = ((1u32 << lanes) - 1) as __mmask16;
            let line = |p: usize| {
                let r = &bits[p * ld + i0..p * ld + i0 + lanes];
                // SAFETY: the masked load reads the `lanes` halves of `r`.
                _mm512_cvtepu16_epi32(unsafe { _mm256_maskz_loadu_epi16(mask, r.as_ptr() as *const i16) })
            };
            let lo = line(2 * q);
            let hi = if 2 * q + 1 < k { line(2 * q + 1) } else { _mm512_setzero_si512() };
            let words = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
            let out = dst[i0 * kp + q..].as_mut_ptr() as *mut i32;
            // SAFETY: active lane `t` writes word `(i0 + t)·kp + q`, inside
            // `dst` since `i0 + t < rows` and `q < kp`.
            unsafe { _mm512_mask_i32scatter_epi32::<4>(out, mask, stride, words) };
        }
    }
}

/// Packs the right operand `B(p, j) = src[p·ld + j]` (`k×n`, bf16) into
/// strips: two rows interleaved, 32 columns at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
fn pack_b_rows_bf16(src: &[bf16], k: usize, n: usize, ld: usize, dst: &mut Vec<u32>) {
    let kp = k.div_ceil(2);
    dst.clear();
    dst.resize(n.div_ceil(NR) * kp * NR, 0);
    let bits: &[u16] = bytemuck::cast_slice(src);
    for (s, strip) in dst.chunks_exact_mut(kp * NR).enumerate() {
        let (j0, nv) = (s * NR, NR.min(n - s * NR));
        let mask: __mmask32 = if nv == NR { !0 } else { (1u32 << nv) - 1 };
        let row = |p: usize| {
            let r = &bits[p * ld + j0..p * ld + j0 + nv];
            // SAFETY: the masked load reads the `nv` halves of `r`.
            unsafe { _mm512_maskz_loadu_epi16(mask, r.as_ptr() as *const i16) }
        };
        for (q, words) in strip.chunks_exact_mut(NR).enumerate() {
            let lo = row(2 * q);
            let hi = if 2 * q + 1 < k { row(2 * q + 1) } else { _mm512_setzero_si512() };
            let w = |h: __m256i, l: __m256i| _mm512_or_si512(_mm512_cvtepu16_epi32(l), _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
            // SAFETY: `words` holds NR = 32 words: two stores of 16.
            unsafe {
                _mm512_storeu_si512(words.as_mut_ptr() as *mut __m512i, w(_mm512_castsi512_si256(hi), _mm512_castsi512_si256(lo)));
                _mm512_storeu_si512(words.as_mut_ptr().add(16) as *mut __m512i, w(_mm512_extracti64x4_epi64::<1>(hi), _mm512_extracti64x4_epi64::<1>(lo)));
            }
        }
    }
}

/// [`pack_b_rows_bf16`] of f32 values, each rounded to bf16.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
fn pack_b_rows_f32(src: &[f32], k: usize, n: usize, ld: usize, dst: &mut Vec<u32>) {
    let kp = k.div_ceil(2);
    dst.clear();
    dst.resize(n.div_ceil(NR) * kp * NR, 0);
    for (s, strip) in dst.chunks_exact_mut(kp * NR).enumerate() {
        let (j0, nv) = (s * NR, NR.min(n - s * NR));
        for (q, words) in strip.chunks_exact_mut(NR).enumerate() {
            for h in 0..nv.div_ceil(16) {
                let lanes = (nv - 16 * h).min(16);
                let mask: __mmask16 = ((1u32 << lanes) - 1) as __mmask16;
                let at = |p: usize| {
                    let r = &src[p * ld + j0 + 16 * h..p * ld + j0 + 16 * h + lanes];
                    // SAFETY: the masked load reads the `lanes` floats of `r`.
                    round_bits(unsafe { _mm512_maskz_loadu_ps(mask, r.as_ptr()) })
                };
                let lo = at(2 * q);
                let hi = if 2 * q + 1 < k { at(2 * q + 1) } else { _mm512_setzero_si512() };
                // SAFETY: `words` holds 32 words; this writes 16 from `16·h`.
                unsafe { _mm512_storeu_si512(words.as_mut_ptr().add(16 * h) as *mut __m512i, _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi))) };
            }
        }
    }
}

/// Packs the right operand `B(p, j) = src[j·ld + p]` (`k×n`, stored the
/// other way round: a block of keys, queries or output gradients whose rows
/// are the product's columns) into strips, gathering each pair of sixteen
/// rows at once.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
fn pack_b_cols(src: &[bf16], k: usize, n: usize, ld: usize, dst: &mut Vec<u32>) {
    let kp = k.div_ceil(2);
    dst.clear();
    dst.resize(n.div_ceil(NR) * kp * NR, 0);
    if n == 0 || k == 0 {
        return;
    }
    assert!(src.len() >= (n - 1) * ld + k, "attention: operand too short");
    assert!((n * ld) < i32::MAX as usize, "attention: rows too far apart to gather");
    let bits: &[u16] = bytemuck::cast_slice(src);
    for (s, strip) in dst.chunks_exact_mut(kp * NR).enumerate() {
        let (j0, nv) = (s * NR, NR.min(n - s * NR));
        for h in 0..nv.div_ceil(16) {
            let lanes = (nv - 16 * h).min(16);
            let mask: __mmask16 = ((1u32 << lanes) - 1) as __mmask16;
            let first = j0 + 16 * h;
            // Element offsets of the sixteen rows (in halves).
            let idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(ld as i32));
            // Whole pairs: one 32-bit gather per pair index.
            for q in 0..k / 2 {
                let base = bits[first * ld + 2 * q..].as_ptr() as *const i32;
                // SAFETY: each active lane reads the two halves at
                // `(first + lane)·ld + 2q`, inside row `first + lane` (< n)
                // since `2q + 1 < k`.
                let v = unsafe { _mm512_mask_i32gather_epi32::<2>(_mm512_setzero_si512(), mask, idx, base) };
                // SAFETY: the strip row holds 32 words; this writes 16 from `16·h`.
                unsafe { _mm512_storeu_si512(strip.as_mut_ptr().add(q * NR + 16 * h) as *mut __m512i, v) };
            }
            // An odd last element pairs with zero (reading its neighbour
            // could leave the operand).
            if k % 2 == 1 {
                for t in 0..lanes {
                    strip[(kp - 1) * NR + 16 * h + t] = bits[(first + t) * ld + k - 1] as u32;
                }
            }
        }
    }
}

/// `C[m×n] = A·B` (or `C += A·B` when `accumulate`), `C` row-major f32 with
/// leading dimension `ldc`, from operands packed by [`pack_a`] /
/// [`pack_a_t`] (`a`) and [`pack_b_rows`] / [`pack_b_cols`] (`b`) with
/// `kp` words per row. Each element is one f32 chain over the pairs in
/// order, added to the old `C` at the end.
///
/// # Safety
/// The CPU has the features of [`available`].
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn tile(m: usize, n: usize, kp: usize, a: &[u32], b: &[u32], c: &mut [f32], ldc: usize, accumulate: bool) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.len() >= m.next_multiple_of(MR) * kp && b.len() >= n.div_ceil(NR) * kp * NR, "attention: packed operand too short");
    assert!(c.len() >= (m - 1) * ldc + n, "attention: tile output too short");
    for i0 in (0..m).step_by(MR) {
        let rv = MR.min(m - i0);
        for s in 0..n.div_ceil(NR) {
            let nv = NR.min(n - s * NR);
            let (ap, bp) = (a.as_ptr().add(i0 * kp), b.as_ptr().add(s * kp * NR));
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            for q in 0..kp {
                let b0 = bh(_mm512_loadu_si512(bp.add(q * NR) as *const __m512i));
                let b1 = bh(_mm512_loadu_si512(bp.add(q * NR + 16) as *const __m512i));
                for (i, r) in acc.iter_mut().enumerate() {
                    let ai = bh(_mm512_set1_epi32(*ap.add(i * kp + q) as i32));
                    r[0] = _mm512_dpbf16_ps(r[0], ai, b0);
                    r[1] = _mm512_dpbf16_ps(r[1], ai, b1);
                }
            }
            let cp = c.as_mut_ptr().add(i0 * ldc + s * NR);
            let masks: [__mmask16; 2] = [((1u32 << nv.min(16)) - 1) as __mmask16, ((1u32 << nv.saturating_sub(16)) - 1) as __mmask16];
            for (i, r) in acc.iter().enumerate().take(rv) {
                for (h, (&v, &mask)) in r.iter().zip(&masks).enumerate() {
                    let ci = cp.add(i * ldc + 16 * h);
                    let v = if accumulate { _mm512_add_ps(_mm512_maskz_loadu_ps(mask, ci), v) } else { v };
                    _mm512_mask_storeu_ps(ci, mask, v);
                }
            }
        }
    }
}

/// Reinterprets 16 words as 32 bf16 values for `vdpbf16ps`.
#[inline(always)]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: both are 64-byte plain-data vectors; every bit pattern is valid.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// Per-thread buffers of the forward.
#[derive(Default)]
struct FwdScratch {
    qa: Vec<u32>,
    kt: Vec<u32>,
    pa: Vec<u32>,
    vb: Vec<u32>,
    s: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
}

/// The forward on bf16 storage in `lay` (see the module documentation).
pub(super) fn forward(d: &AttnDims, lay: &Layout, q: &[bf16], k: &[bf16], v: &[bf16], out: &mut [bf16], lse: &mut [f32]) {
    assert_eq!(lse.len(), d.lse_len(), "attention_forward: lse length");
    if d.lse_len() == 0 {
        return;
    }
    let out = SharedOut::new(out);
    let tasks: Vec<_> =
        lse.chunks_mut(d.seq_q).enumerate().flat_map(|(bh, l)| l.chunks_mut(BLOCK_Q).enumerate().map(move |(qb, l)| (bh, qb * BLOCK_Q, l))).collect();
    let run = |s: &mut FwdScratch, (bh, i0, l): (usize, usize, &mut [f32])| {
        // SAFETY: the caller checked the CPU features (`available`).
        unsafe { forward_block(d, lay, q, k, v, out, bh / d.q_heads, bh % d.q_heads, i0, l, s) }
    };
    if d.work() < PARALLEL_MIN_WORK {
        let mut s = FwdScratch::default();
        tasks.into_iter().for_each(|t| run(&mut s, t));
    } else {
        tasks.into_par_iter().for_each_init(FwdScratch::default, run);
    }
}

/// Output rows `i0..i0 + lse.len()` of query head `h` in batch `b`,
/// compiled for AVX-512 (the softmax loops run sixteen lanes wide).
///
/// # Safety
/// The CPU has the features of [`available`]; no other task writes these
/// output rows, and `out`'s buffer outlives the call.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn forward_block(
    d: &AttnDims,
    lay: &Layout,
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    out: SharedOut<bf16>,
    b: usize,
    h: usize,
    i0: usize,
    lse: &mut [f32],
    s: &mut FwdScratch,
) {
    let hd = d.head_dim;
    let bq = lse.len();
    let g = h / d.group();
    let scale = d.scale as f32;
    let hp = hd.div_ceil(2);
    pack_a_bf16(&q[lay.q.at(d.group(), b, h, i0)..], bq, hd, lay.q.row(), &mut s.qa);
    s.m.clear();
    s.m.resize(bq, f32::NEG_INFINITY);
    s.l.clear();
    s.l.resize(bq, 0.0);
    s.acc.clear();
    s.acc.resize(bq * hd, 0.0);
    s.s.resize(BLOCK_Q * BLOCK_KV, 0.0);

    let kend = d.key_end(i0 + bq - 1);
    for j0 in (0..kend).step_by(BLOCK_KV) {
        let bk = BLOCK_KV.min(kend - j0);
        pack_b_cols(&k[lay.k.at(1, b, g, j0)..], hd, bk, lay.k.row(), &mut s.kt);
        let st = &mut s.s[..bq * bk];
        tile(bq, bk, hp, &s.qa, &s.kt, st, bk, false);
        let needs_mask = d.causal && d.key_end(i0) < j0 + bk;
        for (r, row) in st.chunks_exact_mut(bk).enumerate() {
            for x in row.iter_mut() {
                *x *= scale;
            }
            if needs_mask {
                let visible = d.key_end(i0 + r).saturating_sub(j0).min(bk);
                row[visible..].fill(f32::NEG_INFINITY);
            }
            let m_new = s.m[r].max(max_of(row));
            if m_new == f32::NEG_INFINITY {
                // Nothing visible to this query yet.
                row.fill(0.0);
                continue;
            }
            exp_minus(row, m_new);
            let sum = sum_of(row);
            let alpha = (s.m[r] - m_new).exp();
            if alpha != 1.0 {
                for a in &mut s.acc[r * hd..(r + 1) * hd] {
                    *a *= alpha;
                }
            }
            s.l[r] = s.l[r] * alpha + sum;
            s.m[r] = m_new;
        }
        pack_a_f32(&s.s[..bq * bk], bq, bk, bk, &mut s.pa);
        pack_b_rows_bf16(&v[lay.v.at(1, b, g, j0)..], bk, hd, lay.v.row(), &mut s.vb);
        tile(bq, hd, bk.div_ceil(2), &s.pa, &s.vb, &mut s.acc, hd, true);
    }
    for (r, (o, l)) in s.acc.chunks_exact_mut(hd).zip(lse.iter_mut()).enumerate() {
        let sum = s.l[r];
        if sum == 0.0 {
            o.fill(0.0);
            *l = f32::NEG_INFINITY;
        } else {
            let inv = 1.0 / sum;
            for a in o.iter_mut() {
                *a *= inv;
            }
            *l = s.m[r] + sum.ln();
        }
        // SAFETY: this task alone computes query `i0 + r` of head `h` in
        // batch `b`, a row no other row of the layout overlaps; the caller
        // keeps the buffer borrowed.
        out.write_stored(lay.o.at(d.group(), b, h, i0 + r), o);
    }
}

/// Per-thread buffers of the backward.
#[derive(Default)]
struct BwdScratch {
    ka: Vec<u32>,
    va: Vec<u32>,
    kta: Vec<u32>,
    qt: Vec<u32>,
    dot: Vec<u32>,
    dob: Vec<u32>,
    qb: Vec<u32>,
    pa: Vec<u32>,
    dsa: Vec<u32>,
    dsb: Vec<u32>,
    pt: Vec<f32>,
    dpt: Vec<f32>,
    dqt: Vec<f32>,
    row: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// Where the backward writes its three gradients.
#[derive(Clone, Copy)]
pub(super) struct Grads {
    pub dq: SharedOut<bf16>,
    pub dk: SharedOut<bf16>,
    pub dv: SharedOut<bf16>,
}

/// The backward on bf16 storage in `lay` (see the module documentation).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(d: &AttnDims, lay: &Layout, q: &[bf16], k: &[bf16], v: &[bf16], out: &[bf16], lse: &[f32], dout: &[bf16], grads: Grads) {
    assert_eq!(lse.len(), d.lse_len(), "attention_backward: lse length");
    let hd = d.head_dim;
    let parallel = d.work() >= PARALLEL_MIN_WORK;
    let mut delta = vec![0f32; d.lse_len()];
    let row_delta = |(i, di): (usize, &mut f32)| {
        let (bh, t) = (i / d.seq_q.max(1), i % d.seq_q.max(1));
        let o = lay.o.at(d.group(), bh / d.q_heads, bh % d.q_heads, t);
        *di = dot(&dout[o..o + hd], &out[o..o + hd])
    };
    if parallel {
        delta.par_iter_mut().enumerate().for_each(row_delta);
    } else {
        delta.iter_mut().enumerate().for_each(row_delta);
    }
    let run = |s: &mut BwdScratch, bg: usize| {
        // SAFETY: the caller checked the CPU features (`available`).
        unsafe { group_block(d, lay, q, k, v, lse, dout, &delta, grads, bg / d.kv_heads, bg % d.kv_heads, s) }
    };
    if parallel {
        (0..d.batch * d.kv_heads).into_par_iter().for_each_init(BwdScratch::default, run);
    } else {
        let mut s = BwdScratch::default();
        (0..d.batch * d.kv_heads).for_each(|bg| run(&mut s, bg));
    }
}

/// Every gradient of kv head `g` in batch `b` and of its group of query heads.
///
/// # Safety
/// The CPU has the features of [`available`]; no other task writes these
/// gradient rows, and the gradient buffers outlive the call.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn group_block(
    d: &AttnDims,
    lay: &Layout,
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    lse: &[f32],
    dout: &[bf16],
    delta: &[f32],
    grads: Grads,
    b: usize,
    g: usize,
    s: &mut BwdScratch,
) {
    let (hd, r) = (d.head_dim, d.group());
    let hp = hd.div_ceil(2);
    let scale = d.scale as f32;
    let (k0, v0) = (lay.k.at(1, b, g, 0), lay.v.at(1, b, g, 0));
    let (k_ld, v_ld, q_ld, o_ld) = (lay.k.row(), lay.v.row(), lay.q.row(), lay.o.row());
    // Packed once per group: K and V as left operands of the transposed
    // score tiles, and Kᵀ as the left operand of dQᵀ = Kᵀ·dSᵀ (computing
    // dQ transposed takes dSᵀ as it comes, rows of keys, instead of
    // transposing it).
    let blocks = d.seq_kv.div_ceil(BLOCK_KV);
    let (ka_len, kta_len) = (BLOCK_KV * hp, hd.next_multiple_of(MR) * (BLOCK_KV / 2));
    s.ka.resize(blocks * ka_len, 0);
    s.va.resize(blocks * ka_len, 0);
    s.kta.resize(blocks * kta_len, 0);
    for jb in 0..blocks {
        let (j0, bk) = (jb * BLOCK_KV, BLOCK_KV.min(d.seq_kv - jb * BLOCK_KV));
        let a_len = bk.next_multiple_of(MR) * hp;
        pack_a_rows(&k[k0 + j0 * k_ld..], bk, hd, k_ld, &mut s.ka[jb * ka_len..jb * ka_len + a_len]);
        pack_a_rows(&v[v0 + j0 * v_ld..], bk, hd, v_ld, &mut s.va[jb * ka_len..jb * ka_len + a_len]);
        let t_len = hd.next_multiple_of(MR) * bk.div_ceil(2);
        pack_a_cols(&k[k0 + j0 * k_ld..], hd, bk, k_ld, &mut s.kta[jb * kta_len..jb * kta_len + t_len]);
    }
    s.dk.clear();
    s.dk.resize(d.seq_kv * hd, 0.0);
    s.dv.clear();
    s.dv.resize(d.seq_kv * hd, 0.0);
    s.pt.resize(BLOCK_KV * BLOCK_Q, 0.0);
    s.dpt.resize(BLOCK_KV * BLOCK_Q, 0.0);
    for hi in 0..r {
        let h = g * r + hi;
        let bh = b * d.q_heads + h;
        s.dqt.clear();
        s.dqt.resize(hd * d.seq_q, 0.0);
        for i0 in (0..d.seq_q).step_by(BLOCK_Q) {
            let bq = BLOCK_Q.min(d.seq_q - i0);
            let row0 = bh * d.seq_q + i0;
            let (qs, os) = (&q[lay.q.at(r, b, h, i0)..], &dout[lay.o.at(r, b, h, i0)..]);
            pack_b_cols(qs, hd, bq, q_ld, &mut s.qt);
            pack_b_cols(os, hd, bq, o_ld, &mut s.dot);
            pack_b_rows_bf16(os, bq, hd, o_ld, &mut s.dob);
            pack_b_rows_bf16(qs, bq, hd, q_ld, &mut s.qb);
            let (lse, delta) = (&lse[row0..row0 + bq], &delta[row0..row0 + bq]);
            let bqp = bq.div_ceil(2);
            for j0 in (0..d.key_end(i0 + bq - 1)).step_by(BLOCK_KV) {
                let jb = j0 / BLOCK_KV;
                let bk = BLOCK_KV.min(d.seq_kv - j0);
                // Sᵀ = K·Qᵀ, then Pᵀ = exp(scale·Sᵀ − lse), masked.
                let pt = &mut s.pt[..bk * bq];
                tile(bk, bq, hp, &s.ka[jb * ka_len..], &s.qt, pt, bq, false);
                let needs_mask = d.causal && d.key_end(i0) < j0 + bk;
                for (j, row) in pt.chunks_exact_mut(bq).enumerate() {
                    for x in row.iter_mut() {
                        *x *= scale;
                    }
                    let first = if needs_mask { d.first_query(j0 + j).saturating_sub(i0).min(bq) } else { 0 };
                    row[..first].fill(0.0);
                    exp_minus_each(&mut row[first..], &lse[first..]);
                }
                // dV += Pᵀ·dO.
                pack_a_f32(pt, bk, bq, bq, &mut s.pa);
                tile(bk, hd, bqp, &s.pa, &s.dob, &mut s.dv[j0 * hd..], hd, true);
                // dPᵀ = V·dOᵀ; dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale.
                let dpt = &mut s.dpt[..bk * bq];
                tile(bk, bq, hp, &s.va[jb * ka_len..], &s.dot, dpt, bq, false);
                for (prow, dprow) in pt.chunks_exact_mut(bq).zip(dpt.chunks_exact(bq)) {
                    for ((p, &dp), &di) in prow.iter_mut().zip(dprow).zip(delta) {
                        *p = *p * (dp - di) * scale;
                    }
                }
                // dK += dSᵀ·Q; dQᵀ += Kᵀ·dSᵀ.
                pack_a_f32(pt, bk, bq, bq, &mut s.dsa);
                tile(bk, hd, bqp, &s.dsa, &s.qb, &mut s.dk[j0 * hd..], hd, true);
                pack_b_rows_f32(pt, bk, bq, bq, &mut s.dsb);
                tile(hd, bq, bk.div_ceil(2), &s.kta[jb * kta_len..], &s.dsb, &mut s.dqt[i0..], d.seq_q, true);
            }
        }
        // dQ back to rows, a 16×16 block at a time (both sides stay in cache).
        s.row.resize(d.seq_q * hd, 0.0);
        for e0 in (0..hd).step_by(16) {
            for t0 in (0..d.seq_q).step_by(16) {
                for e in e0..(e0 + 16).min(hd) {
                    for t in t0..(t0 + 16).min(d.seq_q) {
                        s.row[t * hd + e] = s.dqt[e * d.seq_q + t];
                    }
                }
            }
        }
        for (t, row) in s.row.chunks_exact(hd).enumerate() {
            // SAFETY: this task alone computes the gradients of kv head `g`
            // in batch `b` and of its query heads; the caller keeps the
            // buffers borrowed.
            grads.dq.write_stored(lay.q.at(r, b, h, t), row);
        }
    }
    for (t, (dk, dv)) in s.dk.chunks_exact(hd).zip(s.dv.chunks_exact(hd)).enumerate() {
        // SAFETY: as above.
        grads.dk.write_stored(lay.k.at(1, b, g, t), dk);
        grads.dv.write_stored(lay.v.at(1, b, g, t), dv);
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_inputs::{dims, qkv};
    use super::super::{attention_backward_bf16, attention_backward_packed_bf16, attention_forward_bf16, attention_forward_packed_bf16};
    use super::*;
    use crate::testing::rand_vec;

    fn h(x: &[f64]) -> Vec<bf16> {
        x.iter().map(|&v| bf16::from_f64(v)).collect()
    }

    fn w(x: &[bf16]) -> Vec<f64> {
        x.iter().map(|v| v.to_f64()).collect()
    }

    /// The exact (f64) attention of the bf16 values, with the magnitude sums
    /// the error bounds need: `(out, lse, dq, dk, dv)` and for each the sum
    /// of the magnitudes of its terms. The backward uses the kernel's own
    /// (rounded) `out` in `D = rowsum(dout ∘ out)`, as the kernel does.
    #[allow(clippy::type_complexity)]
    fn reference(d: &AttnDims, q: &[f64], k: &[f64], v: &[f64], out_used: &[f64], dout: &[f64]) -> [(Vec<f64>, Vec<f64>); 5] {
        let hd = d.head_dim;
        let (mut o, mut om) = (vec![0.0; d.q_len()], vec![0.0; d.q_len()]);
        let mut lse = vec![f64::NEG_INFINITY; d.lse_len()];
        let (mut dq, mut dqm) = (vec![0.0; d.q_len()], vec![0.0; d.q_len()]);
        let (mut dk, mut dkm) = (vec![0.0; d.kv_len()], vec![0.0; d.kv_len()]);
        let (mut dv, mut dvm) = (vec![0.0; d.kv_len()], vec![0.0; d.kv_len()]);
        let dotf = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
        let absdot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x * y).abs()).sum::<f64>();
        for b in 0..d.batch {
            for hh in 0..d.q_heads {
                let kv = (b * d.kv_heads + hh / d.group()) * d.seq_kv;
                for i in 0..d.seq_q {
                    let row = (b * d.q_heads + hh) * d.seq_q + i;
                    let n = d.key_end(i);
                    if n == 0 {
                        continue;
                    }
                    let qi = &q[row * hd..(row + 1) * hd];
                    let (oi, doi) = (&out_used[row * hd..(row + 1) * hd], &dout[row * hd..(row + 1) * hd]);
                    let kj = |j: usize| &k[(kv + j) * hd..(kv + j + 1) * hd];
                    let vj = |j: usize| &v[(kv + j) * hd..(kv + j + 1) * hd];
                    let s: Vec<f64> = (0..n).map(|j| d.scale * dotf(qi, kj(j))).collect();
                    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                    lse[row] = mx + z.ln();
                    let p: Vec<f64> = s.iter().map(|x| (x - lse[row]).exp()).collect();
                    let di = dotf(doi, oi);
                    for j in 0..n {
                        let dp = dotf(doi, vj(j));
                        let ds = p[j] * (dp - di) * d.scale;
                        // A bound on |ds| that does not cancel.
                        let ds_mag = p[j] * (absdot(doi, vj(j)) + di.abs()) * d.scale;
                        for e in 0..hd {
                            o[row * hd + e] += p[j] * vj(j)[e];
                            om[row * hd + e] += p[j] * vj(j)[e].abs();
                            dv[(kv + j) * hd + e] += p[j] * doi[e];
                            dvm[(kv + j) * hd + e] += p[j] * doi[e].abs();
                            dk[(kv + j) * hd + e] += ds * qi[e];
                            dkm[(kv + j) * hd + e] += ds_mag * qi[e].abs();
                            dq[row * hd + e] += ds * kj(j)[e];
                            dqm[row * hd + e] += ds_mag * kj(j)[e].abs();
                        }
                    }
                }
            }
        }
        let lm = lse.iter().map(|_| 1.0).collect();
        [(o, om), (lse, lm), (dq, dqm), (dk, dkm), (dv, dvm)]
    }

    /// `|got - exact| <= rel · magnitude (+ abs)` element-wise.
    #[track_caller]
    fn within(got: &[f64], exact: &[f64], mag: &[f64], rel: f64, abs: f64, what: &str) {
        for (i, ((g, e), m)) in got.iter().zip(exact).zip(mag).enumerate() {
            let ok = if e.is_finite() { (g - e).abs() <= rel * m + abs } else { g == e };
            assert!(ok, "{what}: element {i}: got {g}, exact {e}, bound {}", rel * m + abs);
        }
    }

    /// The error bounds, element by element. Each product in the tiles is
    /// exact in f32 and each sum adds at most `hd·2^-24` (relative to the
    /// sum of magnitudes) to the scores and `dP`, far below `2^-10` here;
    /// what is left is one bf16 rounding (`2^-8`) of each probability or
    /// score gradient before it multiplies, and one of the result:
    /// `|error| <= (2^-7 + 2^-10) · Σ |terms|`, with `Σ |terms|` summing
    /// `p·|v|` (output), `p·|dO|` (dV), and `|dS|·|q|`, `|dS|·|k|` (dK,
    /// dQ) with `|dS|` bounded without cancellation by
    /// `p·(Σ|dO||v| + |D|)·scale`. The log-sum-exp is f32 all the way:
    /// within `1e-4` (score sums of bf16 inputs up to 2 in magnitude).
    fn check(d: &AttnDims, seed: u64, packed: bool) {
        let rel = 2f64.powi(-7) + 2f64.powi(-10);
        let (q, k, v, qkv_all) = if packed {
            // One fused buffer; split it into per-head tensors for the reference.
            let all = h(&rand_vec(seed, d.packed_len()).iter().map(|x| 2.0 * x).collect::<Vec<_>>());
            let lay = Layout::packed(d);
            let (mut q, mut k, mut v) = (vec![bf16::ZERO; d.q_len()], vec![bf16::ZERO; d.kv_len()], vec![bf16::ZERO; d.kv_len()]);
            let hd = d.head_dim;
            for b in 0..d.batch {
                for t in 0..d.seq_q {
                    for hh in 0..d.q_heads {
                        let dst = ((b * d.q_heads + hh) * d.seq_q + t) * hd;
                        q[dst..dst + hd].copy_from_slice(&all[lay.q.at(d.group(), b, hh, t)..][..hd]);
                    }
                    for g in 0..d.kv_heads {
                        let dst = ((b * d.kv_heads + g) * d.seq_kv + t) * hd;
                        k[dst..dst + hd].copy_from_slice(&all[lay.k.at(1, b, g, t)..][..hd]);
                        v[dst..dst + hd].copy_from_slice(&all[lay.v.at(1, b, g, t)..][..hd]);
                    }
                }
            }
            (q, k, v, Some(all))
        } else {
            let (q, k, v) = qkv(d, seed);
            (h(&q), h(&k), h(&v), None)
        };
        let dout_heads = h(&rand_vec(seed + 5, d.q_len()));
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (mut out, mut lse) = (vec![bf16::ZERO; d.q_len()], vec![0f32; d.lse_len()]);
                let (mut dq, mut dk, mut dv) = (vec![bf16::ZERO; d.q_len()], vec![bf16::ZERO; d.kv_len()], vec![bf16::ZERO; d.kv_len()]);
                match &qkv_all {
                    None => {
                        attention_forward_bf16(d, &q, &k, &v, &mut out, &mut lse);
                        attention_backward_bf16(d, &q, &k, &v, &out, &lse, &dout_heads, &mut dq, &mut dk, &mut dv);
                    }
                    Some(all) => {
                        // The packed output is [batch, seq, heads, hd]: reorder
                        // dout into it and the results back to per-head order.
                        let (lay, hd) = (Layout::packed(d), d.head_dim);
                        let per_head = |b: usize, hh: usize, t: usize| ((b * d.q_heads + hh) * d.seq_q + t) * hd;
                        let mut dout_p = vec![bf16::ZERO; d.q_len()];
                        let mut out_p = vec![bf16::ZERO; d.q_len()];
                        for (b, hh, t) in (0..d.batch).flat_map(|b| (0..d.q_heads).flat_map(move |hh| (0..d.seq_q).map(move |t| (b, hh, t)))) {
                            let at = lay.o.at(d.group(), b, hh, t);
                            dout_p[at..at + hd].copy_from_slice(&dout_heads[per_head(b, hh, t)..][..hd]);
                        }
                        attention_forward_packed_bf16(d, all, &mut out_p, &mut lse);
                        let mut g = vec![bf16::ZERO; d.packed_len()];
                        attention_backward_packed_bf16(d, all, &out_p, &lse, &dout_p, &mut g);
                        for (b, t) in (0..d.batch).flat_map(|b| (0..d.seq_q).map(move |t| (b, t))) {
                            for hh in 0..d.q_heads {
                                let at = lay.o.at(d.group(), b, hh, t);
                                out[per_head(b, hh, t)..][..hd].copy_from_slice(&out_p[at..at + hd]);
                                dq[per_head(b, hh, t)..][..hd].copy_from_slice(&g[lay.q.at(d.group(), b, hh, t)..][..hd]);
                            }
                            for gg in 0..d.kv_heads {
                                let dst = ((b * d.kv_heads + gg) * d.seq_kv + t) * hd;
                                dk[dst..dst + hd].copy_from_slice(&g[lay.k.at(1, b, gg, t)..][..hd]);
                                dv[dst..dst + hd].copy_from_slice(&g[lay.v.at(1, b, gg, t)..][..hd]);
                            }
                        }
                    }
                }
                (out, lse, dq, dk, dv)
            })
        };
        let (out, lse, dq, dk, dv) = run(1);
        let [(o_e, o_m), (lse_e, _), (dq_e, dq_m), (dk_e, dk_m), (dv_e, dv_m)] = reference(d, &w(&q), &w(&k), &w(&v), &w(&out), &w(&dout_heads));
        let what = format!("{d:?} packed={packed}");
        within(&w(&out), &o_e, &o_m, rel, 0.0, &format!("out {what}"));
        let lse64: Vec<f64> = lse.iter().map(|&x| x as f64).collect();
        within(&lse64, &lse_e, &vec![0.0; lse_e.len()], 0.0, 1e-4, &format!("lse {what}"));
        within(&w(&dq), &dq_e, &dq_m, rel, 0.0, &format!("dq {what}"));
        within(&w(&dk), &dk_e, &dk_m, rel, 0.0, &format!("dk {what}"));
        within(&w(&dv), &dv_e, &dv_m, rel, 0.0, &format!("dv {what}"));
        // The same bits whatever the number of threads.
        let other = run(3);
        let bits = |x: &[bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!((bits(&out), bits(&dq), bits(&dk), bits(&dv)), (bits(&other.0), bits(&other.2), bits(&other.3), bits(&other.4)), "threads {what}");
        assert_eq!(lse, other.1, "lse threads {what}");
    }

    #[test]
    fn bf16_dot_products_stay_within_the_rounding_bounds() {
        if !available() {
            return;
        }
        // (batch, q_heads, kv_heads, seq_q, seq_kv, head_dim, causal): grouped
        // heads, blocks with a partial last one, an odd head size, queries that
        // see no key (seq_q > seq_kv), no mask, a single position.
        for (seed, (b, qh, kvh, sq, skv, hd, causal)) in
            [(2, 4, 2, 150, 150, 16, true), (1, 2, 1, 70, 200, 5, true), (1, 3, 3, 65, 65, 64, false), (1, 2, 1, 9, 4, 3, true), (2, 2, 1, 1, 1, 7, false)]
                .into_iter()
                .enumerate()
        {
            check(&dims(b, qh, kvh, sq, skv, hd, causal), 60 + 10 * seed as u64, false);
        }
        check(&dims(2, 6, 3, 130, 130, 8, true), 90, true);
        check(&dims(1, 2, 2, 64, 64, 64, true), 91, true);
    }
}
