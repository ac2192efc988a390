//! The inner loops of the quantized products on AVX2 with FMA.
//!
//! The build targets the x86-64 baseline, so these functions are compiled
//! for AVX2 and FMA with `#[target_feature]` and only called after
//! [`available`] said the running CPU has both. Codes are widened to f32
//! lanes in registers (int8 by sign extension, int4 by a mask per nibble,
//! see [`dot_i4`]) and met with x in fused multiply-adds; W8A8 multiplies bytes with bytes
//! (`vpmaddubsw`) and sums in i32 lanes.
//!
//! Every function takes slices and checks their lengths with assertions
//! before the loads, so the pointer arithmetic stays inside them.

use std::arch::x86_64::*;

/// Whether the running CPU has AVX2 and FMA.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// The sum of the eight lanes of `v`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
    _mm_cvtss_f32(s)
}

/// The sum of the eight i32 lanes of `v`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<1>(s));
    _mm_cvtsi128_si32(s)
}

/// How far ahead of a decode loop's reads it asks for the weight bytes.
///
/// A decode task streams a contiguous block of channels but reads it as
/// several interleaved streams (four channels at a time), each only a layer
/// row long: at 768 input features, 12 cache lines. That is too short for
/// the hardware prefetcher to follow, and int8 then moved 3.5 GB/s where
/// 4096-wide layers moved 7–8. Asking for the line 4 KiB ahead of each
/// stream keeps the block's bytes arriving whatever the row length.
const PREFETCH_AHEAD: usize = 4096;

/// Asks for the cache line `PREFETCH_AHEAD` bytes past `p` (a hint: the
/// address is never dereferenced, so it may lie beyond the slice).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn prefetch<T>(p: *const T) {
    _mm_prefetch::<_MM_HINT_T0>((p as *const i8).wrapping_add(PREFETCH_AHEAD));
}

/// `Σ_i x[i] · rows[r][i]` for each of the `R` rows (each at least `x.len()` long).
///
/// Sixteen depth steps per iteration in two accumulators per row: `R = 4`
/// keeps eight FMA chains in flight, enough to hide their latency, and
/// loads each vector of `x` once for four rows.
#[target_feature(enable = "avx2,fma")]
pub(super) fn dot_i8<const R: usize>(x: &[f32], rows: &[&[i8]; R]) -> [f32; R] {
    let k = x.len();
    for row in rows {
        assert!(row.len() >= k, "dot_i8: a row is shorter than x");
    }
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut i = 0;
    while i + 16 <= k {
        if i.is_multiple_of(64) {
            for row in rows {
                prefetch(row.as_ptr().wrapping_add(i));
            }
        }
        // SAFETY: i + 16 <= k, and x and every row hold at least k elements
        // (asserted above): the loads read inside the slices.
        unsafe {
            let x0 = _mm256_loadu_ps(x.as_ptr().add(i));
            let x1 = _mm256_loadu_ps(x.as_ptr().add(i + 8));
            for (a, row) in acc.iter_mut().zip(rows) {
                let p = row.as_ptr().add(i);
                let q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)));
                let q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i)));
                a[0] = _mm256_fmadd_ps(x0, q0, a[0]);
                a[1] = _mm256_fmadd_ps(x1, q1, a[1]);
            }
        }
        i += 16;
    }
    if i + 8 <= k {
        // SAFETY: as above, with i + 8 <= k.
        unsafe {
            let x0 = _mm256_loadu_ps(x.as_ptr().add(i));
            for (a, row) in acc.iter_mut().zip(rows) {
                let q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(row.as_ptr().add(i) as *const __m128i)));
                a[0] = _mm256_fmadd_ps(x0, q0, a[0]);
            }
        }
        i += 8;
    }
    let mut out = [0f32; R];
    for ((o, a), row) in out.iter_mut().zip(&acc).zip(rows) {
        let mut s = hsum(_mm256_add_ps(a[0], a[1]));
        for t in i..k {
            s += x[t] * row[t] as f32;
        }
        *o = s;
    }
    out
}

/// `Σ_i x[i] · rows[r][i]` in `i32` for each of the `R` rows (each at
/// least `x.len()` long); exact while no sum leaves `i32` (the caller
/// bounds the depth), and every code is in `-127..=127`.
///
/// `vpmaddubsw` multiplies unsigned by signed bytes, so the row's codes
/// take the sign of x's (`vpsignb`) and meet `|x|`: the same products. Two
/// neighbouring products sum to at most `2 · 127²`, inside `i16`.
#[target_feature(enable = "avx2,fma")]
pub(super) fn dot_i8i8<const R: usize>(x: &[i8], rows: &[&[i8]; R]) -> [i32; R] {
    let k = x.len();
    for row in rows {
        assert!(row.len() >= k, "dot_i8i8: a row is shorter than x");
    }
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_si256(); R];
    let mut i = 0;
    while i + 32 <= k {
        if i.is_multiple_of(64) {
            for row in rows {
                prefetch(row.as_ptr().wrapping_add(i));
            }
        }
        // SAFETY: i + 32 <= k, and x and every row hold at least k bytes.
        unsafe {
            let xv = _mm256_loadu_si256(x.as_ptr().add(i) as *const __m256i);
            let ax = _mm256_abs_epi8(xv);
            for (a, row) in acc.iter_mut().zip(rows) {
                let q = _mm256_loadu_si256(row.as_ptr().add(i) as *const __m256i);
                let pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(q, xv));
                *a = _mm256_add_epi32(*a, _mm256_madd_epi16(pairs, ones));
            }
        }
        i += 32;
    }
    let mut out = [0i32; R];
    for ((o, a), row) in out.iter_mut().zip(&acc).zip(rows) {
        let mut s = hsum_i32(*a);
        for t in i..k {
            s += x[t] as i32 * row[t] as i32;
        }
        *o = s;
    }
    out
}

/// `Σ_i xs[r][i] · row[i]` for each of the `M` rows of x against one int8
/// channel (`row` at least as long as each row of x): each step widens
/// sixteen codes once for all `M` rows, the shape of a few decoding
/// sequences (or a short prefill) sharing one pass over the weight. Each
/// row's sum runs the operations of [`dot_i8`] in its order, so a row gets
/// the same bits here as alone.
#[target_feature(enable = "avx2,fma")]
pub(super) fn dot_i8_rows<const M: usize>(xs: &[&[f32]; M], row: &[i8]) -> [f32; M] {
    let k = xs.first().map_or(0, |x| x.len());
    assert!(xs.iter().all(|x| x.len() == k) && row.len() >= k, "dot_i8_rows: rows of x of different lengths, or a short channel");
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    let mut i = 0;
    while i + 16 <= k {
        if i.is_multiple_of(64) {
            prefetch(row.as_ptr().wrapping_add(i));
        }
        // SAFETY: i + 16 <= k, and the channel and every row of x hold at least k elements.
        unsafe {
            let p = row.as_ptr().add(i);
            let q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)));
            let q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i)));
            for (a, x) in acc.iter_mut().zip(xs) {
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(i)), q0, a[0]);
                a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(i + 8)), q1, a[1]);
            }
        }
        i += 16;
    }
    if i + 8 <= k {
        // SAFETY: as above, with i + 8 <= k.
        unsafe {
            let q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(row.as_ptr().add(i) as *const __m128i)));
            for (a, x) in acc.iter_mut().zip(xs) {
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(i)), q0, a[0]);
            }
        }
        i += 8;
    }
    let mut out = [0f32; M];
    for ((o, a), x) in out.iter_mut().zip(&acc).zip(xs) {
        let mut s = hsum(_mm256_add_ps(a[0], a[1]));
        for t in i..k {
            s += x[t] * row[t] as f32;
        }
        *o = s;
    }
    out
}

/// The offset every stored int4 code carries (`q + 8`, see
/// [`super::int4`]).
const CODE_OFFSET: f64 = 8.0;

/// Rows of `x` (`k` values each, `k` a multiple of `group`) in the form
/// [`dot_i4`] reads: each row becomes its `k` values reordered and scaled,
/// then one correction per group (`k + k / group` floats a row).
///
/// Per group, per chunk of the packed bytes (32 bytes, or 16 for the last
/// chunk of a group whose half is an odd multiple of 16), nibble position
/// `p` of the chunk's eight 32-bit lanes holds, lane by lane, the weights
/// listed here consecutively: byte `p / 2` of each lane's bytes, its low
/// nibble (weight `c + …` of the group) for even `p`, its high nibble
/// (weight `group/2 + c + …`) for odd `p`. Each value is divided by
/// `2^(4p)`, the place value of its nibble in the lane (exact unless it
/// falls below `2^-98`, where it loses low bits: activations that small add
/// nothing a product could show).
///
/// The loop reads nibbles below the top one as their stored `q + 8`; a
/// group's correction is `8 · Σ x` over those weights (summed in f64), the
/// part of the sum that is the offset's, not the weight's.
pub(super) fn i4_order(x: &[f32], k: usize, group: usize) -> Vec<f32> {
    let half = group / 2;
    let mut out = Vec::with_capacity(x.len() + x.len() / group);
    for row in x.chunks_exact(k) {
        let mut corrections = Vec::with_capacity(k / group);
        for xg in row.chunks_exact(group) {
            let (mut c, mut offset) = (0, 0f64);
            while c < half {
                // Bytes per lane: 4 in a 32-byte chunk, 2 in a 16-byte one.
                let per_lane = if half - c >= 32 { 4 } else { 2 };
                for p in 0..2 * per_lane {
                    for lane in 0..8 {
                        let v = xg[(p % 2) * half + c + per_lane * lane + p / 2];
                        out.push(v / (1u32 << (4 * p)) as f32);
                        if p < 7 {
                            offset += v as f64;
                        }
                    }
                }
                c += 8 * per_lane;
            }
            corrections.push((CODE_OFFSET * offset) as f32);
        }
        out.extend(corrections);
    }
    out
}

/// `Σ_g scales[g] · Σ_{i in group g} x[i] · q[i]` for each of the `M`
/// rows of x against each of the `R` int4 channels (`(packed, scales)` in
/// the layout of [`super::int4`]); `group / 2` must be a multiple of 16 and
/// each row of x must come from [`i4_order`]. Returns `out[row][channel]`.
///
/// Unpacking is the cost (the weights stream from memory at a fraction of
/// a cycle each), so a nibble becomes an f32 lane in two operations: the
/// loop reads 32 bytes as eight 32-bit lanes of eight nibbles and, for each
/// nibble position `p`, masks the other nibbles away — the lane is then the
/// integer `(q + 8) · 2^(4p)`, converted exactly to f32 and met by x's
/// value divided by `2^(4p)` (see [`i4_order`]). The top nibble, whose top
/// bit is the lane's sign, has that bit flipped first (once per 32 bytes),
/// which makes it `q · 2^28` in two's complement. The group's correction
/// (minus 8 · the x of the other nibbles) starts the group's sum, so it
/// ends as `Σ x · q`. Widening bytes and subtracting 8 (the obvious loop)
/// took 2× as long. A group whose half is an odd multiple of 16 ends with a
/// 16-byte chunk widened to eight lanes of two bytes.
///
/// The price is rounding: the partial sums carry `x · (q + 8)` terms, so
/// the error is bounded by `Σ |x| · (|q| + 8)` rather than `Σ |x · q|` —
/// far below what rounding the weights to four bits costs already.
///
/// Every (row, channel) pair runs the same operations in the same order
/// whatever `M` and `R` are — two accumulators per group, the group's sum
/// scaled into a running total, one horizontal sum — so a row gets the same
/// bits alone as beside others. `M = 1, R = 2` (decode) keeps four
/// multiply-add chains in flight, as `M = 2, R = 1` does.
#[target_feature(enable = "avx2,fma")]
pub(super) fn dot_i4<const M: usize, const R: usize>(xs: &[&[f32]; M], chans: &[(&[u8], &[f32]); R], group: usize) -> [[f32; R]; M] {
    let half = group / 2;
    assert!(half.is_multiple_of(16), "dot_i4: the AVX2 loop takes groups of a multiple of 32 weights");
    let groups = chans.first().map_or(0, |c| c.1.len());
    let k = groups * group;
    assert!(
        xs.iter().all(|x| x.len() >= k + groups) && chans.iter().all(|(p, s)| s.len() == groups && p.len() >= groups * half),
        "dot_i4: x or a channel is shorter than its groups"
    );
    let sign = _mm256_set1_epi32(i32::MIN);
    let mut total = [[_mm256_setzero_ps(); R]; M];
    for g in 0..groups {
        let mut a = [[[_mm256_setzero_ps(); 2]; R]; M];
        for (a, x) in a.iter_mut().zip(xs) {
            for a in a {
                a[0] = _mm256_setr_ps(-x[k + g], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
            }
        }
        let mut c = 0;
        while c < half {
            if (g * half + c).is_multiple_of(64) {
                for (packed, _) in chans {
                    prefetch(packed.as_ptr().wrapping_add(g * half + c));
                }
            }
            let whole = half - c >= 32;
            for (ch, (packed, _)) in chans.iter().enumerate() {
                // SAFETY: c + 32 <= half (or c + 16 for the short chunk), so
                // the bytes loaded at g*half + c are inside every channel,
                // and the 2·(chunk bytes) floats at g*group + 2c inside every
                // row of x (asserted above).
                unsafe {
                    let bytes = packed.as_ptr().add(g * half + c);
                    let v = if whole {
                        _mm256_xor_si256(_mm256_loadu_si256(bytes as *const __m256i), sign)
                    } else {
                        _mm256_cvtepu16_epi32(_mm_loadu_si128(bytes as *const __m128i))
                    };
                    for (a, x) in a.iter_mut().zip(xs) {
                        let a = &mut a[ch];
                        let xc = x.as_ptr().add(g * group + 2 * c);
                        macro_rules! nibble {
                            ($p:literal) => {
                                let q = _mm256_and_si256(v, _mm256_set1_epi32((0xFu32 << (4 * $p)) as i32));
                                a[$p % 2] = _mm256_fmadd_ps(_mm256_loadu_ps(xc.add(8 * $p)), _mm256_cvtepi32_ps(q), a[$p % 2]);
                            };
                        }
                        nibble!(0);
                        nibble!(1);
                        nibble!(2);
                        nibble!(3);
                        if whole {
                            nibble!(4);
                            nibble!(5);
                            nibble!(6);
                            nibble!(7);
                        }
                    }
                }
            }
            c += if whole { 32 } else { 16 };
        }
        for (t, a) in total.iter_mut().zip(&a) {
            for ((t, a), (_, scales)) in t.iter_mut().zip(a).zip(chans) {
                *t = _mm256_fmadd_ps(_mm256_set1_ps(scales[g]), _mm256_add_ps(a[0], a[1]), *t);
            }
        }
    }
    let mut out = [[0f32; R]; M];
    for (o, t) in out.iter_mut().zip(&total) {
        for (o, t) in o.iter_mut().zip(t) {
            *o = hsum(*t);
        }
    }
    out
}
