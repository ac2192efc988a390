//! The quantized products against references in f64, on generated shapes
//! (odd sizes, depths that are not a multiple of any vector width, the
//! fused decode loops and the prefill tile, every inner loop this CPU has).
//!
//! Two properties are checked per output:
//! - the kernel computes `x · dequant(W)ᵀ (+ b)` up to f32 rounding: within
//!   `(k + 4) · 2⁻²⁴ · (Σ_k |x_k · ŵ_nk| + |b_n|)` of the f64 sum, a bound
//!   that holds for any summation order;
//! - the quantization error against the f32 weight is within what the
//!   format promises: `Σ_k |x_k| · s/2` (each `k` with its own scale) for
//!   weight-only, plus `Σ_k (sx/2) · |ŵ_nk|` for W8A8.

use super::int4::{self, Int4Weight};
use super::int8::{self, Int8Weight};
use super::{w8a8, Isa, Rows};
use crate::testing::rand_vec;

const U: f64 = 1.0 / (1u64 << 24) as f64;

/// A weight `[n, k]` whose rows have different magnitudes (a row of zeros,
/// tiny and large rows, one outlier per row) so that scales differ.
fn weight(n: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut w: Vec<f32> = rand_vec(seed, n * k).into_iter().map(|v| v as f32).collect();
    for (j, row) in w.chunks_mut(k.max(1)).enumerate() {
        let mag = match j % 5 {
            0 => 0.0,
            1 => 1e-3,
            2 => 1.0,
            3 => 40.0,
            _ => 0.02,
        };
        for v in row.iter_mut() {
            *v *= mag;
        }
        if let Some(v) = row.get_mut((j * 7) % k.max(1)) {
            *v *= 9.0;
        }
    }
    w
}

fn f32s(seed: u64, n: usize, scale: f64) -> Vec<f32> {
    rand_vec(seed, n).into_iter().map(|v| (v * scale) as f32).collect()
}

/// Every inner loop this CPU has, with each row order.
fn modes() -> Vec<(Isa, Rows)> {
    Isa::all().into_iter().flat_map(|isa| [(isa, Rows::Fastest), (isa, Rows::Invariant)]).collect()
}

/// Asserts `|got − want| ≤ bound` for every output, naming the first that is not.
#[track_caller]
fn within(what: &str, got: &[f32], want: &[f64], bound: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((&g, &w), &b)) in got.iter().zip(want).zip(bound).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(err <= b, "{what}: output {i} is {g}, expected {w} within {b:e} (error {err:e})");
    }
}

/// The shapes `(m, n, k)` of the weight-only and W8A8 products: decode
/// (1 to 15 rows, from the codes, one to four rows at a time) and prefill
/// (16 rows and more, the tile), depths around every vector width, channel
/// counts around the four-channel step, and some large enough to run on
/// the thread pool.
const SHAPES: [(usize, usize, usize); 16] = [
    (1, 1, 1),
    (1, 5, 7),
    (2, 3, 8),
    (1, 9, 15),
    (3, 13, 16),
    (1, 6, 33),
    (5, 37, 100),
    (7, 4, 257),
    (1, 70, 1000),
    (8, 11, 129),
    (13, 21, 300),
    (3, 300, 4100),
    (1, 600, 2048),
    (16, 70, 130),
    (21, 9, 64),
    (24, 200, 512),
];

#[test]
fn int8_matches_its_dequantized_weight_and_the_error_bound() {
    for (s, &(m, n, k)) in SHAPES.iter().enumerate() {
        let seed = 100 + 10 * s as u64;
        let (w, x, b) = (weight(n, k, seed), f32s(seed + 1, m * k, 2.0), f32s(seed + 2, n, 1.0));
        let (mut q, mut scales) = (vec![0i8; n * k], vec![0f32; n]);
        int8::quantize(&w, n, k, &mut q, &mut scales);
        let qw = Int8Weight { q: &q, scales: &scales, n, k };
        assert!(q.iter().all(|&c| (-127..=127).contains(&c)), "codes in -127..=127");
        let mut deq = vec![0f32; n * k];
        int8::dequantize(&qw, &mut deq);
        for (i, (&d, &v)) in deq.iter().zip(&w).enumerate() {
            let s = scales[i / k] as f64;
            assert!((d as f64 - v as f64).abs() <= s / 2.0 * (1.0 + 1e-5), "weight {i}: {v} dequantizes to {d}, scale {s}");
        }
        let per_weight = |_: usize, j: usize| scales[j] as f64 / 2.0;
        for (isa, order) in modes() {
            for bias in [None, Some(&b[..])] {
                let mut y = vec![f32::NAN; m * n];
                int8::matmul_with(isa, order, &x, m, &qw, bias, &mut y);
                check_weight_only(
                    &format!("int8 {isa:?} {order:?} m={m} n={n} k={k} bias={}", bias.is_some()),
                    &x,
                    &w,
                    &deq,
                    bias,
                    m,
                    n,
                    k,
                    &y,
                    per_weight,
                    0.0,
                );
            }
        }
    }
}

#[test]
fn int4_matches_its_dequantized_weight_and_the_error_bound() {
    // (m, n, k, group): groups of 2 and 6 (portable loop only), 24, 32, 64,
    // 96, 128 and 160 (the SIMD loop from 32 on; 32, 96 and 160 end each
    // group with its short 16-byte chunk), several groups per row.
    let cases = [
        (1, 3, 2, 2),
        (1, 5, 12, 6),
        (2, 7, 48, 24),
        (1, 6, 64, 32),
        (3, 9, 96, 32),
        (1, 13, 256, 128),
        (5, 33, 384, 128),
        (8, 10, 256, 64),
        (11, 21, 384, 128),
        (16, 10, 256, 64),
        (19, 150, 384, 128),
        (1, 300, 4096, 128),
        (2, 70, 1024, 64),
        (2, 9, 192, 96),
        (3, 6, 320, 160),
    ];
    for (s, &(m, n, k, group)) in cases.iter().enumerate() {
        let seed = 500 + 10 * s as u64;
        let (w, x, b) = (weight(n, k, seed), f32s(seed + 1, m * k, 2.0), f32s(seed + 2, n, 1.0));
        let groups = k / group;
        let (mut packed, mut scales) = (vec![0u8; n * k / 2], vec![0f32; n * groups]);
        int4::quantize(&w, n, k, group, &mut packed, &mut scales);
        let qw = Int4Weight { packed: &packed, scales: &scales, n, k, group };
        assert!(packed.iter().all(|&b| (1..=15).contains(&(b & 15)) && (1..=15).contains(&(b >> 4))), "nibbles are q + 8 with q in -7..=7");
        let mut deq = vec![0f32; n * k];
        int4::dequantize(&qw, &mut deq);
        for (i, (&d, &v)) in deq.iter().zip(&w).enumerate() {
            let s = scales[i / group] as f64;
            assert!((d as f64 - v as f64).abs() <= s / 2.0 * (1.0 + 1e-5), "weight {i}: {v} dequantizes to {d}, scale {s}");
        }
        let per_weight = |kk: usize, j: usize| scales[j * groups + kk / group] as f64 / 2.0;
        for (isa, order) in modes() {
            for bias in [None, Some(&b[..])] {
                let mut y = vec![f32::NAN; m * n];
                int4::matmul_with(isa, order, &x, m, &qw, bias, &mut y);
                let what = format!("int4 {isa:?} {order:?} m={m} n={n} k={k} group={group} bias={}", bias.is_some());
                check_weight_only(&what, &x, &w, &deq, bias, m, n, k, &y, per_weight, INT4_OFFSET);
            }
        }
    }
}

/// The AVX2 int4 loop meets codes scaled by up to 2^28 with x scaled by
/// as much down: activations from 1e-20 to 1e30 (any sign) still give `x · dequant(W)`
/// within rounding, neither overflowing nor losing the small ones.
#[test]
fn int4_takes_activations_of_any_magnitude() {
    let (m, n, k, group) = (3, 10, 384, 128);
    let w = weight(n, k, 71);
    let x: Vec<f32> = rand_vec(72, m * k).into_iter().zip(rand_vec(73, m * k)).map(|(sign, e)| (10f64.powf(5.0 + 25.0 * e) * sign.signum()) as f32).collect();
    let (mut packed, mut scales) = (vec![0u8; n * k / 2], vec![0f32; n * k / group]);
    int4::quantize(&w, n, k, group, &mut packed, &mut scales);
    let qw = Int4Weight { packed: &packed, scales: &scales, n, k, group };
    let mut deq = vec![0f32; n * k];
    int4::dequantize(&qw, &mut deq);
    let (mut want, mut bound) = (vec![], vec![]);
    for r in 0..m {
        for j in 0..n {
            let terms = (0..k).map(|kk| x[r * k + kk] as f64 * deq[j * k + kk] as f64);
            want.push(terms.clone().sum::<f64>());
            let offset = (0..k).map(|kk| (x[r * k + kk] as f64).abs() * INT4_OFFSET * scales[(j * k + kk) / group] as f64);
            bound.push((k + 4) as f64 * U * (terms.map(f64::abs).sum::<f64>() + offset.sum::<f64>()));
        }
    }
    for (isa, order) in modes() {
        let mut y = vec![f32::NAN; m * n];
        int4::matmul_with(isa, order, &x, m, &qw, None, &mut y);
        within(&format!("int4 {isa:?} {order:?} with activations of 1e-20..1e30"), &y, &want, &bound);
    }
}

/// Groups whose codes are nearly all zero (one large weight among tiny
/// ones) against activations of one sign: the case where the AVX2 loop's
/// offset codes (`q + 8`) cancel hardest against the group's correction.
/// The result still holds its documented bound, and the zero codes add
/// nothing beyond rounding.
#[test]
fn int4_mostly_zero_groups_keep_the_offset_bound() {
    let (n, k, group) = (6, 512, 128);
    for m in [1, 3] {
        let w: Vec<f32> = (0..n * k).map(|i| if i % group == (i / k) % group { 1.0 + (i % 7) as f32 } else { 1e-4 * ((i % 5) as f32 - 2.0) }).collect();
        let x: Vec<f32> = rand_vec(81, m * k).into_iter().map(|v| (1.0 + v.abs() * 1e3) as f32).collect();
        let (mut packed, mut scales) = (vec![0u8; n * k / 2], vec![0f32; n * k / group]);
        int4::quantize(&w, n, k, group, &mut packed, &mut scales);
        let qw = Int4Weight { packed: &packed, scales: &scales, n, k, group };
        let mut deq = vec![0f32; n * k];
        int4::dequantize(&qw, &mut deq);
        assert!(deq.iter().filter(|&&d| d == 0.0).count() > n * k * 9 / 10, "most codes are zero");
        let per_weight = |kk: usize, j: usize| scales[(j * k + kk) / group] as f64 / 2.0;
        for (isa, order) in modes() {
            let mut y = vec![f32::NAN; m * n];
            int4::matmul_with(isa, order, &x, m, &qw, None, &mut y);
            check_weight_only(&format!("int4 {isa:?} {order:?} m={m}, mostly zero codes"), &x, &w, &deq, None, m, n, k, &y, per_weight, INT4_OFFSET);
        }
    }
}

/// The offset of stored int4 codes, which the AVX2 loop's partial sums
/// carry (see `x86::dot_i4`): its rounding is bounded by `Σ |x| · (|q| + 8)
/// · scale`.
const INT4_OFFSET: f64 = 8.0;

/// Checks a weight-only product `y` against the f64 product with the
/// dequantized weight (rounding only) and with the f32 weight (the
/// format's bound, `half_step(k, n)` being half the scale weight `[n, k]`
/// has); the loop's partial sums may carry `offset` codes per weight.
#[allow(clippy::too_many_arguments)]
fn check_weight_only(
    what: &str,
    x: &[f32],
    w: &[f32],
    deq: &[f32],
    bias: Option<&[f32]>,
    m: usize,
    n: usize,
    k: usize,
    y: &[f32],
    half_step: impl Fn(usize, usize) -> f64,
    offset: f64,
) {
    let (mut exact_deq, mut round_bound, mut exact_w, mut quant_bound) = (vec![], vec![], vec![], vec![]);
    for r in 0..m {
        for j in 0..n {
            let b = bias.map_or(0.0, |b| b[j] as f64);
            let (mut sd, mut mag, mut sw, mut err) = (b, b.abs(), b, 0.0);
            for kk in 0..k {
                let (xv, dv, wv) = (x[r * k + kk] as f64, deq[j * k + kk] as f64, w[j * k + kk] as f64);
                sd += xv * dv;
                mag += (xv * dv).abs() + xv.abs() * offset * 2.0 * half_step(kk, j);
                sw += xv * wv;
                err += xv.abs() * half_step(kk, j) * (1.0 + 1e-5);
            }
            let rounding = (k + 4) as f64 * U * mag + 1e-37;
            exact_deq.push(sd);
            round_bound.push(rounding);
            exact_w.push(sw);
            quant_bound.push(err + rounding + (k + 4) as f64 * U * err);
        }
    }
    within(&format!("{what}: against x·dequant(W)"), y, &exact_deq, &round_bound);
    within(&format!("{what}: against x·W"), y, &exact_w, &quant_bound);
}

#[test]
fn w8a8_matches_its_integer_sum_and_the_error_bound() {
    for (s, &(m, n, k)) in SHAPES.iter().enumerate() {
        let seed = 900 + 10 * s as u64;
        let (w, x, b) = (weight(n, k, seed), f32s(seed + 1, m * k, 3.0), f32s(seed + 2, n, 1.0));
        let (mut q, mut scales) = (vec![0i8; n * k], vec![0f32; n]);
        int8::quantize(&w, n, k, &mut q, &mut scales);
        let qw = Int8Weight { q: &q, scales: &scales, n, k };
        let (mut xq, mut sx) = (vec![0i8; m * k], vec![0f32; m]);
        w8a8::quantize_rows(&x, m, k, &mut xq, &mut sx);
        for isa in Isa::all() {
            for bias in [None, Some(&b[..])] {
                let mut y = vec![f32::NAN; m * n];
                w8a8::matmul_on(isa, &x, m, &qw, bias, &mut y);
                let what = format!("w8a8 {isa:?} m={m} n={n} k={k} bias={}", bias.is_some());
                let (mut exact_int, mut round_bound, mut exact_w, mut quant_bound) = (vec![], vec![], vec![], vec![]);
                for r in 0..m {
                    for j in 0..n {
                        let bj = bias.map_or(0.0, |b| b[j] as f64);
                        let acc: i64 = (0..k).map(|kk| xq[r * k + kk] as i64 * q[j * k + kk] as i64).sum();
                        let v = acc as f64 * sx[r] as f64 * scales[j] as f64;
                        exact_int.push(v + bj);
                        // acc to f32, the product of the scales, their product, the bias: four roundings.
                        round_bound.push(5.0 * U * (v.abs() + bj.abs()) + 1e-37);
                        let (mut sw, mut err) = (bj, 0.0);
                        for kk in 0..k {
                            let (xv, wv) = (x[r * k + kk] as f64, w[j * k + kk] as f64);
                            let deq = q[j * k + kk] as f64 * scales[j] as f64;
                            sw += xv * wv;
                            err += (xv.abs() * scales[j] as f64 / 2.0 + sx[r] as f64 / 2.0 * deq.abs()) * (1.0 + 1e-5);
                        }
                        exact_w.push(sw);
                        quant_bound.push(err + 5.0 * U * (v.abs() + bj.abs()) + 1e-37);
                    }
                }
                within(&format!("{what}: against the integer sum"), &y, &exact_int, &round_bound);
                within(&format!("{what}: against x·W"), &y, &exact_w, &quant_bound);
            }
        }
    }
}

/// The same outputs on one thread as on the whole pool, bit for bit: each
/// output is summed by one task in a fixed order.
#[test]
fn results_do_not_depend_on_the_thread_count() {
    let (m, n, k) = (3, 520, 4096);
    let (w, x) = (weight(n, k, 1), f32s(2, m * k, 1.0));
    let (mut q, mut s8) = (vec![0i8; n * k], vec![0f32; n]);
    int8::quantize(&w, n, k, &mut q, &mut s8);
    let (mut p4, mut s4) = (vec![0u8; n * k / 2], vec![0f32; n * k / 128]);
    int4::quantize(&w, n, k, 128, &mut p4, &mut s4);
    let run = || {
        let w8 = Int8Weight { q: &q, scales: &s8, n, k };
        let w4 = Int4Weight { packed: &p4, scales: &s4, n, k, group: 128 };
        let mut outs = Vec::new();
        for rows in [1, m] {
            let x = &x[..rows * k];
            let mut y = vec![0f32; rows * n];
            int8::matmul(x, rows, &w8, None, &mut y);
            outs.push(y.clone());
            int4::matmul(x, rows, &w4, None, &mut y);
            outs.push(y.clone());
            w8a8::matmul(x, rows, &w8, None, &mut y);
            outs.push(y);
        }
        outs
    };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let one = pool.install(run);
    let many = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap().install(run);
    for (a, b) in one.iter().zip(&many) {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "one thread and three differ");
    }
}

#[test]
fn zero_weights_and_empty_depth_give_the_bias() {
    let (m, n) = (2, 5);
    let b = f32s(3, n, 1.0);
    for k in [0, 64] {
        let w = vec![0f32; n * k];
        let (mut q, mut s8) = (vec![0i8; n * k], vec![0f32; n]);
        int8::quantize(&w, n, k, &mut q, &mut s8);
        let (mut p4, mut s4) = (vec![0u8; n * k / 2], vec![0f32; n * k / 32]);
        int4::quantize(&w, n, k, 32, &mut p4, &mut s4);
        let x = f32s(4, m * k, 1.0);
        let want: Vec<f32> = (0..m).flat_map(|_| b.iter().copied()).collect();
        for isa in Isa::all() {
            let mut y = vec![f32::NAN; m * n];
            int8::matmul_with(isa, Rows::Fastest, &x, m, &Int8Weight { q: &q, scales: &s8, n, k }, Some(&b), &mut y);
            assert_eq!(y, want, "int8 k={k}");
            let mut y = vec![f32::NAN; m * n];
            int4::matmul_with(isa, Rows::Fastest, &x, m, &Int4Weight { packed: &p4, scales: &s4, n, k, group: 32 }, Some(&b), &mut y);
            assert_eq!(y, want, "int4 k={k}");
            let mut y = vec![f32::NAN; m * n];
            w8a8::matmul_on(isa, &x, m, &Int8Weight { q: &q, scales: &s8, n, k }, Some(&b), &mut y);
            assert_eq!(y, want, "w8a8 k={k}");
        }
    }
}

#[test]
fn a_non_finite_activation_row_gives_non_finite_w8a8_outputs() {
    let (n, k) = (4, 40);
    let w = weight(n, k, 5);
    let (mut q, mut s8) = (vec![0i8; n * k], vec![0f32; n]);
    int8::quantize(&w, n, k, &mut q, &mut s8);
    let mut x = f32s(6, 2 * k, 1.0);
    x[3] = f32::NAN;
    let mut y = vec![0f32; 2 * n];
    w8a8::matmul(&x, 2, &Int8Weight { q: &q, scales: &s8, n, k }, None, &mut y);
    assert!(y[..n].iter().all(|v| !v.is_finite()), "row 0 holds a NaN: {y:?}");
    assert!(y[n..].iter().all(|v| v.is_finite()), "row 1 is finite: {y:?}");
}

#[test]
fn the_int4_layout_pairs_each_weight_with_the_one_half_a_group_away() {
    // One row, one group of 4: weights 0 and 2 share byte 0, 1 and 3 byte 1.
    let w = [7.0f32, -7.0, 1.0, 0.0];
    let (mut packed, mut scales) = ([0u8; 2], [0f32; 1]);
    int4::quantize(&w, 1, 4, 4, &mut packed, &mut scales);
    assert_eq!(scales, [1.0]);
    assert_eq!(packed, [(7 + 8) | ((1 + 8) << 4), 8 << 4 | (8 - 7)]);
}

/// With the row-invariant order (and W8A8, and the fastest one below the
/// tile), every row of a product is the bits that row gets alone: row
/// counts across the one-row, few-row and tile thresholds, depths whose
/// remainders take every tail of the SIMD loops, int4 groups on the SIMD
/// loop (32, 64, 128) and off it (6), channel counts odd and even.
#[test]
fn a_row_gets_the_bits_it_gets_alone() {
    let shapes = [(2, 5, 24, 24), (3, 7, 40, 8), (4, 9, 64, 32), (5, 6, 138, 6), (7, 33, 200, 8), (16, 11, 256, 64), (21, 20, 384, 128), (33, 9, 72, 24)];
    for (s, &(m, n, k, group)) in shapes.iter().enumerate() {
        let seed = 900 + 10 * s as u64;
        let (w, x, b) = (weight(n, k, seed), f32s(seed + 1, m * k, 2.0), f32s(seed + 2, n, 1.0));
        let (mut q, mut s8) = (vec![0i8; n * k], vec![0f32; n]);
        int8::quantize(&w, n, k, &mut q, &mut s8);
        let (mut p4, mut s4) = (vec![0u8; n * k / 2], vec![0f32; n * k / group]);
        int4::quantize(&w, n, k, group, &mut p4, &mut s4);
        let w8 = Int8Weight { q: &q, scales: &s8, n, k };
        let w4 = Int4Weight { packed: &p4, scales: &s4, n, k, group };
        for isa in Isa::all() {
            type Product<'a> = Box<dyn Fn(&[f32], usize, &mut [f32]) + 'a>;
            let mut products: Vec<(&str, Product<'_>)> = vec![
                ("int8", Box::new(|x: &[f32], m: usize, y: &mut [f32]| int8::matmul_with(isa, Rows::Invariant, x, m, &w8, Some(&b), y))),
                ("int4", Box::new(|x: &[f32], m: usize, y: &mut [f32]| int4::matmul_with(isa, Rows::Invariant, x, m, &w4, Some(&b), y))),
                ("w8a8", Box::new(|x: &[f32], m: usize, y: &mut [f32]| w8a8::matmul_on(isa, x, m, &w8, Some(&b), y))),
            ];
            if m < super::TILE_MIN_ROWS {
                products.push(("int8 fastest", Box::new(|x: &[f32], m: usize, y: &mut [f32]| int8::matmul_with(isa, Rows::Fastest, x, m, &w8, None, y))));
                products.push(("int4 fastest", Box::new(|x: &[f32], m: usize, y: &mut [f32]| int4::matmul_with(isa, Rows::Fastest, x, m, &w4, None, y))));
            }
            for (name, product) in &products {
                let mut y = vec![f32::NAN; m * n];
                product(&x, m, &mut y);
                for r in 0..m {
                    let mut alone = vec![f32::NAN; n];
                    product(&x[r * k..(r + 1) * k], 1, &mut alone);
                    let batched = &y[r * n..(r + 1) * n];
                    let same = alone.iter().zip(batched).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{name} {isa:?} m={m} n={n} k={k} group={group}: row {r} alone is {alone:?}, in the batch {batched:?}");
                }
            }
        }
    }
}
