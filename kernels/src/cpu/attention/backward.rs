//! Backward pass, recomputing probabilities tile by tile from `q`, `k` and the
//! forward's `lse`.
//!
//! With `P = exp(scale·Q·Kᵀ − lse)`, `dP = dO·Vᵀ`, `D_i = rowsum(dO_i ∘ O_i)`
//! and `dS = P ∘ (dP − D)`:
//!   `dV = Pᵀ·dO`, `dK = scale·dSᵀ·Q`, `dQ = scale·dS·K`.
//!
//! Parallel schedule, chosen for determinism without atomics: `dk`/`dv` and
//! `dq` come from two separate passes.
//! - Pass 1 gives each (batch, kv head, kv block) to one task, which owns that
//!   block's rows of `dk` and `dv` and loops over every query head of its group
//!   and every query block that sees the kv block, in a fixed order.
//! - Pass 2 gives each (batch, query head, query block) to one task, which
//!   owns those rows of `dq` and loops over the visible kv blocks in order.
//!
//! No output element is written by two tasks and every sum runs in index
//! order, so results are bit-identical for any thread count. The price is
//! recomputing `S` and `dP` in both passes (7 tile products instead of 5).
//!
//! When there are at least [`FUSED_TASKS_PER_THREAD`] (batch, kv head) pairs
//! per thread (gpt-tiny training: 48 for 2 threads), a fused schedule runs
//! instead: one task per pair, owning its rows of `dk`, `dv` and its group's
//! `dq`, forms each tile once. It is not used with fewer pairs (one, for a
//! single sequence with multi-query attention), where it would starve the
//! pool. Both schedules sum every output in the same order, so the choice,
//! which depends on the thread count, never shows in the results.

use super::exp::{exp_minus, exp_minus_each};
use super::layout::{Layout, SharedOut};
use super::tile::{dot, matmul_tile, transpose_scaled};
use super::{AttnDims, BLOCK_KV, BLOCK_Q, PARALLEL_MIN_WORK};
use crate::cpu::mixed::Stored;
use crate::Real;
use rayon::prelude::*;

/// Per-thread working set, `O(BLOCK_Q·BLOCK_KV + (BLOCK_Q + BLOCK_KV)·head_dim)`.
struct Scratch<T> {
    /// Pass 1: scaled queryᵀ `[head_dim, BLOCK_Q]`; pass 2: scaled queries `[BLOCK_Q, head_dim]`.
    qs: Vec<T>,
    /// Pass 1: dOᵀ `[head_dim, BLOCK_Q]`; pass 2: Vᵀ `[head_dim, BLOCK_KV]`.
    t1: Vec<T>,
    /// Pass 2: Kᵀ `[head_dim, BLOCK_KV]`.
    t2: Vec<T>,
    /// Probabilities, then `dS` (transposed in pass 1), `BLOCK_Q·BLOCK_KV`.
    p: Vec<T>,
    /// `dP` (transposed in pass 1), `BLOCK_Q·BLOCK_KV`.
    dp: Vec<T>,
    /// Fused schedule: `dS` transposed back from pass 1's `dSᵀ`, `BLOCK_Q·BLOCK_KV`.
    ds: Vec<T>,
}

impl<T: Real> Scratch<T> {
    fn new(hd: usize) -> Self {
        let panel = hd * BLOCK_Q.max(BLOCK_KV);
        Self {
            qs: vec![T::zero(); panel],
            t1: vec![T::zero(); panel],
            t2: vec![T::zero(); panel],
            p: vec![T::zero(); BLOCK_Q * BLOCK_KV],
            dp: vec![T::zero(); BLOCK_Q * BLOCK_KV],
            ds: vec![T::zero(); BLOCK_Q * BLOCK_KV],
        }
    }
}

/// Gradient rows a task accumulates before writing them out (the fused
/// schedule's whole (batch, kv head) group, or one block in the two passes),
/// and the fused schedule's contiguous copies of its inputs.
struct Acc<T> {
    dq: Vec<T>,
    dk: Vec<T>,
    dv: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    q: Vec<T>,
    dout: Vec<T>,
}

impl<T: Real> Acc<T> {
    fn new() -> Self {
        Acc { dq: Vec::new(), dk: Vec::new(), dv: Vec::new(), k: Vec::new(), v: Vec::new(), q: Vec::new(), dout: Vec::new() }
    }
}

/// `rows` rows of `hd` from `src`, the first at `start` and each `ld` after
/// the last, back to back: the rows themselves when they already are,
/// otherwise a copy in `buf`. A fused layout's rows lie a whole position
/// apart (and so on separate pages), which the tile loops that re-read every
/// row many times would pay for on each pass.
fn contiguous_rows<'a, T: Real, S: Stored<T>>(buf: &'a mut Vec<T>, src: &'a [S], start: usize, ld: usize, rows: usize, hd: usize) -> &'a [T] {
    match S::as_compute(src) {
        Some(src) if ld == hd => &src[start..start + rows * hd],
        _ => {
            buf.clear();
            for t in 0..rows {
                buf.extend(src[start + t * ld..start + t * ld + hd].iter().map(|&x| x.load()));
            }
            buf
        }
    }
}

/// `rows` rows of `hd` from `src`, the first at `start` and each `ld` after
/// the last, as a block of the compute type: in place (rows still `ld`
/// apart) when they already are of it, otherwise widened into `buf` (rows
/// back to back). Either way a tile product reads the same values.
fn rows_in_place<'a, T: Real, S: Stored<T>>(buf: &'a mut Vec<T>, src: &'a [S], start: usize, ld: usize, rows: usize, hd: usize) -> Block<'a, T> {
    match S::as_compute(src) {
        Some(src) => Block { data: &src[start..], rows, ld },
        None => Block { data: contiguous_rows(buf, src, start, ld, rows, hd), rows, ld: hd },
    }
}

/// Zeros `buf` to `len` elements (growing it on first use) and returns them.
fn zeroed<T: Real>(buf: &mut Vec<T>, len: usize) -> &mut [T] {
    buf.clear();
    buf.resize(len, T::zero());
    buf
}

/// Everything both passes read (`q`, `k`, `v`, `dout` in their storage type `S`).
struct Inputs<'a, T, S> {
    d: &'a AttnDims,
    lay: Layout,
    q: &'a [S],
    k: &'a [S],
    v: &'a [S],
    lse: &'a [T],
    dout: &'a [S],
    /// `D_i = rowsum(dout_i ∘ out_i)`, laid out like `lse`.
    delta: &'a [T],
}

impl<T, S> Inputs<'_, T, S> {
    /// Offset of position `t` of query head `h` in batch `b` in `q` (and `dq`).
    fn q_at(&self, b: usize, h: usize, t: usize) -> usize {
        self.lay.q.at(self.d.group(), b, h, t)
    }

    /// Offset of position `t` of query head `h` in batch `b` in `dout` (and `out`).
    fn o_at(&self, b: usize, h: usize, t: usize) -> usize {
        self.lay.o.at(self.d.group(), b, h, t)
    }
}

/// Where the three gradients go (one buffer for the packed layout).
#[derive(Clone, Copy)]
struct Grads<T> {
    dq: SharedOut<T>,
    dk: SharedOut<T>,
    dv: SharedOut<T>,
}

/// Fused attention backward on separate per-head tensors (see [`AttnDims`]
/// for layouts and masking).
///
/// `out` and `lse` are what [`attention_forward`](super::attention_forward)
/// produced for the same `q`, `k`, `v`; `dout` is the gradient of the loss
/// with respect to `out`. Overwrites `dq` (layout of `q`), `dk` and `dv`
/// (layout of `k`). With grouped-query heads, `dk`/`dv` of a kv head sum the
/// contributions of every query head that reads it. Queries that see no key
/// contribute nothing and get `dq = 0`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<T: Real, S: Stored<T>>(
    d: &AttnDims,
    q: &[S],
    k: &[S],
    v: &[S],
    out: &[S],
    lse: &[T],
    dout: &[S],
    dq: &mut [S],
    dk: &mut [S],
    dv: &mut [S],
) {
    d.check();
    assert_eq!(q.len(), d.q_len(), "attention_backward: q length");
    assert_eq!(k.len(), d.kv_len(), "attention_backward: k length");
    assert_eq!(v.len(), d.kv_len(), "attention_backward: v length");
    assert_eq!(out.len(), d.q_len(), "attention_backward: out length");
    assert_eq!(dout.len(), d.q_len(), "attention_backward: dout length");
    assert_eq!(dq.len(), d.q_len(), "attention_backward: dq length");
    assert_eq!(dk.len(), d.kv_len(), "attention_backward: dk length");
    assert_eq!(dv.len(), d.kv_len(), "attention_backward: dv length");
    let grads = Grads { dq: SharedOut::new(dq), dk: SharedOut::new(dk), dv: SharedOut::new(dv) };
    backward(d, Layout::heads(d), q, k, v, out, lse, dout, grads);
}

/// [`attention_backward`] in the fused layout of
/// [`attention_forward_packed`](super::attention_forward_packed): reads `qkv`,
/// `out` and `dout` in place and writes `dq`, `dk` and `dv` into `dqkv`
/// (laid out like `qkv`). Bit-identical to [`attention_backward`] on the same
/// values.
///
/// Both accept operands stored as bf16 while computing in f32 (`S = bf16`,
/// `T = f32`): the same bits as the f32 kernel on the widened operands with
/// its gradients rounded, without the widened copies (see
/// [`attention_forward_packed`](super::attention_forward_packed)).
pub fn attention_backward_packed<T: Real, S: Stored<T>>(d: &AttnDims, qkv: &[S], out: &[S], lse: &[T], dout: &[S], dqkv: &mut [S]) {
    d.check();
    assert_eq!(d.seq_q, d.seq_kv, "attention_backward_packed: self-attention needs seq_q == seq_kv");
    assert_eq!(qkv.len(), d.packed_len(), "attention_backward_packed: qkv length");
    assert_eq!(out.len(), d.q_len(), "attention_backward_packed: out length");
    assert_eq!(dout.len(), d.q_len(), "attention_backward_packed: dout length");
    assert_eq!(dqkv.len(), d.packed_len(), "attention_backward_packed: dqkv length");
    let g = SharedOut::new(dqkv);
    backward(d, Layout::packed(d), qkv, qkv, qkv, out, lse, dout, Grads { dq: g, dk: g, dv: g });
}

#[allow(clippy::too_many_arguments)]
fn backward<T: Real, S: Stored<T>>(d: &AttnDims, lay: Layout, q: &[S], k: &[S], v: &[S], out: &[S], lse: &[T], dout: &[S], grads: Grads<S>) {
    assert_eq!(lse.len(), d.lse_len(), "attention_backward: lse length");
    let hd = d.head_dim;
    let parallel = d.work() >= PARALLEL_MIN_WORK;

    let mut delta = vec![T::zero(); d.lse_len()];
    let row_delta = |(i, di): (usize, &mut T)| {
        let (bh, t) = (i / d.seq_q.max(1), i % d.seq_q.max(1));
        let o = lay.o.at(d.group(), bh / d.q_heads, bh % d.q_heads, t);
        *di = dot(&dout[o..o + hd], &out[o..o + hd])
    };
    if parallel {
        delta.par_iter_mut().enumerate().for_each(row_delta);
    } else {
        delta.iter_mut().enumerate().for_each(row_delta);
    }
    let inp = Inputs { d, lay, q, k, v, lse, dout, delta: &delta };

    // Enough kv heads to keep every thread busy: one fused pass, which forms
    // each tile once (5 products) instead of once per pass (7).
    if !parallel || d.batch * d.kv_heads >= FUSED_TASKS_PER_THREAD * rayon::current_num_threads() {
        fused(&inp, grads, parallel);
        return;
    }

    let pass = |tasks: Vec<Task>| tasks.into_par_iter().for_each_init(|| (Scratch::new(hd), Acc::new()), |(s, a), t| run_task(&inp, t, grads, s, a));
    // Pass 1: dk, dv, one task per (batch, kv head, kv block).
    pass(
        (0..d.batch * d.kv_heads)
            .flat_map(|bg| (0..d.seq_kv).step_by(BLOCK_KV).map(move |j0| Task::Dkv { b: bg / d.kv_heads, g: bg % d.kv_heads, j0 }))
            .collect(),
    );
    // Pass 2: dq, one task per (batch, query head, query block).
    pass((0..d.batch * d.q_heads).flat_map(|bh| (0..d.seq_q).step_by(BLOCK_Q).map(move |i0| Task::Dq { b: bh / d.q_heads, h: bh % d.q_heads, i0 })).collect());
}

/// One task of either schedule.
#[derive(Clone, Copy)]
enum Task {
    /// Fused: every gradient of kv head `g` in batch `b` and of its query heads.
    Group { b: usize, g: usize },
    /// Pass 1: `dk`, `dv` of the kv block at `j0`.
    Dkv { b: usize, g: usize, j0: usize },
    /// Pass 2: `dq` of the query block at `i0` of head `h`.
    Dq { b: usize, h: usize, i0: usize },
}

/// Runs `task`, in a copy compiled for AVX-512 when the CPU has it: the
/// element-wise loops between the tile products (`exp`, `dS`) then run
/// sixteen lanes wide instead of the baseline's four. No multiply-adds are
/// contracted, so the bits are the same as the baseline copy's.
fn run_task<T: Real, S: Stored<T>>(inp: &Inputs<'_, T, S>, task: Task, grads: Grads<S>, s: &mut Scratch<T>, a: &mut Acc<T>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the running CPU supports AVX-512F (just checked).
        return unsafe { run_task_avx512(inp, task, grads, s, a) };
    }
    run_task_inline(inp, task, grads, s, a)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn run_task_avx512<T: Real, S: Stored<T>>(inp: &Inputs<'_, T, S>, task: Task, grads: Grads<S>, s: &mut Scratch<T>, a: &mut Acc<T>) {
    run_task_inline(inp, task, grads, s, a)
}

#[inline(always)]
fn run_task_inline<T: Real, S: Stored<T>>(inp: &Inputs<'_, T, S>, task: Task, grads: Grads<S>, s: &mut Scratch<T>, a: &mut Acc<T>) {
    match task {
        Task::Group { b, g } => group_block(inp, b, g, grads, s, a),
        Task::Dkv { b, g, j0 } => dkv_block(inp, b, g, j0, grads, s, a),
        Task::Dq { b, h, i0 } => dq_block(inp, b, h, i0, grads, s, a),
    }
}

/// The fused schedule needs this many (batch, kv head) tasks per thread: the
/// tasks are equal in size, so a few per thread already balance the pool.
const FUSED_TASKS_PER_THREAD: usize = 4;

/// All of `dq`, `dk` and `dv` in one pass, one task per (batch, kv head).
fn fused<T: Real, S: Stored<T>>(inp: &Inputs<'_, T, S>, grads: Grads<S>, parallel: bool) {
    let d = inp.d;
    let hd = d.head_dim;
    let run = |(s, a): &mut (Scratch<T>, Acc<T>), bg: usize| run_task(inp, Task::Group { b: bg / d.kv_heads, g: bg % d.kv_heads }, grads, s, a);
    if parallel {
        (0..d.batch * d.kv_heads).into_par_iter().for_each_init(|| (Scratch::new(hd), Acc::new()), run);
    } else {
        let mut sa = (Scratch::new(hd), Acc::new());
        (0..d.batch * d.kv_heads).for_each(|bg| run(&mut sa, bg));
    }
}

/// Writes `rows` rows of `head_dim` from `src` to `out`, row `t` of them at
/// `at(t)`.
///
/// # Safety
/// The caller must be the only task writing those rows, and the buffer behind
/// `out` must outlive the call (see [`SharedOut::write_stored`]).
unsafe fn store<T: Real, S: Stored<T>>(out: SharedOut<S>, src: &[T], hd: usize, at: impl Fn(usize) -> usize) {
    for (t, row) in src.chunks_exact(hd).enumerate() {
        out.write_stored(at(t), row);
    }
}

/// Every gradient of kv head `g` in batch `b` and of its group of query heads.
///
/// Runs the tiles of both passes of the two-pass schedule in an order that
/// keeps each output's sum in the same order as there (`dk`/`dv` rows over
/// query heads, then query blocks; `dq` rows over kv blocks), with `dS` of
/// each tile transposed back from pass 1's `dSᵀ`, so the results are
/// bit-identical whichever schedule runs.
#[inline(always)]
fn group_block<T: Real, S: Stored<T>>(inp: &Inputs<'_, T, S>, b: usize, g: usize, grads: Grads<S>, s: &mut Scratch<T>, acc: &mut Acc<T>) {
    let d = inp.d;
    let (hd, r) = (d.head_dim, d.group());
    let scale = T::lit(d.scale);
    let Acc { dq: dq_all, dk, dv, k, v, q, dout } = acc;
    let k = contiguous_rows(k, inp.k, inp.lay.k.at(1, b, g, 0), inp.lay.k.row(), d.seq_kv, hd);
    let v = contiguous_rows(v, inp.v, inp.lay.v.at(1, b, g, 0), inp.lay.v.row(), d.seq_kv, hd);
    let dq_all = zeroed(dq_all, r * d.seq_q * hd);
    let dk = zeroed(dk, d.seq_kv * hd);
    let dv = zeroed(dv, d.seq_kv * hd);
    for (hi, dq) in dq_all.chunks_mut(d.seq_q * hd).enumerate() {
        let h = g * r + hi;
        let bh = b * d.q_heads + h;
        for (qb, dq) in dq.chunks_mut(BLOCK_Q * hd).enumerate() {
            let i0 = qb * BLOCK_Q;
            let bq = dq.len() / hd;
            let row0 = bh * d.seq_q + i0;
            let q_blk = contiguous_rows(q, inp.q, inp.q_at(b, h, i0), inp.lay.q.row(), bq, hd);
            let do_blk = contiguous_rows(dout, inp.dout, inp.o_at(b, h, i0), inp.lay.o.row(), bq, hd);
            transpose_scaled(q_blk, bq, hd, hd, scale, &mut s.qs);
            transpose_scaled(do_blk, bq, hd, hd, T::one(), &mut s.t1);
            let qb = Block { data: q_blk, rows: bq, ld: hd };
            let ob = Block { data: do_blk, rows: bq, ld: hd };
            // Kv blocks stay aligned to BLOCK_KV, as in pass 1.
            for j0 in (0..d.key_end(i0 + bq - 1)).step_by(BLOCK_KV) {
                let bk = BLOCK_KV.min(d.seq_kv - j0);
                let rows = j0 * hd..(j0 + bk) * hd;
                let kb = Block { data: &k[rows.clone()], rows: bk, ld: hd };
                let vb = Block { data: &v[rows.clone()], rows: bk, ld: hd };
                dkv_tile(inp, j0, kb, vb, i0, row0, qb, ob, &mut dk[rows.clone()], &mut dv[rows.clone()], s);
                transpose_scaled(&s.p[..bk * bq], bk, bq, bq, T::one(), &mut s.ds);
                matmul_tile(bq, hd, bk, &s.ds, bk, kb.data, hd, dq, hd, true);
            }
        }
    }
    // SAFETY: this task is the only one computing the gradients of kv head
    // `g` in batch `b` and of its query heads; their rows are disjoint from
    // every other task's, and the caller keeps the buffers borrowed.
    unsafe {
        for (hi, dq) in dq_all.chunks_exact(d.seq_q * hd).enumerate() {
            store(grads.dq, dq, hd, |t| inp.q_at(b, g * r + hi, t));
        }
        store(grads.dk, dk, hd, |t| inp.lay.k.at(1, b, g, t));
        store(grads.dv, dv, hd, |t| inp.lay.v.at(1, b, g, t));
    }
}

/// `rows` rows of a tensor starting at `data[0]`, `ld` elements apart.
#[derive(Clone, Copy)]
struct Block<'a, T> {
    data: &'a [T],
    rows: usize,
    ld: usize,
}

/// Gradients of kv rows `j0..j0 + BLOCK_KV` (or to the end) of kv head `g`
/// in batch `b`.
///
/// Works on transposed tiles (`Sᵀ = K·(scale·Q)ᵀ`, `[kv rows, q rows]`) so
/// that `Pᵀ` and `dSᵀ` come out in the row-major form the products
/// `dV += Pᵀ·dO` and `dK += dSᵀ·Q` consume.
#[inline(always)]
fn dkv_block<T: Real, S: Stored<T>>(inp: &Inputs<'_, T, S>, b: usize, g: usize, j0: usize, grads: Grads<S>, s: &mut Scratch<T>, acc: &mut Acc<T>) {
    let d = inp.d;
    let hd = d.head_dim;
    let bk = BLOCK_KV.min(d.seq_kv - j0);
    let scale = T::lit(d.scale);
    let Acc { dk, dv, k, v, q, dout, .. } = acc;
    let kb = rows_in_place(k, inp.k, inp.lay.k.at(1, b, g, j0), inp.lay.k.row(), bk, hd);
    let vb = rows_in_place(v, inp.v, inp.lay.v.at(1, b, g, j0), inp.lay.v.row(), bk, hd);
    let dk = zeroed(dk, bk * hd);
    let dv = zeroed(dv, bk * hd);

    // Query blocks stay aligned to BLOCK_Q, as in the forward and in pass 2.
    let first_block = d.first_query(j0) / BLOCK_Q * BLOCK_Q;
    for h in g * d.group()..(g + 1) * d.group() {
        let bh = b * d.q_heads + h;
        for i0 in (first_block..d.seq_q).step_by(BLOCK_Q) {
            let bq = BLOCK_Q.min(d.seq_q - i0);
            let qb = rows_in_place(q, inp.q, inp.q_at(b, h, i0), inp.lay.q.row(), bq, hd);
            let ob = rows_in_place(dout, inp.dout, inp.o_at(b, h, i0), inp.lay.o.row(), bq, hd);
            transpose_scaled(qb.data, bq, hd, qb.ld, scale, &mut s.qs);
            transpose_scaled(ob.data, bq, hd, ob.ld, T::one(), &mut s.t1);
            dkv_tile(inp, j0, kb, vb, i0, bh * d.seq_q + i0, qb, ob, dk, dv, s);
        }
    }
    // SAFETY: this task alone computes kv rows `j0..j0 + bk` of kv head `g`
    // in batch `b`; the caller keeps the buffers borrowed.
    unsafe {
        store(grads.dk, dk, hd, |t| inp.lay.k.at(1, b, g, j0 + t));
        store(grads.dv, dv, hd, |t| inp.lay.v.at(1, b, g, j0 + t));
    }
}

/// One (kv block, query block) tile of pass 1: adds its contributions to the
/// kv block's `dk` and `dv` rows (contiguous, `head_dim` apart) and leaves
/// `dSᵀ` (`[bk, bq]`) in `s.p`.
///
/// Expects `s.qs` = (scale·Q)ᵀ and `s.t1` = dOᵀ of the query block starting
/// at position `i0` (row `row0` of the `lse` layout), and kv rows starting at
/// position `j0`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn dkv_tile<T: Real, S: Stored<T>>(
    inp: &Inputs<'_, T, S>,
    j0: usize,
    kb: Block<'_, T>,
    vb: Block<'_, T>,
    i0: usize,
    row0: usize,
    qb: Block<'_, T>,
    ob: Block<'_, T>,
    dk: &mut [T],
    dv: &mut [T],
    s: &mut Scratch<T>,
) {
    let d = inp.d;
    let hd = d.head_dim;
    let (bk, bq) = (kb.rows, qb.rows);
    let scale = T::lit(d.scale);
    let lse = &inp.lse[row0..row0 + bq];
    let delta = &inp.delta[row0..row0 + bq];
    let pt = &mut s.p[..bk * bq];
    matmul_tile(bk, bq, hd, kb.data, kb.ld, &s.qs, bq, pt, bq, false);
    let needs_mask = d.causal && d.key_end(i0) < j0 + bk;
    for (j, row) in pt.chunks_exact_mut(bq).enumerate() {
        // Queries before `first` are masked from key j0 + j.
        let first = if needs_mask { d.first_query(j0 + j).saturating_sub(i0).min(bq) } else { 0 };
        row[..first].fill(T::zero());
        exp_minus_each(&mut row[first..], &lse[first..]);
    }
    matmul_tile(bk, hd, bq, pt, bq, ob.data, ob.ld, dv, hd, true);

    let dpt = &mut s.dp[..bk * bq];
    matmul_tile(bk, bq, hd, vb.data, vb.ld, &s.t1, bq, dpt, bq, false);
    for (prow, dprow) in pt.chunks_exact_mut(bq).zip(dpt.chunks_exact(bq)) {
        for ((p, &dp), &di) in prow.iter_mut().zip(dprow).zip(delta) {
            *p = *p * (dp - di) * scale;
        }
    }
    matmul_tile(bk, hd, bq, pt, bq, qb.data, qb.ld, dk, hd, true);
}

/// Gradient of query rows `i0..i0 + BLOCK_Q` (or to the end) of query head
/// `h` in batch `b`.
#[inline(always)]
fn dq_block<T: Real, S: Stored<T>>(inp: &Inputs<'_, T, S>, b: usize, h: usize, i0: usize, grads: Grads<S>, s: &mut Scratch<T>, acc: &mut Acc<T>) {
    let d = inp.d;
    let hd = d.head_dim;
    let bq = BLOCK_Q.min(d.seq_q - i0);
    let scale = T::lit(d.scale);
    let rows = (b * d.q_heads + h) * d.seq_q + i0..(b * d.q_heads + h) * d.seq_q + i0 + bq;
    let (q_ld, o_ld, k_ld, v_ld) = (inp.lay.q.row(), inp.lay.o.row(), inp.lay.k.row(), inp.lay.v.row());
    let q_blk = &inp.q[inp.q_at(b, h, i0)..];
    let ob = rows_in_place(&mut acc.dout, inp.dout, inp.o_at(b, h, i0), o_ld, bq, hd);
    let (do_blk, o_ld) = (ob.data, ob.ld);
    let lse = &inp.lse[rows.clone()];
    let delta = &inp.delta[rows];
    let g = h / d.group();
    for (r, dst) in s.qs[..bq * hd].chunks_exact_mut(hd).enumerate() {
        for (dst, &x) in dst.iter_mut().zip(&q_blk[r * q_ld..r * q_ld + hd]) {
            *dst = x.load() * scale;
        }
    }
    let dq = zeroed(&mut acc.dq, bq * hd);

    let kend = d.key_end(i0 + bq - 1);
    for j0 in (0..kend).step_by(BLOCK_KV) {
        let bk = BLOCK_KV.min(kend - j0);
        let k_at = inp.lay.k.at(1, b, g, j0);
        let v_blk = &inp.v[inp.lay.v.at(1, b, g, j0)..];
        transpose_scaled(&inp.k[k_at..], bk, hd, k_ld, T::one(), &mut s.t2);
        transpose_scaled(v_blk, bk, hd, v_ld, T::one(), &mut s.t1);
        let kb = rows_in_place(&mut acc.k, inp.k, k_at, k_ld, bk, hd);

        let p = &mut s.p[..bq * bk];
        matmul_tile(bq, bk, hd, &s.qs, hd, &s.t2, bk, p, bk, false);
        let needs_mask = d.causal && d.key_end(i0) < j0 + bk;
        for (r, row) in p.chunks_exact_mut(bk).enumerate() {
            let visible = if needs_mask { d.key_end(i0 + r).saturating_sub(j0).min(bk) } else { bk };
            exp_minus(&mut row[..visible], lse[r]);
            row[visible..].fill(T::zero());
        }

        let dp = &mut s.dp[..bq * bk];
        matmul_tile(bq, bk, hd, do_blk, o_ld, &s.t1, bk, dp, bk, false);
        for ((prow, dprow), &di) in p.chunks_exact_mut(bk).zip(dp.chunks_exact(bk)).zip(delta) {
            for (p, &dp) in prow.iter_mut().zip(dprow) {
                *p = *p * (dp - di) * scale;
            }
        }
        matmul_tile(bq, hd, bk, p, bk, kb.data, kb.ld, dq, hd, true);
    }
    // SAFETY: this task alone computes query rows `i0..i0 + bq` of head `h`
    // in batch `b`; the caller keeps the buffer borrowed.
    unsafe { store(grads.dq, dq, hd, |t| inp.q_at(b, h, i0 + t)) };
}

#[cfg(test)]
mod tests {
    use super::super::test_inputs::{dims, qkv, to_f32, to_f64};
    use super::super::{attention_forward, AttnDims};
    use super::*;
    use crate::testing::{assert_close, dot as dot64, numeric_grad, rand_vec};

    /// Forward then backward in `T`; returns `(out, dq, dk, dv)`.
    #[allow(clippy::type_complexity)]
    fn fwd_bwd<T: Real>(d: &AttnDims, q: &[T], k: &[T], v: &[T], dout: &[T]) -> (Vec<T>, Vec<T>, Vec<T>, Vec<T>) {
        let mut out = vec![T::nan(); d.q_len()];
        let mut lse = vec![T::nan(); d.lse_len()];
        attention_forward(d, q, k, v, &mut out, &mut lse);
        let mut dq = vec![T::nan(); d.q_len()];
        let mut dk = vec![T::nan(); d.kv_len()];
        let mut dv = vec![T::nan(); d.kv_len()];
        attention_backward(d, q, k, v, &out, &lse, dout, &mut dq, &mut dk, &mut dv);
        (out, dq, dk, dv)
    }

    fn check_finite_differences(d: &AttnDims, seed: u64) {
        let (q, k, v) = qkv(d, seed);
        let dout = rand_vec(seed + 7, d.q_len());
        let (_, dq, dk, dv) = fwd_bwd(d, &q, &k, &v, &dout);
        let loss = |q: &[f64], k: &[f64], v: &[f64]| {
            let mut out = vec![0.0; d.q_len()];
            let mut lse = vec![0.0; d.lse_len()];
            attention_forward(d, q, k, v, &mut out, &mut lse);
            dot64(&out, &dout)
        };
        let eps = 1e-5;
        let tag = format!("{d:?}");
        assert_close(&dq, &numeric_grad(|x| loss(x, &k, &v), &q, eps), 1e-7, 1e-6, &format!("dq {tag}"));
        assert_close(&dk, &numeric_grad(|x| loss(&q, x, &v), &k, eps), 1e-7, 1e-6, &format!("dk {tag}"));
        assert_close(&dv, &numeric_grad(|x| loss(&q, &k, x), &v, eps), 1e-7, 1e-6, &format!("dv {tag}"));
    }

    #[test]
    fn matches_finite_differences() {
        let cases = [
            // (batch, q_heads, kv_heads, seq_q, seq_kv, head_dim, causal)
            (1, 1, 1, 1, 1, 1, false),
            (1, 1, 1, 3, 3, 3, true),
            (1, 2, 1, 3, 17, 3, true),
            (3, 2, 2, 17, 17, 1, false),
            (1, 4, 1, 5, 3, 2, true), // queries 0 and 1 see no key
            (2, 4, 2, 17, 17, 3, true),
            (1, 2, 1, 3, 129, 2, false),
            (1, 1, 1, 70, 70, 1, true), // two query and kv blocks
        ];
        for (seed, &(b, qh, kvh, sq, skv, hd, causal)) in cases.iter().enumerate() {
            check_finite_differences(&dims(b, qh, kvh, sq, skv, hd, causal), 40 + 10 * seed as u64);
        }
    }

    /// The textbook backward, materialising each head's full probability matrix.
    fn naive_backward(d: &AttnDims, q: &[f64], k: &[f64], v: &[f64], dout: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let hd = d.head_dim;
        let (mut dq, mut dk, mut dv) = (vec![0.0; d.q_len()], vec![0.0; d.kv_len()], vec![0.0; d.kv_len()]);
        for b in 0..d.batch {
            for h in 0..d.q_heads {
                let kv = (b * d.kv_heads + h / (d.q_heads / d.kv_heads)) * d.seq_kv;
                for i in 0..d.seq_q {
                    let row = (b * d.q_heads + h) * d.seq_q + i;
                    let n = d.key_end(i);
                    let qi = &q[row * hd..(row + 1) * hd];
                    let doi = &dout[row * hd..(row + 1) * hd];
                    let s: Vec<f64> = (0..n).map(|j| d.scale * dot64(qi, &k[(kv + j) * hd..(kv + j + 1) * hd])).collect();
                    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                    let p: Vec<f64> = s.iter().map(|x| (x - mx).exp() / z).collect();
                    let dp: Vec<f64> = (0..n).map(|j| dot64(doi, &v[(kv + j) * hd..(kv + j + 1) * hd])).collect();
                    let pdp: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                    for j in 0..n {
                        let ds = p[j] * (dp[j] - pdp) * d.scale;
                        for e in 0..hd {
                            dv[(kv + j) * hd + e] += p[j] * doi[e];
                            dk[(kv + j) * hd + e] += ds * qi[e];
                            dq[row * hd + e] += ds * k[(kv + j) * hd + e];
                        }
                    }
                }
            }
        }
        (dq, dk, dv)
    }

    #[test]
    fn matches_naive_backward_on_a_larger_case_in_f64_and_f32() {
        for d in [dims(2, 4, 2, 150, 150, 16, true), dims(1, 4, 1, 70, 200, 8, true), dims(1, 2, 2, 100, 130, 5, false)] {
            let (q, k, v) = qkv(&d, 7);
            let dout = rand_vec(8, d.q_len());
            let (wq, wk, wv) = naive_backward(&d, &q, &k, &v, &dout);
            let (_, dq, dk, dv) = fwd_bwd(&d, &q, &k, &v, &dout);
            assert_close(&dq, &wq, 1e-11, 1e-9, "dq vs naive");
            assert_close(&dk, &wk, 1e-11, 1e-9, "dk vs naive");
            assert_close(&dv, &wv, 1e-11, 1e-9, "dv vs naive");
            let f = to_f32;
            let (_, dq, dk, dv) = fwd_bwd(&d, &f(&q), &f(&k), &f(&v), &f(&dout));
            assert_close(&to_f64(&dq), &wq, 1e-4, 1e-3, "f32 dq vs naive");
            assert_close(&to_f64(&dk), &wk, 1e-4, 1e-3, "f32 dk vs naive");
            assert_close(&to_f64(&dv), &wv, 1e-4, 1e-3, "f32 dv vs naive");
        }
    }

    #[test]
    fn huge_scores_give_finite_gradients() {
        let d = dims(1, 2, 1, 130, 130, 16, true);
        let (q, k, v) = qkv(&d, 5);
        let q: Vec<f64> = q.iter().map(|x| x * 100.0).collect();
        let dout = rand_vec(6, d.q_len());
        let (wq, wk, wv) = naive_backward(&d, &q, &k, &v, &dout);
        let (_, dq, dk, dv) = fwd_bwd(&d, &to_f32(&q), &to_f32(&k), &to_f32(&v), &to_f32(&dout));
        assert!(dq.iter().chain(&dk).chain(&dv).all(|x| x.is_finite()));
        // Near one-hot softmax: f32 score rounding (~1e-3 absolute at this
        // magnitude) moves probabilities by ~0.1%.
        let scale_of = |x: &[f64]| x.iter().fold(0.0f64, |a, b| a.max(b.abs()));
        assert_close(&to_f64(&dv), &wv, 1e-2 * scale_of(&wv), 1e-2, "huge dv");
        assert_close(&to_f64(&dk), &wk, 1e-2 * scale_of(&wk), 1e-2, "huge dk");
        assert_close(&to_f64(&dq), &wq, 1e-2 * scale_of(&wq), 1e-2, "huge dq");
    }

    #[test]
    fn bit_identical_across_runs_thread_counts_and_schedules() {
        // The first shape has one (batch, kv head) pair and always runs the
        // two-pass schedule; the others have four, so one thread runs the
        // fused schedule and two or three threads the two-pass one.
        for d in [
            dims(1, 4, 1, 200, 200, 32, true),
            dims(2, 4, 2, 150, 120, 16, true), // the first 30 queries see no key
            dims(2, 2, 2, 130, 100, 8, false),
        ] {
            assert!(d.work() >= PARALLEL_MIN_WORK);
            let (q, k, v) = qkv(&d, 3);
            let dout = to_f32(&rand_vec(4, d.q_len()));
            let (q, k, v) = (to_f32(&q), to_f32(&k), to_f32(&v));
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| fwd_bwd(&d, &q, &k, &v, &dout))
            };
            let bits = |x: &[f32]| x.iter().map(|e| e.to_bits()).collect::<Vec<_>>();
            let one = run(1);
            for threads in [2, 3, 1] {
                let other = run(threads);
                for (name, a, b) in [("dq", &one.1, &other.1), ("dk", &one.2, &other.2), ("dv", &one.3, &other.3)] {
                    assert_eq!(bits(a), bits(b), "{name} differs with {threads} threads, {d:?}");
                }
            }
        }
    }
}
