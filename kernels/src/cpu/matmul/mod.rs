//! Batched matrix products `C[b] (+)= op(A[b]) · op(B[b])` on row-major buffers.
//!
//! Large f32 products on CPUs with AVX-512F run a packed, cache-blocked
//! kernel of our own (`avx512.rs`, detected at run time, so the binary still
//! runs on any x86-64); everything else goes to the `gemm` crate, which is
//! as fast on small products and is the portable path. Small products never
//! touch the thread pool; batches of them run one product per task.
//!
//! bf16 products ([`matmul_bf16`]) run on the AVX-512 BF16 dot-product
//! instruction where the CPU has it (`avx512_bf16.rs`), reading bf16
//! operands directly and accumulating in f32; elsewhere they widen to f32
//! and take the f32 path.

use crate::desc::Gemm;
use crate::Real;
use gemm::Parallelism;
use half::bf16;
use rayon::prelude::*;
#[cfg(target_arch = "x86_64")]
use std::any::TypeId;

mod rows;
pub use rows::{dot_canonical, matmul_rows};

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_bf16;

/// From this many multiply-adds on, one product is split over the rayon
/// pool (about 40 µs of single-core work): below it, waking the pool costs
/// more than it saves. Smaller products in a batch run one per task instead.
const PAR_MIN_MACS: usize = 1 << 22;

/// From this many multiply-adds on (with both `m` and `n` at least
/// [`BLOCKED_MIN_DIM`]), f32 products use the packed AVX-512 kernel: below
/// it `gemm`'s small-matrix paths are as fast or faster, above it `gemm`
/// falls behind (see docs/performance.md).
const BLOCKED_MIN_MACS: usize = 256 * 256 * 256;
/// Thinner products leave the 12×32 micro-tiles mostly empty.
const BLOCKED_MIN_DIM: usize = 64;

/// Computes `C[b] (+)= op(A[b]) · op(B[b])` for every batch `b` (see [`Gemm`]).
///
/// `a` holds `A[b]` at offset `b·batch_stride_a`, each `m×k` row-major (or
/// `k×m` when `trans_a`); `b` likewise with `k×n` (or `n×k` when `trans_b`);
/// `c` is `batch×m×n` contiguous. With `k == 0` the product is zero (so `C` is
/// zeroed, or left untouched when accumulating). Results do not depend on the
/// number of threads: every element's sum over `k` runs in a fixed order.
pub fn matmul<T: Real>(g: &Gemm, a: &[T], b: &[T], c: &mut [T]) {
    product(g, a, b, None, c)
}

/// `C[b] = op(A[b]) · op(B[b]) + bias` for every batch `b`, the `n` values of
/// `bias` added to every row of every `C[b]`: a linear layer's forward in
/// one pass over `C` instead of two. Rounds exactly like [`matmul`] followed
/// by a separate bias add. `g.accumulate` must be off.
pub fn matmul_bias<T: Real>(g: &Gemm, a: &[T], b: &[T], bias: &[T], c: &mut [T]) {
    assert!(!g.accumulate, "matmul_bias: accumulating into C is not supported");
    assert_eq!(bias.len(), g.n, "matmul_bias: the bias must have n elements");
    product(g, a, b, Some(bias), c)
}

fn product<T: Real>(g: &Gemm, a: &[T], b: &[T], bias: Option<&[T]>, c: &mut [T]) {
    assert!(a.len() >= g.len_a(), "matmul: A has {} elements, needs {}", a.len(), g.len_a());
    assert!(b.len() >= g.len_b(), "matmul: B has {} elements, needs {}", b.len(), g.len_b());
    assert_eq!(c.len(), g.len_c(), "matmul: C must have batch*m*n elements");
    let (m, k, n) = (g.m, g.k, g.n);
    if g.batch == 0 || m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        match bias {
            Some(bias) => c.chunks_exact_mut(n).for_each(|row| row.copy_from_slice(bias)),
            None if !g.accumulate => c.fill(T::zero()),
            None => {}
        }
        return;
    }
    let one = |bi: usize, c_b: &mut [T], par: Parallelism| {
        let a_b = &a[bi * g.batch_stride_a..][..m * k];
        let b_b = &b[bi * g.batch_stride_b..][..k * n];
        single(g, a_b, b_b, bias, c_b, par);
    };
    let macs = m * n * k;
    if macs >= PAR_MIN_MACS {
        // Large products: parallelise inside each product.
        let par = Parallelism::Rayon(rayon::current_num_threads());
        for (bi, c_b) in c.chunks_mut(m * n).enumerate() {
            one(bi, c_b, par);
        }
    } else if macs.saturating_mul(g.batch) >= PAR_MIN_MACS {
        // Many small products: one product per task, each sequential.
        c.par_chunks_mut(m * n).enumerate().for_each(|(bi, c_b)| one(bi, c_b, Parallelism::None));
    } else {
        for (bi, c_b) in c.chunks_mut(m * n).enumerate() {
            one(bi, c_b, Parallelism::None);
        }
    }
}

/// One product on already-sliced operands.
fn single<T: Real>(g: &Gemm, a: &[T], b: &[T], bias: Option<&[T]>, c: &mut [T], par: Parallelism) {
    let (m, k, n) = (g.m, g.k, g.n);
    let (a_rs, a_cs) = if g.trans_a { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if g.trans_b { (1, k) } else { (n, 1) };
    #[cfg(target_arch = "x86_64")]
    if TypeId::of::<T>() == TypeId::of::<f32>() && m * n * k >= BLOCKED_MIN_MACS && m.min(n) >= BLOCKED_MIN_DIM && avx512::available() {
        let threads = match par {
            Parallelism::None => 1,
            _ => rayon::current_num_threads(),
        };
        // SAFETY: T is f32 (checked above), so the pointer casts only rename
        // the type; the slices cover every element the strides address (the
        // caller sliced them to m*k, k*n and m*n); `c` is a distinct `&mut`.
        unsafe {
            let av = avx512::View { ptr: a.as_ptr() as *const f32, rs: a_rs, cs: a_cs };
            let bv = avx512::View { ptr: b.as_ptr() as *const f32, rs: b_rs, cs: b_cs };
            let start = match bias {
                Some(bias) => avx512::Start::Bias(std::slice::from_raw_parts(bias.as_ptr() as *const f32, bias.len())),
                None if g.accumulate => avx512::Start::Accumulate,
                None => avx512::Start::Overwrite,
            };
            avx512::gemm_f32(m, n, k, av, bv, c.as_mut_ptr() as *mut f32, start, threads);
        }
        return;
    }
    gemm_call(m, k, n, a, a_rs, a_cs, b, b_rs, b_cs, c, g.accumulate, par);
    if let Some(bias) = bias {
        for row in c.chunks_exact_mut(n) {
            for (x, &b) in row.iter_mut().zip(bias) {
                *x += b;
            }
        }
    }
}

/// Whether [`matmul_bf16`] runs natively on this CPU (AVX-512 BF16, checked
/// at run time). Without it, bf16 products are computed by widening the
/// operands to f32, which is what callers that account for memory should do
/// themselves.
pub fn bf16_native() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512_bf16::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`matmul`] on bf16 operands: every element of `C` is one f32 sum over the
/// depth (plus the old `C` when `g.accumulate`), rounded once to bf16.
///
/// With [`bf16_native`], the products run on the CPU's bf16 dot-product
/// instruction, whose partial sums flush denormals to zero (a bf16 operand
/// below `2^-126` in magnitude contributes nothing); otherwise the operands
/// are widened into temporary f32 buffers and multiplied by the f32 path. The
/// result does not depend on the number of threads.
pub fn matmul_bf16(g: &Gemm, a: &[bf16], b: &[bf16], c: &mut [bf16]) {
    product_bf16(g, a, b, None, c)
}

/// [`matmul_bias`] on bf16 operands: `C = op(A)·op(B) + bias`, the sum and the
/// bias added in f32 and rounded once to bf16 (see [`matmul_bf16`]).
/// `g.accumulate` must be off.
pub fn matmul_bias_bf16(g: &Gemm, a: &[bf16], b: &[bf16], bias: &[bf16], c: &mut [bf16]) {
    assert!(!g.accumulate, "matmul_bias: accumulating into C is not supported");
    assert_eq!(bias.len(), g.n, "matmul_bias: the bias must have n elements");
    product_bf16(g, a, b, Some(bias), c)
}

fn product_bf16(g: &Gemm, a: &[bf16], b: &[bf16], bias: Option<&[bf16]>, c: &mut [bf16]) {
    assert!(a.len() >= g.len_a(), "matmul: A has {} elements, needs {}", a.len(), g.len_a());
    assert!(b.len() >= g.len_b(), "matmul: B has {} elements, needs {}", b.len(), g.len_b());
    assert_eq!(c.len(), g.len_c(), "matmul: C must have batch*m*n elements");
    let (m, k, n) = (g.m, g.k, g.n);
    if g.batch == 0 || m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        match bias {
            Some(bias) => c.chunks_exact_mut(n).for_each(|row| row.copy_from_slice(bias)),
            None if !g.accumulate => c.fill(bf16::ZERO),
            None => {}
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx512_bf16::available() {
        let one = |bi: usize, c_b: &mut [bf16], threads: usize| {
            let a_b = &a[bi * g.batch_stride_a..][..m * k];
            let b_b = &b[bi * g.batch_stride_b..][..k * n];
            let (a_rs, a_cs) = if g.trans_a { (1, m) } else { (k, 1) };
            let (b_rs, b_cs) = if g.trans_b { (1, k) } else { (n, 1) };
            let bits = |x: &[bf16]| bytemuck::cast_slice::<bf16, u16>(x).as_ptr();
            let av = avx512_bf16::View { ptr: bits(a_b), rs: a_rs, cs: a_cs };
            let bv = avx512_bf16::View { ptr: bits(b_b), rs: b_rs, cs: b_cs };
            let start = match bias {
                Some(bias) => avx512_bf16::Start::Bias(bytemuck::cast_slice(bias)),
                None if g.accumulate => avx512_bf16::Start::Accumulate,
                None => avx512_bf16::Start::Overwrite,
            };
            let out = bytemuck::cast_slice_mut::<bf16, u16>(c_b).as_mut_ptr();
            // SAFETY: the CPU features were checked; the views address the
            // m×k and k×n elements of the slices taken above, with one unit
            // stride each; `c_b` has m*n elements and is a distinct `&mut`.
            unsafe { avx512_bf16::gemm_bf16(m, n, k, av, bv, out, start, threads) };
        };
        let macs = m * n * k;
        if macs >= PAR_MIN_MACS {
            let threads = rayon::current_num_threads();
            c.chunks_mut(m * n).enumerate().for_each(|(bi, c_b)| one(bi, c_b, threads));
        } else if macs.saturating_mul(g.batch) >= PAR_MIN_MACS {
            c.par_chunks_mut(m * n).enumerate().for_each(|(bi, c_b)| one(bi, c_b, 1));
        } else {
            c.chunks_mut(m * n).enumerate().for_each(|(bi, c_b)| one(bi, c_b, 1));
        }
        return;
    }
    // The portable path: the f32 product of the widened operands, rounded once to bf16.
    let widen = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    let mut c32 = if g.accumulate { widen(c) } else { vec![0f32; c.len()] };
    let (a32, b32) = (widen(&a[..g.len_a()]), widen(&b[..g.len_b()]));
    match bias {
        Some(bias) => matmul_bias(g, &a32, &b32, &widen(bias), &mut c32),
        None => matmul(g, &a32, &b32, &mut c32),
    }
    for (o, &v) in c.iter_mut().zip(&c32) {
        *o = bf16::from_f32(v);
    }
}

#[allow(clippy::too_many_arguments)]
fn gemm_call<U: Real>(
    m: usize,
    k: usize,
    n: usize,
    a: &[U],
    a_rs: usize,
    a_cs: usize,
    b: &[U],
    b_rs: usize,
    b_cs: usize,
    c: &mut [U],
    accumulate: bool,
    par: Parallelism,
) {
    // SAFETY: the slices cover every element addressed by the given sizes and
    // strides (checked by the caller), and `c` does not alias `a` or `b`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            U::one(),
            U::one(),
            false,
            false,
            false,
            par,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{assert_close, dot, numeric_grad, rand_vec};

    /// Straightforward triple loop in f64: the reference every path is held to.
    fn naive(g: &Gemm, a: &[f64], b: &[f64], c0: &[f64]) -> Vec<f64> {
        let (m, k, n) = (g.m, g.k, g.n);
        let mut c = c0.to_vec();
        for bi in 0..g.batch {
            let a_b = &a[bi * g.batch_stride_a..];
            let b_b = &b[bi * g.batch_stride_b..];
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0.0;
                    for p in 0..k {
                        let x = if g.trans_a { a_b[p * m + i] } else { a_b[i * k + p] };
                        let y = if g.trans_b { b_b[j * k + p] } else { b_b[p * n + j] };
                        s += x * y;
                    }
                    let dst = &mut c[(bi * m + i) * n + j];
                    *dst = if g.accumulate { *dst + s } else { s };
                }
            }
        }
        c
    }

    fn to32(x: &[f64]) -> Vec<f32> {
        x.iter().map(|&v| v as f32).collect()
    }

    fn to64(x: &[f32]) -> Vec<f64> {
        x.iter().map(|&v| v as f64).collect()
    }

    /// Runs `g` in f64 and f32 on random inputs and compares both with [`naive`].
    fn check(g: Gemm, seed: u64) {
        let a = rand_vec(seed, g.len_a());
        let b = rand_vec(seed + 1, g.len_b());
        let c0 = rand_vec(seed + 2, g.len_c());
        let expected = naive(&g, &a, &b, &c0);
        let what = format!("{g:?}");

        let mut c = c0.clone();
        matmul(&g, &a, &b, &mut c);
        assert_close(&c, &expected, 1e-12, 1e-12, &format!("f64 {what}"));

        let mut c32 = to32(&c0);
        matmul(&g, &to32(&a), &to32(&b), &mut c32);
        // f32 rounding grows with the depth of each dot product.
        let atol = 2e-6 * (g.k as f64 + 4.0);
        assert_close(&to64(&c32), &expected, atol, 1e-5, &format!("f32 {what}"));
    }

    #[test]
    fn every_layout_matches_naive() {
        // (batch, m, k, n): odd sizes, non-square shapes, shapes that reach
        // the packed f32 kernel with edge tiles, several depth blocks, several
        // row blocks, and a split along n rather than m.
        let shapes = [
            (1, 1, 1, 1),
            (2, 3, 17, 1),
            (3, 1, 129, 3),
            (2, 17, 3, 129),
            (1, 129, 17, 3),
            (2, 17, 129, 17),
            (1, 129, 129, 129),
            (1, 200, 300, 70),
            (1, 13, 290, 300),
        ];
        let mut seed = 10;
        for &(batch, m, k, n) in &shapes {
            for ta in [false, true] {
                for tb in [false, true] {
                    for acc in [false, true] {
                        for (bcast_a, bcast_b) in [(false, false), (true, false), (false, true)] {
                            let mut g = Gemm::new(batch, m, k, n).trans_a(ta).trans_b(tb).accumulate(acc);
                            if bcast_a {
                                g = g.batch_stride_a(0);
                            }
                            if bcast_b {
                                g = g.batch_stride_b(0);
                            }
                            check(g, seed);
                            seed += 3;
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn many_small_products_match_naive() {
        // Enough work to run the batch in parallel, each product sequential.
        check(Gemm::new(64, 16, 24, 20), 1);
        check(Gemm::new(64, 16, 24, 20).trans_b(true).batch_stride_b(0).accumulate(true), 2);
        // Large products in a batch, each parallel inside.
        check(Gemm::new(3, 100, 130, 140).trans_a(true), 3);
    }

    #[test]
    fn empty_dimensions() {
        // k == 0: the product is zero.
        let g = Gemm::new(2, 3, 0, 4);
        let mut c = vec![7.0f32; g.len_c()];
        matmul(&g, &[], &[], &mut c);
        assert!(c.iter().all(|&v| v == 0.0));
        let mut c = vec![7.0f32; g.len_c()];
        matmul(&g.accumulate(true), &[], &[], &mut c);
        assert!(c.iter().all(|&v| v == 7.0));
        // m == 0 or n == 0: nothing to do, and zero-length buffers are fine.
        let mut c: Vec<f64> = vec![];
        matmul(&Gemm::new(2, 0, 5, 4), &[], &rand_vec(1, 40), &mut c);
        matmul(&Gemm::new(2, 3, 5, 0), &rand_vec(1, 30), &[], &mut c);
        matmul(&Gemm::new(0, 3, 5, 4), &[], &[], &mut c);
    }

    #[test]
    #[should_panic(expected = "C must have")]
    fn wrong_output_size_panics() {
        let mut c = vec![0.0f64; 5];
        matmul(&Gemm::new(1, 2, 2, 2), &[0.0; 4], &[0.0; 4], &mut c);
    }

    #[test]
    fn f32_tracks_f64_on_a_large_product() {
        // Big enough for the packed kernel where the CPU has it, with two
        // depth blocks and edge tiles in both directions.
        let g = Gemm::new(1, 260, 1100, 70);
        let a = rand_vec(5, g.len_a());
        let b = rand_vec(6, g.len_b());
        let mut c64 = vec![0.0; g.len_c()];
        matmul(&g, &a, &b, &mut c64);
        let mut c32 = vec![0.0f32; g.len_c()];
        matmul(&g, &to32(&a), &to32(&b), &mut c32);
        assert_close(&to64(&c32), &c64, 1e-4, 1e-5, "f32 vs f64");
    }

    /// `C = A·B` with one weight matrix `B` broadcast over the batch (a linear
    /// layer), and the two backward products written with this API.
    #[test]
    fn backward_identities_match_finite_differences() {
        for &(batch, m, k, n) in &[(1, 3, 17, 1), (2, 17, 3, 129), (3, 5, 7, 4), (1, 129, 3, 17)] {
            let fwd = Gemm::new(batch, m, k, n).batch_stride_b(0);
            let a = rand_vec(1, fwd.len_a());
            let b = rand_vec(2, fwd.len_b());
            let dc = rand_vec(3, fwd.len_c());
            let loss_a = |a: &[f64]| {
                let mut c = vec![0.0; fwd.len_c()];
                matmul(&fwd, a, &b, &mut c);
                dot(&c, &dc)
            };
            let loss_b = |b: &[f64]| {
                let mut c = vec![0.0; fwd.len_c()];
                matmul(&fwd, &a, b, &mut c);
                dot(&c, &dc)
            };
            // dA[b] = dC[b]·Bᵀ: B is stored k×n, i.e. "n'×k'" for m'=m, k'=n, n'=k.
            let ga = Gemm::new(batch, m, n, k).trans_b(true).batch_stride_b(0);
            let mut da = vec![0.0; fwd.len_a()];
            matmul(&ga, &dc, &b, &mut da);
            assert_close(&da, &numeric_grad(loss_a, &a, 1e-6), 1e-7, 1e-6, "dA");
            // dB = Σ_b A[b]ᵀ·dC[b] = A_allᵀ·dC_all over the batch·m stacked rows.
            let gb = Gemm::new(1, k, batch * m, n).trans_a(true);
            let mut db = vec![0.0; fwd.len_b()];
            matmul(&gb, &a, &dc, &mut db);
            assert_close(&db, &numeric_grad(loss_b, &b, 1e-6), 1e-7, 1e-6, "dB");
            // The same dB as per-batch accumulation, as a runtime may do it.
            let gb1 = Gemm::new(1, k, m, n).trans_a(true).accumulate(true);
            let mut db2 = vec![0.0; fwd.len_b()];
            for bi in 0..batch {
                matmul(&gb1, &a[bi * m * k..], &dc[bi * m * n..(bi + 1) * m * n], &mut db2);
            }
            assert_close(&db2, &db, 1e-12, 1e-12, "dB accumulated");
        }
    }

    #[test]
    fn results_identical_run_to_run_and_across_thread_counts() {
        let shapes = [
            Gemm::new(1, 160, 300, 170),
            Gemm::new(1, 20, 520, 400).trans_b(true),
            Gemm::new(2, 130, 90, 70).trans_a(true),
            Gemm::new(1, 250, 270, 260).trans_a(true),
        ];
        for g in shapes {
            let a = to32(&rand_vec(7, g.len_a()));
            let b = to32(&rand_vec(8, g.len_b()));
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let mut c = vec![0.0f32; g.len_c()];
                pool.install(|| matmul(&g, &a, &b, &mut c));
                c
            };
            let first = run(1);
            for threads in [1, 2, 3, 4] {
                let c = run(threads);
                assert!(first.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()), "{g:?}: {threads} threads differ from 1 thread");
            }
        }
    }

    /// The fused bias rounds exactly like a separate add after the product,
    /// on the packed f32 kernel (full and edge tiles, two depth blocks, two
    /// column blocks, transposed operands, any thread count) and on the
    /// general path (f64, small products), and with an empty depth.
    #[test]
    fn bias_is_added_as_a_separate_add_would() {
        fn check<T: Real>(g: Gemm, threads: usize) {
            let f = |seed, n| rand_vec(seed, n).into_iter().map(T::lit).collect::<Vec<T>>();
            let (a, b, bias) = (f(1, g.len_a()), f(2, g.len_b()), f(3, g.n));
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut want = vec![T::zero(); g.len_c()];
                matmul(&g, &a, &b, &mut want);
                for row in want.chunks_exact_mut(g.n.max(1)) {
                    for (x, &b) in row.iter_mut().zip(&bias) {
                        *x += b;
                    }
                }
                let mut got = vec![T::nan(); g.len_c()];
                matmul_bias(&g, &a, &b, &bias, &mut got);
                let same = got.iter().zip(&want).all(|(x, y)| x.to_f64().unwrap().to_bits() == y.to_f64().unwrap().to_bits());
                assert!(same, "{g:?} with {threads} threads");
            });
        }
        for threads in [1, 2, 3] {
            for g in [
                Gemm::new(1, 300, 1100, 170),
                Gemm::new(1, 130, 70, 4096 + 40).trans_b(true),
                Gemm::new(2, 97, 300, 65).trans_a(true).batch_stride_b(0),
                Gemm::new(1, 5, 0, 7),
            ] {
                check::<f32>(g, threads);
                check::<f64>(g, threads);
            }
        }
    }

    fn to_bf16(x: &[f64]) -> Vec<bf16> {
        x.iter().map(|&v| bf16::from_f64(v)).collect()
    }

    fn bf16_to64(x: &[bf16]) -> Vec<f64> {
        x.iter().map(|v| v.to_f64()).collect()
    }

    /// Checks a bf16 product against the f64 product of the same (bf16)
    /// values, element by element, with the bound the arithmetic guarantees.
    ///
    /// The f32 sum of `k` exact products (bf16 × bf16 fits in f32), plus
    /// the old `C` or the bias, is a chain of at most `k + 1` roundings of
    /// relative size `u = 2^-24`, so it differs from the exact value `s` by at
    /// most `γ·S` with `γ = (k+1)u / (1 - (k+1)u)` and `S` the sum of the
    /// magnitudes of the terms; the native instruction may also flush a
    /// partial sum below `2^-126` to zero, at most `2^-126` per step, and
    /// treats bf16 inputs below `2^-126` as zero (the random inputs here are
    /// far above it). Rounding that f32 value once to bf16 (8 significant
    /// bits, to nearest) adds at most `2^-8` of it, or `2^-134` in bf16's
    /// denormal range. So
    /// `|got - s| <= 2^-8·|s| + (1 + 2^-8)·(γ·S + (k+1)·2^-126) + 2^-134`.
    fn check_bf16(g: Gemm, bias: bool, seed: u64) {
        let a = to_bf16(&rand_vec(seed, g.len_a()));
        let b = to_bf16(&rand_vec(seed + 1, g.len_b()));
        let c0 = to_bf16(&rand_vec(seed + 2, g.len_c()));
        let bias_v = to_bf16(&rand_vec(seed + 3, g.n));
        let (a64, b64, c64) = (bf16_to64(&a), bf16_to64(&b), bf16_to64(&c0));
        let mut exact = naive(&g, &a64, &b64, &c64);
        let abs = |x: &[f64]| x.iter().map(|v| v.abs()).collect::<Vec<f64>>();
        // S: the same sum over magnitudes.
        let mut mag = naive(&g, &abs(&a64), &abs(&b64), &abs(&c64));
        let mut c = c0.clone();
        if bias {
            matmul_bias_bf16(&g, &a, &b, &bias_v, &mut c);
            for (i, (e, s)) in exact.iter_mut().zip(&mut mag).enumerate() {
                let bv = bias_v[i % g.n.max(1)].to_f64();
                *e += bv;
                *s += bv.abs();
            }
        } else {
            matmul_bf16(&g, &a, &b, &mut c);
        }
        let u = 2f64.powi(-24);
        let steps = (g.k + 1) as f64;
        let gamma = steps * u / (1.0 - steps * u);
        for (i, ((&got, &s), &mag)) in c.iter().zip(&exact).zip(&mag).enumerate() {
            let bound = 2f64.powi(-8) * s.abs() + (1.0 + 2f64.powi(-8)) * (gamma * mag + steps * 2f64.powi(-126)) + 2f64.powi(-134);
            let got = got.to_f64();
            assert!((got - s).abs() <= bound, "{g:?} bias={bias}: element {i}: got {got}, exact {s}, bound {bound}");
        }
    }

    #[test]
    fn bf16_products_stay_within_the_rounding_bound() {
        // Odd sizes, sizes one off the micro-tile (12×32) and off every block,
        // odd depths (a lone last value per row), several row blocks, and
        // every storage order, with and without accumulation and bias.
        let shapes = [
            (1, 1, 1, 1),
            (1, 7, 7, 7),
            (2, 13, 63, 33),
            (1, 63, 65, 31),
            (1, 65, 129, 63),
            (1, 129, 1, 65),
            (3, 5, 7, 129),
            (1, 200, 1001, 70),
            (1, 25, 2, 97),
        ];
        let mut seed = 100;
        for &(batch, m, k, n) in &shapes {
            for ta in [false, true] {
                for tb in [false, true] {
                    for (acc, bias) in [(false, false), (true, false), (false, true)] {
                        check_bf16(Gemm::new(batch, m, k, n).trans_a(ta).trans_b(tb).accumulate(acc), bias, seed);
                        seed += 4;
                    }
                }
            }
        }
        // A weight shared by the batch (a linear layer), and one left operand
        // shared instead.
        check_bf16(Gemm::new(4, 17, 40, 50).batch_stride_b(0).trans_b(true), true, 7);
        check_bf16(Gemm::new(3, 30, 41, 20).batch_stride_a(0).trans_a(true).accumulate(true), false, 8);
        // Many small products in parallel, and large ones split inside.
        check_bf16(Gemm::new(64, 16, 24, 20), false, 9);
        check_bf16(Gemm::new(2, 150, 130, 260).trans_a(true), false, 10);
    }

    #[test]
    fn bf16_product_wider_than_one_packed_column_block() {
        // Deep enough that the packed right operand is split into column
        // blocks (16 MiB each: 2048 columns at this depth), with an odd depth.
        check_bf16(Gemm::new(1, 13, 4097, 2100), true, 11);
        check_bf16(Gemm::new(1, 13, 4097, 2100).trans_b(true).accumulate(true), false, 12);
    }

    #[test]
    fn bf16_results_identical_across_thread_counts() {
        for g in [Gemm::new(1, 160, 300, 170), Gemm::new(1, 250, 271, 260).trans_a(true), Gemm::new(1, 20, 520, 400).trans_b(true), Gemm::new(6, 40, 64, 48)] {
            let a = to_bf16(&rand_vec(21, g.len_a()));
            let b = to_bf16(&rand_vec(22, g.len_b()));
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let mut c = vec![bf16::ZERO; g.len_c()];
                pool.install(|| matmul_bf16(&g, &a, &b, &mut c));
                c
            };
            let one = run(1);
            for threads in [2, 3, 4] {
                assert!(run(threads).iter().zip(&one).all(|(x, y)| x.to_bits() == y.to_bits()), "{g:?}: {threads} threads differ from 1");
            }
        }
    }

    /// What the instruction does with denormals, as documented on
    /// [`matmul_bf16`]: a bf16 operand below `2^-126` counts as zero on the
    /// native path, while the portable path keeps it (multiplied by `2^127`
    /// it is 1, plainly visible in the sum).
    #[test]
    fn bf16_denormal_inputs_follow_the_documented_semantics() {
        let tiny = bf16::from_bits(0x0040); // 2^-127, a bf16 denormal
        assert!(tiny.to_f32() > 0.0 && tiny.to_f32() < f32::MIN_POSITIVE);
        let g = Gemm::new(1, 1, 2, 1);
        let a = [tiny, bf16::ONE];
        let b = [bf16::from_f32(2.0f32.powi(127)), bf16::from_f32(1.5)];
        let mut c = [bf16::ZERO];
        matmul_bf16(&g, &a, &b, &mut c);
        let kept = bf16::from_f32(tiny.to_f32() * b[0].to_f32() + 1.5);
        let want = if bf16_native() { bf16::from_f32(1.5) } else { kept };
        assert_eq!(c[0].to_bits(), want.to_bits(), "kept would be {kept}");
        assert_ne!(kept.to_bits(), bf16::from_f32(1.5).to_bits(), "the case must tell the two apart");
    }
}
