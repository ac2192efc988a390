//! Cache-blocked f32 matrix product around an AVX-512F register-tiled
//! micro-kernel, used when the CPU has AVX-512F (checked at run time).
//!
//! Blocking (Goto/BLIS scheme, with vectors running along the rows of `C`):
//! the columns are cut into blocks of at most [`NC`] and the depth into blocks
//! of at most [`KC_MAX`]; for each pair the `KC×NC` slab of `op(B)` is packed
//! once into strips of [`NR`] columns (shared by all threads, lives in L2/L3),
//! and the micro-kernel keeps an `MR×NR` tile of `C` in 24 zmm registers
//! while it streams an `MR`-row panel of `op(A)` against a strip. Each step
//! of the depth loop issues 24 FMAs against 2 vector loads and 12
//! broadcasts, so the FMA pipes, not the load ports, set the pace.
//!
//! `op(A)` is read in place, not packed: for a row-major `A` the 12
//! broadcasts of a step come from 12 rows, each walked sequentially; for a
//! transposed one (a weight gradient's `dYᵀ`) they are 12 consecutive values
//! of one stored row. The prefetchers follow either as well as a packed
//! panel, and skipping the pack saves a full pass over `A` per product. That
//! pass is what made products with a thin output (`n = 384`, a linear
//! layer's input gradient) run 10 % slower than wide ones: they pack 4× more
//! `A` per FLOP. Only a partial last panel (fewer than [`MR`] rows, where
//! reading a full panel would leave the operand) is packed, into a one-panel
//! buffer kept per thread.
//!
//! Determinism: every element of `C` is summed over the depth in the same
//! order whatever the thread count (fixed depth blocks, one FMA chain per
//! element inside a block, blocks added to `C` in index order); threads only
//! decide which disjoint tiles of `C` they own.

use rayon::prelude::*;
use std::arch::x86_64::*;
use std::cell::Cell;
use std::ops::Range;

/// Rows of a micro-tile: each is one broadcast of packed `A` per depth step.
const MR: usize = 12;
/// Columns of a micro-tile: two 16-lane vectors of packed `B`.
const NR: usize = 32;
/// Largest depth block: an `MR×KC` panel of `A` (12 KiB) plus the
/// `KC×NR` panel of `B` (32 KiB) it meets stay close to L1.
const KC_MAX: usize = 1024;
/// Rows of `A` a task walks before moving on: their `MC×KC` floats stay in
/// the 1 MiB L2 while every strip of `B` sweeps over them.
const MC: usize = 96;
/// Depth steps before the end of the micro-kernel at which the `C` tile is
/// prefetched (each step is about 24 cycles).
const PREFETCH_STEPS: usize = 24;
/// Columns of `C` per column block: the packed `KC×NC` slab of `B` is at
/// most 16 MiB.
const NC: usize = 4096;
/// Floats of slack in each packing buffer so its start can be 64-byte aligned.
const ALIGN_SLACK: usize = 16;

/// An operand seen through strides: element `(r, c)` is at `ptr[r*rs + c*cs]`.
#[derive(Clone, Copy)]
pub(super) struct View {
    pub ptr: *const f32,
    pub rs: usize,
    pub cs: usize,
}

// SAFETY: a `View` is only read, and only while the slice it was made from is
// borrowed by the caller of `gemm_f32`.
unsafe impl Send for View {}
unsafe impl Sync for View {}

/// The output pointer shared by the tasks, each writing a disjoint set of tiles.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint row/column ranges of `C` (see `gemm_f32`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Whether this CPU can run [`gemm_f32`].
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
}

thread_local! {
    /// Packing buffers kept per thread so that repeated products neither
    /// allocate nor page-fault; taken out while in use (see [`take_buf`]).
    static PACK_A: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static PACK_B: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Takes this thread's buffer out of `slot` (a nested call on the same thread,
/// e.g. through rayon work stealing, then simply finds it empty and
/// allocates) and grows it to at least `len` floats plus alignment slack.
fn take_buf(slot: &'static std::thread::LocalKey<Cell<Vec<f32>>>, len: usize) -> Vec<f32> {
    let mut v = slot.with(Cell::take);
    if v.len() < len + ALIGN_SLACK {
        v = vec![0.0; len + ALIGN_SLACK];
    }
    v
}

/// The 64-byte aligned window of `len` floats inside a buffer from [`take_buf`].
fn aligned(v: &mut [f32], len: usize) -> &mut [f32] {
    let off = v.as_ptr().align_offset(64).min(ALIGN_SLACK);
    &mut v[off..off + len]
}

/// Splits `0..len` into at most `parts` ranges whose starts are multiples of
/// `align` (so micro-tiles never straddle two tasks).
fn split(len: usize, parts: usize, align: usize) -> Vec<Range<usize>> {
    let chunk = len.div_ceil(parts.max(1)).next_multiple_of(align).max(align);
    (0..len).step_by(chunk).map(|s| s..(s + chunk).min(len)).collect()
}

/// How a product meets what `C` held before.
#[derive(Clone, Copy)]
pub(super) enum Start<'a> {
    /// `C = op(A)·op(B)`.
    Overwrite,
    /// `C += op(A)·op(B)`.
    Accumulate,
    /// `C = op(A)·op(B) + bias`, the `n` values of `bias` added to every row
    /// once the product is complete, as a separate bias add would.
    Bias(&'a [f32]),
}

/// `C = op(A)·op(B)` (or as `start` says) with `C` row-major `m×n`
/// (row stride `n`), using up to `threads` rayon tasks per depth block.
///
/// # Safety
/// The CPU must support AVX-512F ([`available`]); `a` and `b` must address
/// valid `m×k` and `k×n` operands through their strides; `c` must be valid for
/// `m*n` writes and alias neither operand.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_f32(m: usize, n: usize, k: usize, a: View, b: View, c: *mut f32, start: Start<'_>, threads: usize) {
    debug_assert!(m > 0 && n > 0 && k > 0);
    if let Start::Bias(bias) = start {
        assert_eq!(bias.len(), n, "matmul: the bias must have n elements");
    }
    // Column blocks bound the packed `B` slab (and the buffer kept for the
    // next call) to NC·KC floats, however wide the output (e.g. a vocabulary).
    for j0 in (0..n).step_by(NC) {
        let bj = View { ptr: b.ptr.wrapping_add(j0 * b.cs), ..b };
        let start = match start {
            Start::Bias(bias) => Start::Bias(&bias[j0..]),
            other => other,
        };
        column_block(m, NC.min(n - j0), n, k, a, bj, c.add(j0), start, threads);
    }
}

/// [`gemm_f32`] on the `nb` columns of `C` (row stride `ldc`) that start at `c`.
///
/// # Safety
/// As for [`gemm_f32`], with `b` viewing the first of the `nb` columns.
#[allow(clippy::too_many_arguments)]
unsafe fn column_block(m: usize, n: usize, ldc: usize, k: usize, a: View, b: View, c: *mut f32, start: Start<'_>, threads: usize) {
    // Equal depth blocks, a function of `k` alone (never of the thread count).
    let kc_nom = k.div_ceil(k.div_ceil(KC_MAX));
    let strips = n.div_ceil(NR);
    let mut bbuf = take_buf(&PACK_B, kc_nom * strips * NR);
    // Two tasks per thread let a thread that was slowed down by other load
    // hand work over. Splitting the rows is preferred: each task then packs
    // only its own rows of `A`, while tasks that split the columns each pack
    // all of it. Only when there are too few row tiles to share out (at
    // least two per task) do the columns split.
    let parts = if threads <= 1 { 1 } else { 2 * threads };
    let (rows, cols) =
        if m.div_ceil(MR) >= 2 * parts || m.div_ceil(MR) >= strips { (split(m, parts, MR), split(n, 1, NR)) } else { (split(m, 1, MR), split(n, parts, NR)) };
    let tasks: Vec<(Range<usize>, Range<usize>)> = rows.iter().flat_map(|r| cols.iter().map(move |cl| (r.clone(), cl.clone()))).collect();
    let out = OutPtr(c);
    let mut p0 = 0;
    while p0 < k {
        let kc = kc_nom.min(k - p0);
        let packed_b = aligned(&mut bbuf, kc * strips * NR);
        let pack_strip = |(s, dst): (usize, &mut [f32])| {
            // SAFETY: strip `s` covers columns `s*NR..` of `op(B)` rows `p0..p0+kc`, in bounds.
            unsafe { pack_b(b, p0, kc, s * NR, (n - s * NR).min(NR), dst) }
        };
        if tasks.len() > 1 {
            packed_b.par_chunks_mut(kc * NR).enumerate().for_each(pack_strip);
        } else {
            packed_b.chunks_mut(kc * NR).enumerate().for_each(pack_strip);
        }
        let packed_b = &*packed_b;
        // Only the first depth block may replace C, only the last adds the bias.
        let first = Store {
            add_to_c: p0 > 0 || matches!(start, Start::Accumulate),
            bias: match start {
                Start::Bias(bias) if p0 + kc == k => Some(bias),
                _ => None,
            },
        };
        let run = |(r, cl): &(Range<usize>, Range<usize>)| {
            // SAFETY: the tasks' (rows, cols) rectangles partition `C`; the
            // caller guarantees the CPU features and operand bounds.
            unsafe { block(n, ldc, r.clone(), cl.clone(), a, p0, kc, packed_b, out, first) }
        };
        if tasks.len() > 1 {
            tasks.par_iter().for_each(run);
        } else {
            tasks.iter().for_each(run);
        }
        p0 += kc;
    }
    PACK_B.with(|s| s.set(bbuf));
}

/// Packs rows `p0..p0+kc` and columns `j0..j0+nv` of `op(B)` into `dst` as
/// `kc` rows of `NR` floats (columns past `nv` are zero).
///
/// # Safety
/// The addressed elements of `b` must be in bounds; `dst.len() == kc*NR`.
unsafe fn pack_b(b: View, p0: usize, kc: usize, j0: usize, nv: usize, dst: &mut [f32]) {
    debug_assert_eq!(dst.len(), kc * NR);
    if nv < NR {
        dst.fill(0.0);
    }
    if b.cs == 1 {
        for (p, row) in dst.chunks_exact_mut(NR).enumerate() {
            let src = b.ptr.add((p0 + p) * b.rs + j0);
            row[..nv].copy_from_slice(std::slice::from_raw_parts(src, nv));
        }
    } else {
        for j in 0..nv {
            let src = b.ptr.add(p0 * b.rs + (j0 + j) * b.cs);
            for p in 0..kc {
                *dst.get_unchecked_mut(p * NR + j) = *src.add(p * b.rs);
            }
        }
    }
}

/// Packs rows `i0..i0+rows` (fewer than `MR`) and depth `p0..p0+kc` of
/// `op(A)` into one micro-panel: `kc` groups of `MR` floats, rows past
/// `rows` zero. Only a partial last panel is packed, so this is rare and small.
///
/// # Safety
/// The addressed elements of `a` must be in bounds; `dst.len() == MR*kc`.
unsafe fn pack_a(a: View, i0: usize, rows: usize, p0: usize, kc: usize, dst: &mut [f32]) {
    debug_assert!(rows < MR && dst.len() == MR * kc);
    dst.fill(0.0);
    for (p, group) in dst.chunks_exact_mut(MR).enumerate() {
        for (i, x) in group[..rows].iter_mut().enumerate() {
            *x = *a.ptr.add((i0 + i) * a.rs + (p0 + p) * a.cs);
        }
    }
}

/// One task: rows `rows` × columns `cols` of `C` (`n` columns in all, row
/// stride `ldc`) for depth block `p0..p0+kc`.
///
/// # Safety
/// As for [`gemm_f32`]; no other task may touch this rectangle of `C`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn block(n: usize, ldc: usize, rows: Range<usize>, cols: Range<usize>, a: View, p0: usize, kc: usize, packed_b: &[f32], out: OutPtr, store: Store<'_>) {
    debug_assert!(a.cs == 1 || a.rs == 1, "A is read in place along one of its strides");
    let mut abuf = take_buf(&PACK_A, MR * kc);
    let mut ic = rows.start;
    while ic < rows.end {
        let mv = MC.min(rows.end - ic);
        // Full panels are read in place; a partial last panel (reading past
        // it would leave the operand) is packed, zero-padded, into `tail`.
        let full = mv / MR * MR;
        let tail = aligned(&mut abuf, MR * kc);
        if full < mv {
            pack_a(a, ic + full, mv - full, p0, kc, tail);
        }
        for jr in cols.clone().step_by(NR) {
            let nv = NR.min(n - jr);
            let bp = packed_b.as_ptr().add(jr / NR * kc * NR);
            for ir in (0..mv).step_by(MR) {
                let rv = MR.min(mv - ir);
                let ap = if ir == full {
                    Panel::Packed(tail.as_ptr())
                } else if a.cs == 1 {
                    Panel::Rows { ptr: a.ptr.add((ic + ir) * a.rs + p0), ld: a.rs }
                } else {
                    Panel::Cols { ptr: a.ptr.add((ic + ir) + p0 * a.cs), ld: a.cs }
                };
                let cp = out.0.add((ic + ir) * ldc + jr);
                let tile_store = Store { bias: store.bias.map(|b| &b[jr..]), ..store };
                if rv == MR && nv == NR {
                    kernel(kc, ap, bp, cp, ldc, tile_store);
                } else {
                    // Edge tile: same arithmetic into a scratch tile, then
                    // only the valid part is written.
                    let mut tile = [0f32; MR * NR];
                    kernel(kc, ap, bp, tile.as_mut_ptr(), NR, Store { add_to_c: false, bias: None });
                    for i in 0..rv {
                        for j in 0..nv {
                            let dst = cp.add(i * ldc + j);
                            let mut v = tile[i * NR + j];
                            if tile_store.add_to_c {
                                v += *dst;
                            }
                            if let Some(bias) = tile_store.bias {
                                v += bias[j];
                            }
                            *dst = v;
                        }
                    }
                }
            }
        }
        ic += mv;
    }
    PACK_A.with(|s| s.set(abuf));
}

/// How a micro-kernel writes its tile of `C`: `C = tile` or `C = C + tile`,
/// then `+ bias` when there is one.
#[derive(Clone, Copy)]
struct Store<'a> {
    add_to_c: bool,
    /// Starting at the tile's first column (at least `NR` values for a full tile).
    bias: Option<&'a [f32]>,
}

/// Where a micro-kernel reads its `MR` rows of `op(A)`.
#[derive(Clone, Copy)]
enum Panel {
    /// Packed: `kc` groups of `MR` floats.
    Packed(*const f32),
    /// In place: `MR` rows `ld` apart, each `kc` contiguous floats.
    Rows { ptr: *const f32, ld: usize },
    /// In place, transposed: `kc` runs of `MR` floats, `ld` apart.
    Cols { ptr: *const f32, ld: usize },
}

/// `C[0..MR][0..NR] (+)= A · Bpanel` over depth `kc`, where `A` is the
/// panel `ap` and `bp` holds `kc` rows of `NR` floats; `C` has row stride
/// `ldc`.
///
/// # Safety
/// AVX-512F present; `ap` valid for its `MR×kc` reads, `bp` for `kc*NR`;
/// `c` valid for an `MR×NR` tile with row stride `ldc`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn kernel(kc: usize, ap: Panel, bp: *const f32, c: *mut f32, ldc: usize, store: Store<'_>) {
    match ap {
        Panel::Packed(ptr) => kernel_strided::<MR, 1>(kc, ptr, 1, bp, c, ldc, store),
        Panel::Rows { ptr, ld } => kernel_strided::<1, 0>(kc, ptr, ld, bp, c, ldc, store),
        Panel::Cols { ptr, ld } => kernel_strided::<0, 1>(kc, ptr, ld, bp, c, ldc, store),
    }
}

/// [`kernel`] with `A(i, p)` at `a[p·STEP + i·(ROW or ld when ROW = 0)]`:
/// `STEP = MR, ROW = 1` for a packed panel, `STEP = 1, ROW = 0` for rows
/// `ld` apart. The strides are constants where they can be, so the
/// broadcasts address `A` with no arithmetic in the loop.
///
/// # Safety
/// As for [`kernel`].
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn kernel_strided<const STEP: usize, const ROW: usize>(kc: usize, ap: *const f32, ld: usize, bp: *const f32, c: *mut f32, ldc: usize, store: Store<'_>) {
    let row = if ROW == 0 { ld } else { ROW };
    let stride = if STEP == 0 { ld } else { STEP };
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let (mut ap, mut bp) = (ap, bp);
    let step = |acc: &mut [[__m512; 2]; MR], ap: *const f32, bp: *const f32| {
        let b0 = _mm512_loadu_ps(bp);
        let b1 = _mm512_loadu_ps(bp.add(16));
        for (i, r) in acc.iter_mut().enumerate() {
            let ai = _mm512_set1_ps(*ap.add(i * row));
            r[0] = _mm512_fmadd_ps(ai, b0, r[0]);
            r[1] = _mm512_fmadd_ps(ai, b1, r[1]);
        }
    };
    // The C tile is touched only at the end; its rows lie far apart in
    // memory, so fetching them while the FMAs run hides that latency.
    let ahead = kc.min(PREFETCH_STEPS);
    for _ in 0..kc - ahead {
        step(&mut acc, ap, bp);
        ap = ap.add(stride);
        bp = bp.add(NR);
    }
    for i in 0..MR {
        let ci = c.add(i * ldc) as *const i8;
        _mm_prefetch::<_MM_HINT_T0>(ci);
        _mm_prefetch::<_MM_HINT_T0>(ci.wrapping_add(NR * 4 - 1));
    }
    for _ in 0..ahead {
        step(&mut acc, ap, bp);
        ap = ap.add(stride);
        bp = bp.add(NR);
    }
    let bias = store.bias.map(|b| {
        assert!(b.len() >= NR, "matmul: bias shorter than the tile");
        [_mm512_loadu_ps(b.as_ptr()), _mm512_loadu_ps(b.as_ptr().add(16))]
    });
    for (i, r) in acc.iter().enumerate() {
        let ci = c.add(i * ldc);
        for (h, &v) in r.iter().enumerate() {
            let mut v = v;
            if store.add_to_c {
                v = _mm512_add_ps(_mm512_loadu_ps(ci.add(16 * h)), v);
            }
            if let Some(b) = bias {
                v = _mm512_add_ps(v, b[h]);
            }
            _mm512_storeu_ps(ci.add(16 * h), v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, rand_vec};

    /// Runs the packed kernel directly (whatever the size thresholds of the
    /// dispatcher) and compares with an f64 triple loop.
    fn run(m: usize, k: usize, n: usize, ta: bool, tb: bool, acc: bool, threads: usize) -> Vec<f32> {
        let a: Vec<f32> = rand_vec(1, m * k).iter().map(|&v| v as f32).collect();
        let b: Vec<f32> = rand_vec(2, k * n).iter().map(|&v| v as f32).collect();
        let c0: Vec<f32> = rand_vec(3, m * n).iter().map(|&v| v as f32).collect();
        let av = View { ptr: a.as_ptr(), rs: if ta { 1 } else { k }, cs: if ta { m } else { 1 } };
        let bv = View { ptr: b.as_ptr(), rs: if tb { 1 } else { n }, cs: if tb { k } else { 1 } };
        let mut c = c0.clone();
        // SAFETY: checked `available()`; the views address m×k and k×n
        // elements of `a` and `b`; `c` has m*n elements.
        let start = if acc { Start::Accumulate } else { Start::Overwrite };
        unsafe { gemm_f32(m, n, k, av, bv, c.as_mut_ptr(), start, threads) };
        let mut expected = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = if acc { c0[i * n + j] as f64 } else { 0.0 };
                for p in 0..k {
                    s += a[i * av.rs + p * av.cs] as f64 * b[p * bv.rs + j * bv.cs] as f64;
                }
                expected[i * n + j] = s;
            }
        }
        let got: Vec<f64> = c.iter().map(|&v| v as f64).collect();
        let what = format!("m={m} k={k} n={n} ta={ta} tb={tb} acc={acc} threads={threads}");
        assert_close(&got, &expected, 2e-6 * (k as f64 + 4.0), 1e-5, &what);
        c
    }

    #[test]
    fn packed_kernel_matches_naive_and_is_thread_count_independent() {
        if !available() {
            return;
        }
        // Edge tiles in m and n, several depth blocks (k > KC_MAX), several
        // row blocks (m > MC), splits along m and along n, two column blocks.
        let shapes = [(1, 1, 1), (13, 1100, 40), (200, 30, 70), (20, 50, 300), (97, 17, 65), (3, 129, 129), (5, 20, NC + 33)];
        for &(m, k, n) in &shapes {
            for ta in [false, true] {
                for tb in [false, true] {
                    for acc in [false, true] {
                        let one = run(m, k, n, ta, tb, acc, 1);
                        for threads in [2, 3] {
                            let c = run(m, k, n, ta, tb, acc, threads);
                            assert!(one.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()));
                        }
                    }
                }
            }
        }
    }
}
