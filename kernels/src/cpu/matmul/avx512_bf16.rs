//! bf16 matrix product on the AVX-512 BF16 dot-product instruction
//! (`vdpbf16ps`), used when the CPU has it (checked at run time).
//!
//! `vdpbf16ps acc, a, b` adds, in each of 16 f32 lanes, the two products of
//! a pair of bf16 values: `acc += a[2i+1]·b[2i+1]`, then `acc += a[2i]·b[2i]`.
//! One instruction is 32 multiply-adds where an f32 FMA is 16, which is the
//! whole gain: on a core that issues one 512-bit FMA or one `vdpbf16ps` per
//! cycle, bf16 doubles the arithmetic rate, and halves the bytes per operand.
//!
//! What the instruction computes, measured on the reference machine (an AMD
//! Zen 4) and matching Intel's description:
//! - each product of two bf16 values is exact in f32 (8 × 8 significant
//!   bits), and each of the two additions rounds to nearest even, the odd
//!   element's product first: a pair is two fused multiply-adds in sequence;
//! - denormal inputs (bf16 operands and the f32 accumulator) count as zero,
//!   and a denormal result is flushed to zero, whatever MXCSR says.
//!
//! So a dot product over `k` is a chain of `k` rounded additions in f32, as
//! the f32 kernel's, plus the flushes: a bf16 operand below `2^-126` in
//! magnitude contributes nothing, and a partial sum below `2^-126` becomes
//! zero (an absolute error under `2^-126` per step). The output is rounded
//! once, from f32, to bf16 (after adding the old `C` or the bias in f32).
//!
//! Blocking: with twice the work per instruction the `C` tile is read and
//! written only once, so there are no depth blocks: every micro-tile keeps
//! its accumulators in registers over the whole depth. `op(B)` is packed once
//! per column block (at most [`PACK_B_BYTES`]) into strips of [`NR`] columns
//! whose rows are the interleaved pairs `(B[2q][j], B[2q+1][j])` the
//! instruction wants; `op(A)` is read in place when its pairs are adjacent in
//! memory (row-major `A`, the broadcast of one 32-bit word is the pair), and
//! packed into pair-interleaved panels, one row block at a time, when it is
//! stored transposed (a weight gradient's `dYᵀ`).
//!
//! Determinism: every element of `C` is one chain over the depth in a fixed
//! order; threads only decide which disjoint tiles of `C` they compute.

use rayon::prelude::*;
use std::arch::x86_64::*;
use std::cell::Cell;
use std::ops::Range;

/// Rows of a micro-tile: each is one 32-bit broadcast of `A` per pair step.
const MR: usize = 12;
/// Columns of a micro-tile: two 16-lane f32 accumulators per row, 24 in all,
/// fed by two 64-byte loads of packed `B` per pair step.
const NR: usize = 32;
/// Bytes of packed `B` per column block: bounds the slab (shared by all
/// threads, kept for the next call) however wide the output.
const PACK_B_BYTES: usize = 16 << 20;
/// Bytes of `A` one row block may span, so that it stays in the 1 MiB L2
/// while every strip of `B` sweeps over it.
const A_BLOCK_BYTES: usize = 384 << 10;
/// Deepest product whose row-major `A` is read in place. Deeper, the twelve
/// rows a micro-kernel walks (each `k·2` bytes) no longer stay in L1 next to
/// the strip of `B`, and packing them into one contiguous panel (a pass over
/// `A` shared by every strip) is faster: 2048³ went from about 170 to 200
/// GFLOP/s on one core, while `k` up to 1152 is as fast or faster in place.
const IN_PLACE_MAX_K: usize = 1536;
/// Most rows in a row block (for shallow products, where the byte bound
/// alone would allow hundreds).
const MC_MAX: usize = 192;
/// Pair steps before the end of the micro-kernel at which the `C` tile is
/// prefetched.
const PREFETCH_STEPS: usize = 24;
/// 32-bit words of slack in each packing buffer so its start can be 64-byte aligned.
const ALIGN_SLACK: usize = 16;

/// A bf16 operand (as raw bits) seen through strides: element `(r, c)` is at
/// `ptr[r*rs + c*cs]`. One of the strides is 1.
#[derive(Clone, Copy)]
pub(super) struct View {
    pub ptr: *const u16,
    pub rs: usize,
    pub cs: usize,
}

// SAFETY: a `View` is only read, and only while the slice it was made from is
// borrowed by the caller of `gemm_bf16`.
unsafe impl Send for View {}
unsafe impl Sync for View {}

/// The output pointer shared by the tasks, each writing a disjoint set of tiles.
#[derive(Clone, Copy)]
struct OutPtr(*mut u16);
// SAFETY: tasks write disjoint row/column ranges of `C` (see `column_block`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Whether this CPU can run [`gemm_bf16`]: the dot-product instruction, plus
/// the 16-bit lane operations (AVX-512BW, VL) the packing and the rounding use.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bf16")
}

thread_local! {
    /// Packing buffers kept per thread so that repeated products neither
    /// allocate nor page-fault; taken out while in use (see [`take_buf`]).
    static PACK_A: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
    static PACK_B: Cell<Vec<u32>> = const { Cell::new(Vec::new()) };
}

/// Takes this thread's buffer out of `slot` (a nested call on the same thread,
/// e.g. through rayon work stealing, then finds it empty and allocates) and
/// grows it to at least `len` words plus alignment slack.
fn take_buf(slot: &'static std::thread::LocalKey<Cell<Vec<u32>>>, len: usize) -> Vec<u32> {
    let mut v = slot.with(Cell::take);
    if v.len() < len + ALIGN_SLACK {
        v = vec![0; len + ALIGN_SLACK];
    }
    v
}

/// The 64-byte aligned window of `len` words inside a buffer from [`take_buf`].
fn aligned(v: &mut [u32], len: usize) -> &mut [u32] {
    let off = v.as_ptr().align_offset(64).min(ALIGN_SLACK);
    &mut v[off..off + len]
}

/// Splits `0..len` into at most `parts` ranges whose starts are multiples of
/// `align` (so micro-tiles never straddle two tasks).
fn split(len: usize, parts: usize, align: usize) -> Vec<Range<usize>> {
    let chunk = len.div_ceil(parts.max(1)).next_multiple_of(align).max(align);
    (0..len).step_by(chunk).map(|s| s..(s + chunk).min(len)).collect()
}

/// How a product meets what `C` held before (all sums in f32, one rounding
/// to bf16 at the end).
#[derive(Clone, Copy)]
pub(super) enum Start<'a> {
    /// `C = op(A)·op(B)`.
    Overwrite,
    /// `C = C + op(A)·op(B)`.
    Accumulate,
    /// `C = op(A)·op(B) + bias`, the `n` values of `bias` (bf16 bits) added
    /// to every row.
    Bias(&'a [u16]),
}

/// `C = op(A)·op(B)` (or as `start` says) on bf16 operands, with `C`
/// row-major bf16 `m×n` (row stride `n`), using up to `threads` rayon tasks.
///
/// # Safety
/// The CPU must support the features [`available`] checks; `a` and `b` must
/// address valid `m×k` and `k×n` operands through their strides, with
/// `a.rs == 1 || a.cs == 1` and `b.rs == 1 || b.cs == 1`; `c` must be valid
/// for `m*n` writes and alias neither operand.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_bf16(m: usize, n: usize, k: usize, a: View, b: View, c: *mut u16, start: Start<'_>, threads: usize) {
    debug_assert!(m > 0 && n > 0 && k > 0);
    debug_assert!((a.rs == 1 || a.cs == 1) && (b.rs == 1 || b.cs == 1));
    if let Start::Bias(bias) = start {
        assert_eq!(bias.len(), n, "matmul: the bias must have n elements");
    }
    // A strip holds k.div_ceil(2) pairs of NR columns, 4 bytes each.
    let strip_bytes = k.div_ceil(2) * NR * 4;
    let nc = (PACK_B_BYTES / strip_bytes).max(1) * NR;
    for j0 in (0..n).step_by(nc) {
        let bj = View { ptr: b.ptr.wrapping_add(j0 * b.cs), ..b };
        let start = match start {
            Start::Bias(bias) => Start::Bias(&bias[j0..]),
            other => other,
        };
        column_block(m, nc.min(n - j0), n, k, a, bj, c.add(j0), start, threads);
    }
}

/// [`gemm_bf16`] on the `n` columns of `C` (row stride `ldc`) that start at `c`.
///
/// # Safety
/// As for [`gemm_bf16`], with `b` viewing the first of the `n` columns.
#[allow(clippy::too_many_arguments)]
unsafe fn column_block(m: usize, n: usize, ldc: usize, k: usize, a: View, b: View, c: *mut u16, start: Start<'_>, threads: usize) {
    let kp = k.div_ceil(2);
    let strips = n.div_ceil(NR);
    let mut bbuf = take_buf(&PACK_B, strips * kp * NR);
    // As in the f32 kernel: two tasks per thread, rows split in preference
    // (each task then packs only its own rows of a transposed `A`).
    let parts = if threads <= 1 { 1 } else { 2 * threads };
    let (rows, cols) =
        if m.div_ceil(MR) >= 2 * parts || m.div_ceil(MR) >= strips { (split(m, parts, MR), split(n, 1, NR)) } else { (split(m, 1, MR), split(n, parts, NR)) };
    let tasks: Vec<(Range<usize>, Range<usize>)> = rows.iter().flat_map(|r| cols.iter().map(move |cl| (r.clone(), cl.clone()))).collect();
    let packed_b = aligned(&mut bbuf, strips * kp * NR);
    let pack_strip = |(s, dst): (usize, &mut [u32])| {
        // SAFETY: strip `s` covers columns `s*NR..` (at most `n`) of the
        // `k` rows of `op(B)`, in bounds; the caller checked the CPU features.
        unsafe { pack_b(b, k, s * NR, (n - s * NR).min(NR), dst) }
    };
    if tasks.len() > 1 {
        packed_b.par_chunks_mut(kp * NR).enumerate().for_each(pack_strip);
    } else {
        packed_b.chunks_mut(kp * NR).enumerate().for_each(pack_strip);
    }
    let packed_b = &*packed_b;
    let out = OutPtr(c);
    let run = |(r, cl): &(Range<usize>, Range<usize>)| {
        // SAFETY: the tasks' (rows, cols) rectangles partition `C`; the
        // caller guarantees the CPU features and operand bounds.
        unsafe { block(n, ldc, k, r.clone(), cl.clone(), a, packed_b, out, start) }
    };
    if tasks.len() > 1 {
        tasks.par_iter().for_each(run);
    } else {
        tasks.iter().for_each(run);
    }
    PACK_B.with(|s| s.set(bbuf));
}

/// Rows per row block for a depth of `k`: a multiple of [`MR`] whose panel
/// of `A` spans at most [`A_BLOCK_BYTES`].
fn row_block(k: usize) -> usize {
    (A_BLOCK_BYTES / (k.div_ceil(2) * 4) / MR * MR).clamp(MR, MC_MAX)
}

/// One task: rows `rows` × columns `cols` of `C` (`n` columns in the block,
/// row stride `ldc`), over the whole depth `k`.
///
/// # Safety
/// As for [`gemm_bf16`]; no other task may touch this rectangle of `C`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn block(n: usize, ldc: usize, k: usize, rows: Range<usize>, cols: Range<usize>, a: View, packed_b: &[u32], out: OutPtr, start: Start<'_>) {
    let kp = k.div_ceil(2);
    let mc = row_block(k);
    // A row-major `A` is read in place except for a partial last panel; a
    // transposed one, or a deep one, is packed a row block at a time.
    let in_place = a.cs == 1 && k <= IN_PLACE_MAX_K;
    let pack_len = if in_place { MR * kp } else { mc * kp };
    let mut abuf = take_buf(&PACK_A, pack_len);
    let packed_a = aligned(&mut abuf, pack_len);
    let mut ic = rows.start;
    while ic < rows.end {
        let mv = mc.min(rows.end - ic);
        let full = mv / MR * MR;
        if in_place {
            if full < mv {
                pack_a_rows(a, ic + full, mv - full, k, &mut packed_a[..MR * kp]);
            }
        } else {
            for (t, panel) in packed_a[..mv.div_ceil(MR) * MR * kp].chunks_exact_mut(MR * kp).enumerate() {
                let (i0, rows) = (ic + t * MR, MR.min(mv - t * MR));
                if a.cs == 1 {
                    pack_a_rows(a, i0, rows, k, panel);
                } else {
                    pack_a_cols(a, i0, rows, k, panel);
                }
            }
        }
        for jr in cols.clone().step_by(NR) {
            let nv = NR.min(n - jr);
            let bp = packed_b.as_ptr().add(jr / NR * kp * NR);
            let store = Store {
                accumulate: matches!(start, Start::Accumulate),
                bias: match start {
                    Start::Bias(bias) => Some(&bias[jr..]),
                    _ => None,
                },
            };
            for ir in (0..mv).step_by(MR) {
                let rv = MR.min(mv - ir);
                let cp = out.0.add((ic + ir) * ldc + jr);
                if in_place && ir < full {
                    let ap = a.ptr.add((ic + ir) * a.rs);
                    kernel::<2, 0>(k / 2, k % 2 == 1, ap, a.rs, bp, cp, ldc, rv, nv, store);
                } else {
                    let panel = if in_place { 0 } else { ir / MR * MR * kp };
                    let ap = packed_a.as_ptr().add(panel) as *const u16;
                    kernel::<{ 2 * MR }, 2>(kp, false, ap, 0, bp, cp, ldc, rv, nv, store);
                }
            }
        }
        ic += mv;
    }
    PACK_A.with(|s| s.set(abuf));
}

/// Packs the `k` rows and columns `j0..j0+nv` (`nv <= NR`) of `op(B)` into
/// `dst`: `k.div_ceil(2)` rows of `NR` words, word `j` of row `q` holding
/// `B[2q][j]` in its low half and `B[2q+1][j]` in its high half (zero past
/// `nv` columns and past `k` rows).
///
/// # Safety
/// The addressed elements of `b` must be in bounds; `dst.len() == k.div_ceil(2)*NR`;
/// the CPU has the features of [`available`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn pack_b(b: View, k: usize, j0: usize, nv: usize, dst: &mut [u32]) {
    let kp = k.div_ceil(2);
    debug_assert_eq!(dst.len(), kp * NR);
    if b.cs == 1 {
        // Rows are contiguous: interleave two rows 32 columns at a time.
        let mask: __mmask32 = if nv == NR { !0 } else { (1u32 << nv) - 1 };
        for (q, row) in dst.chunks_exact_mut(NR).enumerate() {
            let r0 = b.ptr.add(2 * q * b.rs + j0);
            let lo = _mm512_maskz_loadu_epi16(mask, r0 as *const i16);
            let hi = if 2 * q + 1 < k { _mm512_maskz_loadu_epi16(mask, r0.add(b.rs) as *const i16) } else { _mm512_setzero_si512() };
            let (w0, w1) = interleave(lo, hi);
            _mm512_storeu_si512(row.as_mut_ptr() as *mut __m512i, w0);
            _mm512_storeu_si512(row.as_mut_ptr().add(16) as *mut __m512i, w1);
        }
    } else {
        // Columns are contiguous (a transposed `B`, a linear layer's weight):
        // each column's pairs are adjacent words, scattered to the strip rows.
        debug_assert_eq!(b.rs, 1);
        if nv < NR {
            dst.fill(0);
        }
        for j in 0..nv {
            let col = b.ptr.add((j0 + j) * b.cs);
            for q in 0..k / 2 {
                *dst.get_unchecked_mut(q * NR + j) = (col.add(2 * q) as *const u32).read_unaligned();
            }
            if k % 2 == 1 {
                *dst.get_unchecked_mut((kp - 1) * NR + j) = *col.add(k - 1) as u32;
            }
        }
    }
}

/// The 32 words `lo[j] | hi[j] << 16` of two vectors of 32 bf16 values, as
/// two vectors of 16 words (columns 0..16, then 16..32).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn interleave(lo: __m512i, hi: __m512i) -> (__m512i, __m512i) {
    let word = |l: __m256i, h: __m256i| _mm512_or_si512(_mm512_cvtepu16_epi32(l), _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
    let first = word(_mm512_castsi512_si256(lo), _mm512_castsi512_si256(hi));
    let second = word(_mm512_extracti64x4_epi64::<1>(lo), _mm512_extracti64x4_epi64::<1>(hi));
    (first, second)
}

/// Packs rows `i0..i0+rows` (`rows <= MR`) of a transposed `A` (`a.rs == 1`:
/// the rows of `op(A)` are the columns of the stored matrix) into one panel:
/// `k.div_ceil(2)` groups of `MR` words, word `i` of group `q` holding the
/// pair `(A[i][2q], A[i][2q+1])`, zero past `rows` and past `k`.
///
/// # Safety
/// The addressed elements of `a` must be in bounds; `dst.len() == MR*k.div_ceil(2)`;
/// the CPU has the features of [`available`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn pack_a_cols(a: View, i0: usize, rows: usize, k: usize, dst: &mut [u32]) {
    debug_assert!(a.rs == 1 && rows <= MR && dst.len() == MR * k.div_ceil(2));
    let mask: __mmask16 = (1u16 << rows) - 1;
    for (q, group) in dst.chunks_exact_mut(MR).enumerate() {
        let r0 = a.ptr.add(2 * q * a.cs + i0);
        let lo = _mm256_maskz_loadu_epi16(mask, r0 as *const i16);
        let hi = if 2 * q + 1 < k { _mm256_maskz_loadu_epi16(mask, r0.add(a.cs) as *const i16) } else { _mm256_setzero_si256() };
        let w = _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi)));
        _mm512_mask_storeu_epi32(group.as_mut_ptr() as *mut i32, (1 << MR) - 1, w);
    }
}

/// Packs rows `i0..i0+rows` (`rows <= MR`) of a row-major `A` (`a.cs == 1`)
/// into one panel laid out as in [`pack_a_cols`]: a partial last panel
/// (reading a full one in place would leave the operand), or every panel of
/// a deep product.
///
/// # Safety
/// The addressed elements of `a` must be in bounds; `dst.len() == MR*k.div_ceil(2)`.
unsafe fn pack_a_rows(a: View, i0: usize, rows: usize, k: usize, dst: &mut [u32]) {
    let kp = k.div_ceil(2);
    debug_assert!(a.cs == 1 && rows <= MR && dst.len() == MR * kp);
    if rows < MR {
        dst.fill(0);
    }
    for i in 0..rows {
        let row = a.ptr.add((i0 + i) * a.rs);
        for q in 0..k / 2 {
            *dst.get_unchecked_mut(q * MR + i) = (row.add(2 * q) as *const u32).read_unaligned();
        }
        if k % 2 == 1 {
            *dst.get_unchecked_mut((kp - 1) * MR + i) = *row.add(k - 1) as u32;
        }
    }
}

/// How a micro-kernel writes its tile of `C`: the f32 sum, plus the old `C`
/// or the bias, rounded once to bf16.
#[derive(Clone, Copy)]
struct Store<'a> {
    accumulate: bool,
    /// Starting at the tile's first column (at least `nv` values).
    bias: Option<&'a [u16]>,
}

/// The `rv×nv` corner of `C[0..MR][0..NR] = A · Bstrip` (as `store` says),
/// with `bp` holding the strip's pair rows and `A(i, pair q)` the 32-bit word
/// at `ap + q·STEP + i·ROW` (in bf16 units; `ROW = 0` means `ld`): `STEP =
/// 2·MR, ROW = 2` for a packed panel, `STEP = 2, ROW = 0` for rows `ld` apart
/// read in place. `steps` pair steps run; with `odd_tail`, one more step
/// pairs `A(i, 2·steps)` alone (its partner word would lie past the row) with
/// the strip's last pair row, whose high halves are zero.
///
/// # Safety
/// CPU features of [`available`]; `ap` valid for the reads described, `bp`
/// for `(steps + odd_tail)·NR` words; `c` valid for an `rv×nv` tile with
/// row stride `ldc`; `rv <= MR`, `nv <= NR`, rows of `A` past `rv` readable
/// (zero in a packed panel).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn kernel<const STEP: usize, const ROW: usize>(
    steps: usize,
    odd_tail: bool,
    ap: *const u16,
    ld: usize,
    bp: *const u32,
    c: *mut u16,
    ldc: usize,
    rv: usize,
    nv: usize,
    store: Store<'_>,
) {
    let row = if ROW == 0 { ld } else { ROW };
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let step = |acc: &mut [[__m512; 2]; MR], ap: *const u16, bp: *const u32| {
        let b0 = bh(_mm512_loadu_si512(bp as *const __m512i));
        let b1 = bh(_mm512_loadu_si512(bp.add(16) as *const __m512i));
        for (i, r) in acc.iter_mut().enumerate() {
            let ai = bh(_mm512_set1_epi32((ap.add(i * row) as *const i32).read_unaligned()));
            r[0] = _mm512_dpbf16_ps(r[0], ai, b0);
            r[1] = _mm512_dpbf16_ps(r[1], ai, b1);
        }
    };
    let (mut ap, mut bp) = (ap, bp);
    // The C tile is touched only at the end; its rows lie far apart in
    // memory, so fetching them while the products run hides that latency.
    let ahead = steps.min(PREFETCH_STEPS);
    for _ in 0..steps - ahead {
        step(&mut acc, ap, bp);
        ap = ap.add(STEP);
        bp = bp.add(NR);
    }
    for i in 0..rv {
        let ci = c.add(i * ldc) as *const i8;
        _mm_prefetch::<_MM_HINT_T0>(ci);
        _mm_prefetch::<_MM_HINT_T0>(ci.wrapping_add(NR * 2 - 1));
    }
    for _ in 0..ahead {
        step(&mut acc, ap, bp);
        ap = ap.add(STEP);
        bp = bp.add(NR);
    }
    if odd_tail {
        let b0 = bh(_mm512_loadu_si512(bp as *const __m512i));
        let b1 = bh(_mm512_loadu_si512(bp.add(16) as *const __m512i));
        for (i, r) in acc.iter_mut().enumerate() {
            // The last value of the row alone, its partner zero.
            let ai = bh(_mm512_set1_epi32(*ap.add(i * row) as i32));
            r[0] = _mm512_dpbf16_ps(r[0], ai, b0);
            r[1] = _mm512_dpbf16_ps(r[1], ai, b1);
        }
    }
    let mask: __mmask32 = if nv == NR { !0 } else { (1u32 << nv) - 1 };
    let bias = store.bias.map(|b| widen32(_mm512_maskz_loadu_epi16(mask, b.as_ptr() as *const i16)));
    for (i, r) in acc.iter().enumerate().take(rv) {
        let ci = c.add(i * ldc);
        let (mut v0, mut v1) = (r[0], r[1]);
        if store.accumulate {
            let (c0, c1) = widen32(_mm512_maskz_loadu_epi16(mask, ci as *const i16));
            v0 = _mm512_add_ps(c0, v0);
            v1 = _mm512_add_ps(c1, v1);
        }
        if let Some((b0, b1)) = bias {
            v0 = _mm512_add_ps(v0, b0);
            v1 = _mm512_add_ps(v1, b1);
        }
        let packed = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(round_to_bf16(v0)), round_to_bf16(v1));
        _mm512_mask_storeu_epi16(ci as *mut i16, mask, packed);
    }
}

/// Reinterprets 16 words as 32 bf16 values for `vdpbf16ps`.
#[inline(always)]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: both are 64-byte plain-data vectors; every bit pattern is valid.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// 32 bf16 values (bits) as two vectors of 16 f32 (exact).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn widen32(v: __m512i) -> (__m512, __m512) {
    let w = |h: __m256i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
    (w(_mm512_castsi512_si256(v)), w(_mm512_extracti64x4_epi64::<1>(v)))
}

/// Rounds 16 f32 to bf16 bits, to nearest even, exactly as the scalar
/// conversion everywhere else does (`half::bf16::from_f32`): NaN stays a
/// quiet NaN with the sign and top payload bits kept, overflow gives
/// infinity, denormals are rounded, not flushed.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn round_to_bf16(v: __m512) -> __m256i {
    let x = _mm512_castps_si512(v);
    let high = _mm512_srli_epi32::<16>(x);
    // Adding 0x7fff plus the lowest kept bit carries into the kept bits
    // exactly when the dropped half is above a tie, or a tie with an odd
    // kept part.
    let lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet))
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn rounding_matches_the_scalar_conversion() {
        if !available() {
            return;
        }
        // Ties both ways, every boundary class, NaNs of both signs and
        // payloads, infinities, denormals, and a sweep of random bit patterns.
        let mut bits: Vec<u32> = vec![
            0x3F80_0000,
            0x3F80_7FFF,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_8001,
            0xBF80_8000,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0xFFC0_1234,
            0x7FFF_FFFF,
            0x0000_0001,
            0x0000_8000,
            0x0000_8001,
            0x007F_FFFF,
            0x8000_0000,
        ];
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        bits.extend((0..1 << 16).map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u32
        }));
        bits.resize(bits.len().next_multiple_of(16), 0);
        for chunk in bits.chunks_exact(16) {
            let v: Vec<f32> = chunk.iter().map(|&b| f32::from_bits(b)).collect();
            let mut got = [0u16; 16];
            // SAFETY: features checked above; 16 floats in, 16 halves out.
            unsafe {
                let r = round_to_bf16(_mm512_loadu_ps(v.as_ptr()));
                _mm256_storeu_si256(got.as_mut_ptr() as *mut __m256i, r);
            }
            for (&x, &g) in v.iter().zip(&got) {
                assert_eq!(g, bf16::from_f32(x).to_bits(), "bf16 of {:#010x}", x.to_bits());
            }
        }
    }
}
