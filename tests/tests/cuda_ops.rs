//! Every op with a CUDA implementation, run on the CPU and on the device
//! under test from the same inputs, compared within the dtype's tolerance.
//!
//! Each test is written once and runs per device (`device_test!`): on a CPU
//! device it compares the CPU with itself, on CUDA device 0 it compares the
//! GPU kernels with the CPU reference, and where there is no GPU it reports
//! `skipped: no CUDA device`.

use tessera::ops::{self, AdamWStep};
use tessera::{DType, Device, Tensor};
use tessera_tests::device_test;

/// The CPU device every reference result is computed on (operands of one
/// op must share a device, so the tests use one).
fn reference() -> &'static Device {
    static CPU: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    CPU.get_or_init(Device::cpu)
}

/// `n` reproducible values in `[-2, 2)` (a small LCG: the same on every machine).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// The same random tensor on the CPU and on `dev`, in `dtype`: both are
/// made from the same f32 values and rounded to `dtype` on the CPU, so the
/// two sides start from identical bits.
fn pair(dev: &Device, shape: &[usize], dtype: DType, seed: u64) -> (Tensor, Tensor) {
    let n = shape.iter().product();
    let cpu = Tensor::from_vec(values(n, seed), shape, reference()).unwrap().to_dtype(dtype).unwrap();
    (cpu.clone(), to_device(&cpu, dev))
}

/// A copy of the CPU tensor `t` on `dev`, bit for bit.
fn to_device(t: &Tensor, dev: &Device) -> Tensor {
    let shape = t.dims().to_vec();
    match t.dtype() {
        DType::F32 => Tensor::from_vec(t.to_vec::<f32>().unwrap(), shape, dev),
        DType::BF16 => Tensor::from_vec(t.to_vec::<tessera::bf16>().unwrap(), shape, dev),
        DType::F16 => Tensor::from_vec(t.to_vec::<tessera::f16>().unwrap(), shape, dev),
        DType::U32 => Tensor::from_vec(t.to_vec::<u32>().unwrap(), shape, dev),
        other => panic!("no test tensors of {other}"),
    }
    .unwrap()
}

/// Relative tolerance of a result stored in `dtype` (one or two roundings
/// of the output, plus f32 sums taken in another order).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1e-2,
        DType::F16 => 2e-3,
        _ => 2e-5,
    }
}

/// Asserts that the device result `got` matches the CPU result `want`: same
/// shape, dtype and device, every element within `tol` relative to the
/// largest magnitude of `want` (so values near zero are judged at the scale
/// of the tensor, not their own).
fn assert_close(what: &str, want: &Tensor, got: &Tensor, dev: &Device, tol: f64) {
    assert_eq!(want.dims(), got.dims(), "{what}: shape");
    assert_eq!(want.dtype(), got.dtype(), "{what}: dtype");
    assert!(got.device().same(dev), "{what}: the result is on {}, not on {dev}", got.device());
    let (w, g) = (want.to_f64_vec().unwrap(), got.to_f64_vec().unwrap());
    let scale = w.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
    for (i, (a, b)) in w.iter().zip(&g).enumerate() {
        assert!((a - b).abs() <= tol * scale, "{what}: element {i} is {b}, the CPU gives {a} (tolerance {tol} x {scale})");
    }
}

const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

device_test! {
    fn elementwise_ops_match_the_cpu(dev: &Device) {
        for dtype in FLOATS {
            let tol = tolerance(dtype);
            let (a, da) = pair(dev, &[7, 33], dtype, 1);
            let (b, db) = pair(dev, &[7, 33], dtype, 2);
            let (bias, dbias) = pair(dev, &[33], dtype, 3);
            assert_close("add", &ops::add(&a, &b).unwrap(), &ops::add(&da, &db).unwrap(), dev, tol);
            assert_close("sub", &ops::sub(&a, &b).unwrap(), &ops::sub(&da, &db).unwrap(), dev, tol);
            assert_close("mul", &ops::mul(&a, &b).unwrap(), &ops::mul(&da, &db).unwrap(), dev, tol);
            assert_close("scale", &ops::scale(&a, -0.37).unwrap(), &ops::scale(&da, -0.37).unwrap(), dev, tol);
            assert_close("add_bias", &ops::add_bias(&a, &bias).unwrap(), &ops::add_bias(&da, &dbias).unwrap(), dev, tol);
            assert_close("bias_grad", &ops::bias_grad(&a).unwrap(), &ops::bias_grad(&da).unwrap(), dev, tol);
            // Gradient accumulation into an f32 accumulator, from any dtype.
            let (acc, dacc) = pair(dev, &[7, 33], DType::F32, 30);
            ops::axpy(&acc, -0.25, &a).unwrap();
            ops::axpy(&dacc, -0.25, &da).unwrap();
            ops::accumulate(&acc, &b).unwrap();
            ops::accumulate(&dacc, &db).unwrap();
            assert_close("axpy and accumulate", &acc, &dacc, dev, 2e-5);
            let (cx, cy) = ops::mul_backward(&a, &b, &a).unwrap();
            let (gx, gy) = ops::mul_backward(&da, &db, &da).unwrap();
            assert_close("mul_backward a", &cx, &gx, dev, tol);
            assert_close("mul_backward b", &cy, &gy, dev, tol);
        }
    }
}

device_test! {
    fn activations_and_their_backwards_match_the_cpu(dev: &Device) {
        for dtype in FLOATS {
            let tol = tolerance(dtype);
            let (x, dx) = pair(dev, &[5, 129], dtype, 4);
            let (dy, ddy) = pair(dev, &[5, 129], dtype, 5);
            assert_close("gelu", &ops::gelu(&x).unwrap(), &ops::gelu(&dx).unwrap(), dev, tol);
            assert_close("gelu_backward", &ops::gelu_backward(&x, &dy).unwrap(), &ops::gelu_backward(&dx, &ddy).unwrap(), dev, tol);
            assert_close("silu", &ops::silu(&x).unwrap(), &ops::silu(&dx).unwrap(), dev, tol);
            assert_close("silu_backward", &ops::silu_backward(&x, &dy).unwrap(), &ops::silu_backward(&dx, &ddy).unwrap(), dev, tol);
        }
    }
}

device_test! {
    fn norms_and_their_backwards_match_the_cpu(dev: &Device) {
        for dtype in FLOATS {
            let tol = tolerance(dtype);
            // A row longer than one block's threads, and one shorter than a warp.
            for (rows, cols) in [(6, 1500), (9, 20)] {
                let (x, dx) = pair(dev, &[rows, cols], dtype, 6);
                let (gamma, dgamma) = pair(dev, &[cols], dtype, 7);
                let (beta, dbeta) = pair(dev, &[cols], dtype, 8);
                let (dy, ddy) = pair(dev, &[rows, cols], dtype, 9);
                for with_beta in [true, false] {
                    let (y, saved) = ops::layer_norm(&x, &gamma, with_beta.then_some(&beta), 1e-5).unwrap();
                    let (gy, gsaved) = ops::layer_norm(&dx, &dgamma, with_beta.then_some(&dbeta), 1e-5).unwrap();
                    assert_close("layer_norm", &y, &gy, dev, tol);
                    assert_close("layer_norm mean", saved.mean.as_ref().unwrap(), gsaved.mean.as_ref().unwrap(), dev, 2e-5);
                    assert_close("layer_norm rstd", &saved.rstd, &gsaved.rstd, dev, 2e-5);
                    let (cx, cg, cb) = ops::layer_norm_backward(&x, &gamma, with_beta, &saved, &dy).unwrap();
                    let (gx, gg, gb) = ops::layer_norm_backward(&dx, &dgamma, with_beta, &gsaved, &ddy).unwrap();
                    assert_close("layer_norm_backward dx", &cx, &gx, dev, tol);
                    assert_close("layer_norm_backward dgamma", &cg, &gg, dev, tol);
                    assert_eq!(cb.is_some(), gb.is_some());
                    if let (Some(cb), Some(gb)) = (cb, gb) {
                        assert_close("layer_norm_backward dbeta", &cb, &gb, dev, tol);
                    }
                }
                let (y, saved) = ops::rms_norm(&x, &gamma, 1e-6).unwrap();
                let (gy, gsaved) = ops::rms_norm(&dx, &dgamma, 1e-6).unwrap();
                assert_close("rms_norm", &y, &gy, dev, tol);
                assert_close("rms_norm rstd", &saved.rstd, &gsaved.rstd, dev, 2e-5);
                let (cx, cg) = ops::rms_norm_backward(&x, &gamma, &saved, &dy).unwrap();
                let (gx, gg) = ops::rms_norm_backward(&dx, &dgamma, &gsaved, &ddy).unwrap();
                assert_close("rms_norm_backward dx", &cx, &gx, dev, tol);
                assert_close("rms_norm_backward dgamma", &cg, &gg, dev, tol);
            }
        }
    }
}

device_test! {
    fn sums_match_the_cpu(dev: &Device) {
        for dtype in FLOATS {
            // The sums are f32 whatever the input: f32 tolerance, at the scale of the sum of magnitudes.
            let (x, dx) = pair(dev, &[3, 1000], dtype, 10);
            let (s, gs) = (ops::sum(&x).unwrap(), ops::sum(&dx).unwrap());
            assert_eq!(gs.dtype(), DType::F32);
            let magnitude: f64 = x.to_f64_vec().unwrap().iter().map(|v| v.abs()).sum();
            assert!((s.to_scalar().unwrap() - gs.to_scalar().unwrap()).abs() <= 1e-5 * magnitude, "sum {s:?} vs {gs:?}");
            assert_close("sum_squares", &ops::sum_squares(&x).unwrap(), &ops::sum_squares(&dx).unwrap(), dev, 1e-5);
            let (dy, ddy) = pair(dev, &[], dtype, 31);
            assert_close("sum_backward", &ops::sum_backward(&dy, [4, 5]).unwrap(), &ops::sum_backward(&ddy, [4, 5]).unwrap(), dev, 0.0);
        }
    }
}

device_test! {
    fn matrix_products_match_the_cpu(dev: &Device) {
        for dtype in FLOATS {
            // Products of up to 64 terms, each input rounded to dtype: the
            // output's own rounding dominates.
            let tol = tolerance(dtype).max(1e-5);
            let (a, da) = pair(dev, &[2, 5, 64], dtype, 11);
            let (w, dw) = pair(dev, &[64, 7], dtype, 12);
            let (wt, dwt) = pair(dev, &[7, 64], dtype, 13);
            let (b, db) = pair(dev, &[2, 64, 3], dtype, 14);
            let (bias, dbias) = pair(dev, &[7], dtype, 15);
            let (at, dat) = pair(dev, &[2, 64, 5], dtype, 16);
            // A shared right operand, its transposed view, a batched product,
            // a transposed left operand, and the fused bias.
            assert_close("matmul shared", &ops::matmul(&a, &w).unwrap(), &ops::matmul(&da, &dw).unwrap(), dev, tol);
            assert_close("matmul w.t()", &ops::matmul(&a, &wt.t().unwrap()).unwrap(), &ops::matmul(&da, &dwt.t().unwrap()).unwrap(), dev, tol);
            assert_close("matmul batched", &ops::matmul(&a, &b).unwrap(), &ops::matmul(&da, &db).unwrap(), dev, tol);
            let (att, datt) = (at.transpose(1, 2).unwrap(), dat.transpose(1, 2).unwrap());
            assert_close("matmul a.t()", &ops::matmul(&att, &b).unwrap(), &ops::matmul(&datt, &db).unwrap(), dev, tol);
            assert_close("matmul_bias", &ops::matmul_bias(&a, &w, &bias).unwrap(), &ops::matmul_bias(&da, &dw, &dbias).unwrap(), dev, tol);
            let (dc, ddc) = pair(dev, &[2, 5, 7], dtype, 17);
            let (ca, cb) = ops::matmul_backward(&a, &w, &dc).unwrap();
            let (ga, gb) = ops::matmul_backward(&da, &dw, &ddc).unwrap();
            assert_close("matmul_backward da", &ca, &ga, dev, tol);
            // db sums over all ten rows of the batch as well.
            assert_close("matmul_backward db", &cb, &gb, dev, tol);
        }
    }
}

device_test! {
    fn dtype_conversions_and_strided_copies_match_the_cpu_exactly(dev: &Device) {
        for from in FLOATS {
            let (x, dx) = pair(dev, &[4, 6, 5], from, 18);
            for to in FLOATS {
                assert_close(&format!("to_dtype {from} -> {to}"), &x.to_dtype(to).unwrap(), &dx.to_dtype(to).unwrap(), dev, 0.0);
            }
            // Transposed, narrowed and permuted views made contiguous.
            let views = |t: &Tensor| vec![t.transpose(0, 2).unwrap(), t.narrow(1, 2, 3).unwrap(), t.transpose(1, 2).unwrap().narrow(0, 1, 2).unwrap()];
            for (i, (v, dv)) in views(&x).iter().zip(views(&dx)).enumerate() {
                assert!(!dv.is_contiguous(), "view {i} is strided");
                assert_close(&format!("contiguous view {i} of {from}"), &v.contiguous().unwrap(), &dv.contiguous().unwrap(), dev, 0.0);
            }
        }
        // Integer tensors move too (a copy is bits).
        let ids = Tensor::from_vec((0..24u32).collect::<Vec<_>>(), [4, 6], reference()).unwrap();
        let dids = to_device(&ids, dev);
        let (want, got) = (ids.t().unwrap().contiguous().unwrap(), dids.t().unwrap().contiguous().unwrap());
        assert_eq!(want.to_vec::<u32>().unwrap(), got.to_vec::<u32>().unwrap());
        assert_eq!(ids.to_dtype(DType::U32).unwrap().to_vec::<u32>().unwrap(), dids.to_dtype(DType::U32).unwrap().to_vec::<u32>().unwrap());
        // Joined end to end (a gradient bucket): a whole tensor, a strided
        // view, a view at an offset and an empty part.
        for dtype in FLOATS {
            let (x, dx) = pair(dev, &[4, 6], dtype, 30);
            let parts = |t: &Tensor| vec![t.clone(), t.t().unwrap(), t.narrow(0, 1, 2).unwrap(), t.narrow(1, 3, 0).unwrap()];
            let (p, dp) = (parts(&x), parts(&dx));
            let joined = Tensor::concat_flat(&p.iter().collect::<Vec<_>>()).unwrap();
            let djoined = Tensor::concat_flat(&dp.iter().collect::<Vec<_>>()).unwrap();
            assert_eq!(djoined.dims(), [24 + 24 + 12]);
            assert_close(&format!("concat_flat of {dtype}"), &joined, &djoined, dev, 0.0);
        }
    }
}

/// Each element of `t` as its bits (NaN as one value: a NaN's payload is not
/// part of the conversion's contract, and hardware canonicalises it).
fn bits(t: &Tensor) -> Vec<u64> {
    fn float(x: f64, bits: u64) -> u64 {
        if x.is_nan() {
            u64::MAX
        } else {
            bits
        }
    }
    match t.dtype() {
        DType::F32 => t.to_vec::<f32>().unwrap().iter().map(|&x| float(x as f64, x.to_bits() as u64)).collect(),
        DType::F64 => t.to_vec::<f64>().unwrap().iter().map(|&x| float(x, x.to_bits())).collect(),
        DType::BF16 => t.to_vec::<tessera::bf16>().unwrap().iter().map(|&x| float(x.to_f64(), x.to_bits() as u64)).collect(),
        DType::F16 => t.to_vec::<tessera::f16>().unwrap().iter().map(|&x| float(x.to_f64(), x.to_bits() as u64)).collect(),
        DType::I32 => t.to_vec::<i32>().unwrap().iter().map(|&x| x as u32 as u64).collect(),
        DType::U32 => t.to_vec::<u32>().unwrap().iter().map(|&x| x as u64).collect(),
    }
}

device_test! {
    /// Every dtype converts to every other as the CPU converts it, bit for
    /// bit: signed zeros, infinities, NaN, subnormals, ties of each rounding,
    /// values past every 16-bit float's and integer's range, and random
    /// values over forty decades.
    fn every_dtype_converts_to_every_other_as_on_the_cpu(dev: &Device) {
        const ALL: [DType; 6] = [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::U32];
        let mut edges = vec![
            0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 0.1, -123.456, 1e-8, 1e-40, 6e-8, 65504.0, 65519.0, 65520.0, 7e4, -7e4, 3.4e38,
            3.5e38, -1e39, 1e300, f64::INFINITY, f64::NEG_INFINITY, f64::NAN, 1.0 + f64::EPSILON, 1.0 + 2f64.powi(-24), 1.0 + 3.0 * 2f64.powi(-24),
            1.00390625, 1.01171875, 16777217.0, 2147483520.0, 2147483647.0, 2147483647.5, 2147483648.0, -2147483648.0, -2147483649.0,
            -2147483904.0, 4294967040.0, 4294967295.0, 4294967296.0, 1e10, -1e10, -0.99,
        ];
        edges.extend(values(400, 40).iter().enumerate().map(|(i, &v)| v as f64 * 10f64.powi(i as i32 % 41 - 20)));
        let n = edges.len();
        let source = Tensor::from_vec(edges, [n], reference()).unwrap();
        for from in ALL {
            let x = source.to_dtype(from).unwrap();
            let dx = x.to_device(dev).unwrap();
            assert_eq!(bits(&x), bits(&dx), "{from} moved to the device");
            for to in ALL {
                let (want, got) = (bits(&x.to_dtype(to).unwrap()), bits(&dx.to_dtype(to).unwrap()));
                if let Some(i) = (0..n).find(|&i| want[i] != got[i]) {
                    panic!("{from} -> {to}: element {i} ({} as {from}) converts to bits {:#x}, the CPU gives {:#x}", source.to_f64_vec().unwrap()[i], got[i], want[i]);
                }
            }
        }
        // An empty tensor converts to an empty tensor.
        let empty = Tensor::zeros([0], DType::F32, dev).unwrap();
        assert_eq!(empty.to_dtype(DType::F64).unwrap().dims(), [0]);
    }
}

device_test! {
    fn the_adamw_step_matches_the_cpu(dev: &Device) {
        for grad_dtype in [DType::F32, DType::BF16] {
            let (p, dp) = pair(dev, &[300], DType::F32, 19);
            let (m, dm) = (Tensor::zeros([300], DType::F32, reference()).unwrap(), Tensor::zeros([300], DType::F32, dev).unwrap());
            let (v, dv) = (Tensor::zeros([300], DType::F32, reference()).unwrap(), Tensor::zeros([300], DType::F32, dev).unwrap());
            for step in 1..=3 {
                let (g, dg) = pair(dev, &[300], grad_dtype, 20 + step);
                let s = AdamWStep { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step, grad_scale: 0.5 };
                ops::adamw_update(&s, &p, &g, &m, &v).unwrap();
                ops::adamw_update(&s, &dp, &dg, &dm, &dv).unwrap();
            }
            assert_close("adamw param", &p, &dp, dev, 1e-5);
            assert_close("adamw m", &m, &dm, dev, 1e-5);
            assert_close("adamw v", &v, &dv, dev, 1e-5);
        }
    }
}

device_test! {
    fn the_multi_tensor_adamw_step_matches_one_tensor_at_a_time(dev: &Device) {
        use ops::AdamWTarget;
        // Tensors of unlike sizes, one a view at an offset into a larger
        // buffer, each at its own update count (its own bias corrections).
        let sizes = [300, 1, 4097];
        let first_step = [1, 5, 2];
        let host: Vec<Tensor> = sizes.iter().enumerate().map(|(i, &n)| pair(dev, &[n], DType::F32, 40 + i as u64).0).collect();
        let backing = pair(dev, &[5000], DType::F32, 50);
        let mut params: Vec<Tensor> = sizes.iter().enumerate().map(|(i, &n)| pair(dev, &[n], DType::F32, 40 + i as u64).1).collect();
        params[2] = backing.1.narrow(0, 700, 4097).unwrap();
        let mut want: Vec<Tensor> = host.clone();
        want[2] = backing.0.narrow(0, 700, 4097).unwrap();
        let zeros = |d: &Device| -> Vec<Tensor> { sizes.iter().map(|&n| Tensor::zeros([n], DType::F32, d).unwrap()).collect() };
        let (wm, wv, m, v) = (zeros(reference()), zeros(reference()), zeros(dev), zeros(dev));
        for round in 0..3u64 {
            let grads: Vec<(Tensor, Tensor)> = sizes.iter().enumerate().map(|(i, &n)| pair(dev, &[n], DType::F32, 60 + 10 * round + i as u64)).collect();
            let step = |i: usize| AdamWStep { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step: first_step[i] + round, grad_scale: 0.5 };
            for i in 0..sizes.len() {
                ops::adamw_update(&step(i), &want[i], &grads[i].0, &wm[i], &wv[i]).unwrap();
            }
            let targets: Vec<AdamWTarget> = (0..sizes.len()).map(|i| AdamWTarget { step: step(i), param: &params[i], grad: &grads[i].1, m: &m[i], v: &v[i] }).collect();
            ops::adamw_update_many(&targets).unwrap();
        }
        for i in 0..sizes.len() {
            assert_close(&format!("param {i}"), &want[i], &params[i], dev, 1e-5);
            assert_close(&format!("m {i}"), &wm[i], &m[i], dev, 1e-5);
            assert_close(&format!("v {i}"), &wv[i], &v[i], dev, 1e-5);
        }
        // The view's neighbours in the backing buffer are untouched.
        for (start, len) in [(0, 700), (4797, 203)] {
            assert_close("outside the view", &backing.0.narrow(0, start, len).unwrap(), &backing.1.narrow(0, start, len).unwrap(), dev, 0.0);
        }
        // A tensor written by one update and used by another is refused.
        let s = AdamWStep { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0, step: 1, grad_scale: 1.0 };
        let (g, m2, v2) = (pair(dev, &[300], DType::F32, 90).1, zeros(dev).remove(0), zeros(dev).remove(0));
        let shared = [AdamWTarget { step: s, param: &params[0], grad: &g, m: &m[0], v: &v[0] }, AdamWTarget { step: s, param: &params[0], grad: &g, m: &m2, v: &v2 }];
        let e = ops::adamw_update_many(&shared).unwrap_err();
        assert!(e.to_string().contains("updates 0 and 1 share a tensor"), "{e}");
    }
}

device_test! {
    fn attention_and_its_backward_match_the_cpu(dev: &Device) {
        use ops::{AttnOpts, QkvHeads};
        for dtype in FLOATS {
            // Sums over up to 160 keys in another order than the CPU's.
            let tol = tolerance(dtype).max(1e-4);
            // Grouped-query heads; a partial last tile; both head-dim
            // instantiations (64 and 128, and 96 on the 128-wide one); a KV
            // cache (fewer queries than keys), causal and not. bf16 and f16
            // run the tensor-core kernels, f32 the CUDA-core ones.
            for (hq, hkv, tq, tkv, hd, causal) in
                [(4, 2, 100, 100, 64, true), (2, 2, 70, 70, 96, false), (4, 1, 30, 160, 32, true), (2, 1, 80, 80, 128, true), (2, 2, 50, 120, 128, false)]
            {
                let opts = AttnOpts { causal, scale: None };
                let what = |part: &str| format!("attention {dtype} {hq}/{hkv} heads {tq}x{tkv}x{hd} causal {causal}: {part}");
                let (q, dq) = pair(dev, &[2, hq, tq, hd], dtype, 40);
                let (k, dk) = pair(dev, &[2, hkv, tkv, hd], dtype, 41);
                let (v, dv) = pair(dev, &[2, hkv, tkv, hd], dtype, 42);
                let (go, dgo) = pair(dev, &[2, hq, tq, hd], dtype, 43);
                let (out, lse) = ops::attention(&q, &k, &v, opts).unwrap();
                let (gout, glse) = ops::attention(&dq, &dk, &dv, opts).unwrap();
                assert_close(&what("out"), &out, &gout, dev, tol);
                assert_close(&what("lse"), &lse, &glse, dev, 1e-5);
                let cpu = ops::attention_backward(&q, &k, &v, &out, &lse, &go, opts).unwrap();
                let gpu = ops::attention_backward(&dq, &dk, &dv, &gout, &glse, &dgo, opts).unwrap();
                assert_close(&what("dq"), &cpu.0, &gpu.0, dev, tol);
                assert_close(&what("dk"), &cpu.1, &gpu.1, dev, tol);
                assert_close(&what("dv"), &cpu.2, &gpu.2, dev, tol);
            }
            // The fused projection: 4 query heads on 2 kv heads of 64, 90 positions.
            let heads = QkvHeads { q_heads: 4, kv_heads: 2, head_dim: 64 };
            let opts = AttnOpts::causal();
            let (qkv, dqkv) = pair(dev, &[2, 90, heads.width()], dtype, 44);
            let (go, dgo) = pair(dev, &[2, 90, 4 * 64], dtype, 45);
            let (out, lse) = ops::attention_packed(&qkv, heads, opts).unwrap();
            let (gout, glse) = ops::attention_packed(&dqkv, heads, opts).unwrap();
            assert_close("attention_packed out", &out, &gout, dev, tol);
            assert_close("attention_packed lse", &lse, &glse, dev, 1e-5);
            let want = ops::attention_packed_backward(&qkv, &out, &lse, &go, heads, opts).unwrap();
            let got = ops::attention_packed_backward(&dqkv, &gout, &glse, &dgo, heads, opts).unwrap();
            assert_close("attention_packed_backward", &want, &got, dev, tol);
        }
    }
}

device_test! {
    fn softmax_and_log_softmax_match_the_cpu(dev: &Device) {
        for dtype in FLOATS {
            let tol = tolerance(dtype).max(1e-5);
            // A row longer than a block, and one shorter than a warp.
            for (rows, cols) in [(3, 1500), (7, 10)] {
                let (x, dx) = pair(dev, &[rows, cols], dtype, 50);
                let (dy, ddy) = pair(dev, &[rows, cols], dtype, 51);
                let (y, gy) = (ops::softmax(&x).unwrap(), ops::softmax(&dx).unwrap());
                assert_close("softmax", &y, &gy, dev, tol);
                assert_close("softmax_backward", &ops::softmax_backward(&y, &dy).unwrap(), &ops::softmax_backward(&gy, &ddy).unwrap(), dev, tol);
                let (l, gl) = (ops::log_softmax(&x).unwrap(), ops::log_softmax(&dx).unwrap());
                assert_close("log_softmax", &l, &gl, dev, tol);
                assert_close("log_softmax_backward", &ops::log_softmax_backward(&l, &dy).unwrap(), &ops::log_softmax_backward(&gl, &ddy).unwrap(), dev, tol);
            }
        }
    }
}

device_test! {
    fn cross_entropy_and_vocab_shards_match_the_cpu(dev: &Device) {
        let (rows, vocab) = (6, 1100);
        // Row 2 is ignored (target 7 is the ignore index).
        let targets = Tensor::from_vec(vec![3u32, 1099, 7, 0, 512, 64], [rows], reference()).unwrap();
        let dtargets = to_device(&targets, dev);
        for dtype in FLOATS {
            let tol = tolerance(dtype).max(1e-5);
            let (x, dx) = pair(dev, &[rows, vocab], dtype, 52);
            let (loss, saved) = ops::cross_entropy(&x, &targets, Some(7)).unwrap();
            let (gloss, gsaved) = ops::cross_entropy(&dx, &dtargets, Some(7)).unwrap();
            assert_close("cross_entropy loss", &loss, &gloss, dev, 1e-5);
            assert_close("cross_entropy lse", &saved.lse, &gsaved.lse, dev, 1e-5);
            assert_eq!(saved.count, gsaved.count);
            let want = ops::cross_entropy_backward(&x, &targets, Some(7), &saved, 0.5).unwrap();
            let got = ops::cross_entropy_backward(&dx, &dtargets, Some(7), &gsaved, 0.5).unwrap();
            assert_close("cross_entropy_backward", &want, &got, dev, tol);
            // The second half of the vocabulary as a shard.
            let (sx, sdx) = (x.narrow(1, 550, 550).unwrap(), dx.narrow(1, 550, 550).unwrap());
            let (lse, tl) = ops::vocab_shard_stats(&sx, &targets, 550, vocab, Some(7)).unwrap();
            let (glse, gtl) = ops::vocab_shard_stats(&sdx, &dtargets, 550, vocab, Some(7)).unwrap();
            assert_close("vocab_shard_stats lse", &lse, &glse, dev, 1e-5);
            assert_close("vocab_shard_stats target logit", &tl, &gtl, dev, 0.0);
            let (dl, gdl) = pair(dev, &[rows], DType::F32, 53);
            let want = ops::vocab_shard_backward(&sx, &targets, 550, vocab, Some(7), &saved.lse, &dl).unwrap();
            let got = ops::vocab_shard_backward(&sdx, &dtargets, 550, vocab, Some(7), &gsaved.lse, &gdl).unwrap();
            assert_close("vocab_shard_backward", &want, &got, dev, tol);
        }
    }
}

device_test! {
    fn embedding_and_its_backward_match_the_cpu_exactly(dev: &Device) {
        // Repeated ids (their rows sum in the CPU's order), and ids outside a shard.
        let ids = Tensor::from_vec(vec![4u32, 0, 9, 4, 4, 2, 9, 5], [2, 4], reference()).unwrap();
        let dids = to_device(&ids, dev);
        for dtype in FLOATS {
            let (table, dtable) = pair(dev, &[10, 33], dtype, 54);
            assert_close("embedding", &ops::embedding(&table, &ids).unwrap(), &ops::embedding(&dtable, &dids).unwrap(), dev, 0.0);
            let (shard, dshard) = (table.narrow(0, 3, 4).unwrap(), dtable.narrow(0, 3, 4).unwrap());
            assert_close("embedding_shard", &ops::embedding_shard(&shard, &ids, 3, 10).unwrap(), &ops::embedding_shard(&dshard, &dids, 3, 10).unwrap(), dev, 0.0);
            let (dout, ddout) = pair(dev, &[2, 4, 33], dtype, 55);
            let want = ops::embedding_backward(&ids, &dout, 10, 0, 10).unwrap();
            let got = ops::embedding_backward(&dids, &ddout, 10, 0, 10).unwrap();
            assert_close("embedding_backward", &want, &got, dev, 0.0);
            let want = ops::embedding_backward(&ids, &dout, 4, 3, 10).unwrap();
            let got = ops::embedding_backward(&dids, &ddout, 4, 3, 10).unwrap();
            assert_close("embedding_backward shard", &want, &got, dev, 0.0);
            // Accumulated into an f32 gradient (the overlapped backward's
            // other slices): the CPU adds in place, the GPU adds the part's
            // gradient; the same sums.
            let (acc, dacc) = pair(dev, &[4, 33], DType::F32, 56);
            ops::embedding_backward_accumulate(&acc, &ids, &dout, 3, 10).unwrap();
            ops::embedding_backward_accumulate(&dacc, &dids, &ddout, 3, 10).unwrap();
            assert_close("embedding_backward_accumulate", &acc, &dacc, dev, tolerance(dtype));
        }
    }
}

device_test! {
    fn swiglu_rope_dropout_and_max_abs_match_the_cpu(dev: &Device) {
        use ops::{QkvHeads, Rope};
        for dtype in FLOATS {
            let tol = tolerance(dtype);
            let (g, dg) = pair(dev, &[5, 129], dtype, 60);
            let (u, du) = pair(dev, &[5, 129], dtype, 61);
            let (dy, ddy) = pair(dev, &[5, 129], dtype, 62);
            assert_close("swiglu", &ops::swiglu(&g, &u).unwrap(), &ops::swiglu(&dg, &du).unwrap(), dev, tol);
            let (cg, cu) = ops::swiglu_backward(&g, &u, &dy).unwrap();
            let (gg, gu) = ops::swiglu_backward(&dg, &du, &ddy).unwrap();
            assert_close("swiglu_backward dgate", &cg, &gg, dev, tol);
            assert_close("swiglu_backward dup", &cu, &gu, dev, tol);

            // Positions that are not 0..seq (a KV cache continuing at 40).
            let rope = Rope::new(16, 64, 10000.0).unwrap();
            let positions: Vec<u32> = (40..47).collect();
            let (x, dx) = pair(dev, &[2, 3, 7, 16], dtype, 63);
            let (y, gy) = (ops::rope(&x, &rope, &positions).unwrap(), ops::rope(&dx, &rope, &positions).unwrap());
            assert_close("rope", &y, &gy, dev, tol);
            assert_close("rope_backward", &ops::rope_backward(&y, &rope, &positions).unwrap(), &ops::rope_backward(&gy, &rope, &positions).unwrap(), dev, tol);
            let heads = QkvHeads { q_heads: 4, kv_heads: 2, head_dim: 16 };
            let (qkv, dqkv) = pair(dev, &[2, 7, heads.width()], dtype, 64);
            let (y, gy) = (ops::rope_packed(&qkv, &rope, &positions, heads).unwrap(), ops::rope_packed(&dqkv, &rope, &positions, heads).unwrap());
            assert_close("rope_packed", &y, &gy, dev, tol);
            let (b, gb) = (ops::rope_packed_backward(&y, &rope, &positions, heads).unwrap(), ops::rope_packed_backward(&gy, &rope, &positions, heads).unwrap());
            assert_close("rope_packed_backward", &b, &gb, dev, tol);

            // The same mask bit for bit, from an offset that is not a multiple of 4.
            let key = tessera::RngKey::new(0x1234_5678_9abc, 3);
            let (x, dx) = pair(dev, &[1001], dtype, 65);
            for p in [0.0, 0.1, 0.5] {
                let (y, gy) = (ops::dropout(&x, p, key, 13).unwrap(), ops::dropout(&dx, p, key, 13).unwrap());
                assert_close(&format!("dropout p={p}"), &y, &gy, dev, 0.0);
                let (b, gb) = (ops::dropout_backward(&x, p, key, 13).unwrap(), ops::dropout_backward(&dx, p, key, 13).unwrap());
                assert_close(&format!("dropout_backward p={p}"), &b, &gb, dev, 0.0);
            }

            // The maximum is exact; a NaN anywhere makes it NaN.
            let (x, dx) = pair(dev, &[3, 1000], dtype, 66);
            assert_close("max_abs", &ops::max_abs(&x).unwrap(), &ops::max_abs(&dx).unwrap(), dev, 0.0);
            let mut v = vec![1.0f32; 2000];
            v[1234] = f32::NAN;
            let nan = to_device(&Tensor::from_vec(v, [2000], reference()).unwrap().to_dtype(dtype).unwrap(), dev);
            assert!(ops::max_abs(&nan).unwrap().to_scalar().unwrap().is_nan(), "max_abs of a NaN on {dev}");
        }
    }
}

/// The bit patterns of a float tensor's elements (NaNs compare too).
fn float_bits(t: &Tensor) -> Vec<u32> {
    match t.dtype() {
        DType::F32 => t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect(),
        DType::BF16 => t.to_vec::<tessera::bf16>().unwrap().iter().map(|v| v.to_bits() as u32).collect(),
        DType::F16 => t.to_vec::<tessera::f16>().unwrap().iter().map(|v| v.to_bits() as u32).collect(),
        other => panic!("no float bits of {other}"),
    }
}

device_test! {
    fn topk_and_its_backward_match_the_cpu_exactly(dev: &Device) {
        for dtype in FLOATS {
            // Rows shorter than a warp (k = row), MoE-sized, and longer than a
            // block with a sampling-sized k; few distinct values (ties
            // everywhere), NaNs, -inf, and -0 beside +0 (equal, so by index).
            for (rows, row, k) in [(3, 5, 5), (64, 256, 8), (2, 5000, 64)] {
                let mut v: Vec<f32> = values(rows * row, 70 + row as u64).iter().map(|x| (x * 3.0).round()).collect();
                for j in (0..v.len()).step_by(13) {
                    v[j] = f32::NAN;
                }
                (v[1], v[2], v[3]) = (f32::NEG_INFINITY, -0.0, 0.0);
                let x = Tensor::from_vec(v, [rows, row], reference()).unwrap().to_dtype(dtype).unwrap();
                let (cv, ci) = ops::topk(&x, k).unwrap();
                let (gv, gi) = ops::topk(&to_device(&x, dev), k).unwrap();
                let what = format!("topk {dtype} [{rows}, {row}] k={k}");
                assert!(gv.device().same(dev) && gi.device().same(dev), "{what}: the results are on {}, not on {dev}", gv.device());
                assert_eq!((gv.dims(), gi.dims(), gv.dtype(), gi.dtype()), (cv.dims(), ci.dims(), dtype, DType::U32), "{what}");
                assert_eq!(gi.to_vec::<u32>().unwrap(), ci.to_vec::<u32>().unwrap(), "{what}: indices");
                assert_eq!(float_bits(&gv), float_bits(&cv), "{what}: values");

                let (dy, ddy) = pair(dev, &[rows, k], dtype, 71);
                let want = ops::topk_backward(&ci, &dy, row).unwrap();
                let got = ops::topk_backward(&gi, &ddy, row).unwrap();
                assert_close(&format!("{what} backward"), &want, &got, dev, 0.0);
            }
            // A repeated index sums its gradients in order; one past the row is an error.
            let (dy, ddy) = pair(dev, &[2, 3], dtype, 72);
            let idx = Tensor::from_vec(vec![4u32, 0, 4, 1, 2, 3], [2, 3], reference()).unwrap();
            let want = ops::topk_backward(&idx, &dy, 5).unwrap();
            let got = ops::topk_backward(&to_device(&idx, dev), &ddy, 5).unwrap();
            assert_close("topk_backward with a repeated index", &want, &got, dev, 0.0);
            let bad = to_device(&Tensor::from_vec(vec![0u32, 5, 1, 2, 3, 4], [2, 3], reference()).unwrap(), dev);
            let e = ops::topk_backward(&bad, &ddy, 5).unwrap_err();
            assert!(matches!(e, tessera::Error::IndexOutOfRange { index: 5, position: 1, bound: 5, .. }), "{e}");
        }
    }
}

/// A random paged step: per sequence `cached[s]` tokens already in the cache
/// and `new[s]` in this step, blocks handed out in a shuffled order, and the
/// step's tokens in a shuffled order (prefill chunks and decode tokens
/// interleaved). Returns the batch and the cache slots some sequence owns.
fn paged_step(cached: &[usize], new: &[usize], block_size: usize, seed: u64) -> (tessera::ops::PagedBatch, Vec<bool>, usize) {
    let seqs = cached.len();
    let width = cached.iter().zip(new).map(|(a, b)| (a + b).div_ceil(block_size)).max().unwrap_or(0).max(1);
    let blocks = seqs * width + 3;
    let noise = values(blocks, seed);
    let mut order: Vec<u32> = (0..blocks as u32).collect();
    order.sort_by(|a, b| noise[*a as usize].total_cmp(&noise[*b as usize]));
    let block_tables: Vec<u32> = order[..seqs * width].to_vec();
    let slot = |s: usize, p: usize| block_tables[s * width + p / block_size] as usize * block_size + p % block_size;
    let mut tokens: Vec<(u32, u32)> = (0..seqs).flat_map(|s| (cached[s]..cached[s] + new[s]).map(move |p| (p as u32, s as u32))).collect();
    let shuffle = values(tokens.len(), seed + 1);
    let mut idx: Vec<usize> = (0..tokens.len()).collect();
    idx.sort_by(|a, b| shuffle[*a].total_cmp(&shuffle[*b]));
    tokens = idx.iter().map(|&i| tokens[i]).collect();
    let mut owned = vec![false; blocks * block_size];
    for s in 0..seqs {
        for p in 0..cached[s] + new[s] {
            owned[slot(s, p)] = true;
        }
    }
    let batch = tessera::ops::PagedBatch {
        block_size,
        positions: tokens.iter().map(|t| t.0).collect(),
        token_seq: tokens.iter().map(|t| t.1).collect(),
        slots: tokens.iter().map(|&(p, s)| slot(s as usize, p as usize) as u32).collect(),
        block_tables,
        table_width: width,
    };
    (batch, owned, blocks * block_size)
}

/// `(q_heads, kv_heads, head_dim, block_size, cached, new)`: tokens already
/// cached and tokens of the step, per sequence.
type PagedCase = (usize, usize, usize, usize, &'static [usize], &'static [usize]);

device_test! {
    fn paged_attention_and_the_cache_write_match_the_cpu(dev: &Device) {
        use ops::{PagedBatch, QkvHeads};
        let on_gpu = matches!(dev, Device::Cuda(_));
        for dtype in FLOATS {
            // Sums over up to 250 positions in another order than the CPU's.
            let tol = tolerance(dtype).max(1e-4);
            // Groups of 1, 2 and 4; every head-dim instantiation (64, 128, 256, with and
            // without padding); block sizes 1, 5 and 16; decode tokens beside prefill
            // chunks, first ones and ones after cached tokens.
            let cases: [PagedCase; 5] = [
                (4, 4, 8, 1, &[0, 5, 17], &[9, 1, 1]),
                (8, 4, 64, 16, &[40, 0, 3], &[1, 20, 1]),
                (8, 2, 128, 16, &[70, 33, 240], &[1, 12, 1]),
                (4, 1, 256, 16, &[50], &[3]),
                (6, 3, 33, 5, &[10, 0], &[1, 7]),
            ];
            for (i, &(q_heads, kv_heads, head_dim, block_size, cached, new)) in cases.iter().enumerate() {
                let heads = QkvHeads { q_heads, kv_heads, head_dim };
                let what = |part: &str| format!("paged {dtype} {q_heads}/{kv_heads} heads of {head_dim}, blocks of {block_size}: {part}");
                let (batch, owned, slots) = paged_step(cached, new, block_size, 80 + i as u64);
                let tokens = batch.tokens();
                let (qkv, dqkv) = pair(dev, &[tokens, heads.width()], dtype, 81 + i as u64);
                // Slots no sequence owns hold NaN, so a read of a wrong slot shows.
                let row = kv_heads * head_dim;
                let cache = |seed| {
                    let mut v = values(slots * row, seed);
                    for (s, _) in owned.iter().enumerate().filter(|(_, o)| !**o) {
                        v[s * row..(s + 1) * row].fill(f32::NAN);
                    }
                    let c = Tensor::from_vec(v, [slots, kv_heads, head_dim], reference()).unwrap().to_dtype(dtype).unwrap();
                    (c.clone(), to_device(&c, dev))
                };
                let ((k, dk), (v, dv)) = (cache(90 + i as u64), cache(100 + i as u64));
                ops::kv_cache_write(&qkv, heads, &k, &v, &batch).unwrap();
                ops::kv_cache_write(&dqkv, heads, &dk, &dv, &batch).unwrap();
                assert_eq!(float_bits(&dk), float_bits(&k), "{}", what("key cache after the write"));
                assert_eq!(float_bits(&dv), float_bits(&v), "{}", what("value cache after the write"));
                let want = ops::paged_attention(&qkv, heads, &k, &v, &batch).unwrap();
                let got = ops::paged_attention(&dqkv, heads, &dk, &dv, &batch).unwrap();
                assert_close(&what("out"), &want, &got, dev, tol);
                // A token alone gives the bits it gets in the batch.
                let t = tokens - 1;
                let alone = PagedBatch {
                    positions: vec![batch.positions[t]],
                    token_seq: vec![batch.token_seq[t]],
                    slots: vec![batch.slots[t]],
                    ..batch.clone()
                };
                let solo = ops::paged_attention(&dqkv.narrow(0, t, 1).unwrap(), heads, &dk, &dv, &alone).unwrap();
                assert_eq!(float_bits(&solo), float_bits(&got.narrow(0, t, 1).unwrap()), "{}", what("a token alone"));
            }
            // Above the kernels' head-dim limit a GPU says so (the CPU runs it).
            let heads = QkvHeads { q_heads: 2, kv_heads: 1, head_dim: 320 };
            let (batch, _, slots) = paged_step(&[3], &[1], 4, 110);
            let (qkv, dqkv) = pair(dev, &[1, heads.width()], dtype, 111);
            let (k, dk) = pair(dev, &[slots, 1, 320], dtype, 112);
            let (v, dv) = pair(dev, &[slots, 1, 320], dtype, 113);
            assert!(ops::paged_attention(&qkv, heads, &k, &v, &batch).is_ok());
            let r = ops::paged_attention(&dqkv, heads, &dk, &dv, &batch);
            if on_gpu {
                let e = r.unwrap_err().to_string();
                assert!(e.contains("head_dim 320") && e.contains("1..=256"), "{e}");
            } else {
                assert!(r.is_ok());
            }
        }
    }
}

device_test! {
    fn quantized_products_match_the_cpu(dev: &Device) {
        // Decode-shaped (1 and 3 rows) and more rows than the GPU kernel
        // takes per pass (11); a depth the 4-byte loads take (256) and one
        // they do not (66, int4 with groups of 6: the byte loop).
        for dtype in FLOATS {
            for (rows, k, group) in [(1, 256, 128), (3, 256, 32), (11, 256, 64), (2, 66, 6)] {
                let n = 37;
                let (w, _) = pair(dev, &[n, k], DType::F32, 40);
                let (x, dx) = pair(dev, &[rows, k], dtype, 41);
                let (bias, dbias) = pair(dev, &[n], dtype, 42);
                for format in [ops::QuantFormat::Int8, ops::QuantFormat::Int4 { group_size: group }, ops::QuantFormat::W8A8] {
                    // Quantized on the host either way: the same codes on both devices.
                    let q = ops::quantize(&w, format).unwrap();
                    let dq = q.to_device(dev).unwrap();
                    let what = format!("quant_matmul {format} {dtype} rows {rows} k {k}");
                    let want = ops::quant_matmul(&x, &q, Some(&bias)).unwrap();
                    let got = ops::quant_matmul(&dx, &dq, Some(&dbias)).unwrap();
                    // W8A8 rounds the activations to codes, and one rounding of an
                    // activation across a tie flips a code on one device only.
                    let tol = if format == ops::QuantFormat::W8A8 { 2e-2 } else { tolerance(dtype).max(1e-4) };
                    assert_close(&what, &want, &got, dev, tol);
                }
            }
        }
    }
}

// FP8 operands: the device's codes' values are the CPU's bit for bit, in
// every dtype, at scales that put the values in the normal range, in the
// subnormals and past the largest value (saturating).
device_test! {
    fn fp8_values_match_the_cpu_bit_for_bit(dev: &Device) {
        for dtype in FLOATS {
            let (x, dx) = pair(dev, &[7, 301], dtype, 70);
            for format in [ops::Fp8Format::E4M3, ops::Fp8Format::E5M2] {
                for scale in [1.0f32, 1e-4, 1000.0, 3.7e4] {
                    let want = ops::fp8_values(&x, format, scale).unwrap();
                    let got = ops::fp8_values(&dx, format, scale).unwrap();
                    assert_eq!(float_bits(&want), float_bits(&got), "fp8_values {format:?} at scale {scale} in {dtype}");
                }
            }
        }
    }
}

// Ring attention's merge: two partial attentions of the same queries over
// the two halves of their keys, merged on the GPU, against the CPU's merge,
// in every dtype (the log-sum-exps in f32).
device_test! {
    /// FP8 products: on a GPU with FP8 tensor cores and a shape they take,
    /// one cuBLASLt product of the code bytes (two encoding kernels and one
    /// product, no other work), else the emulation; either way the CPU's
    /// `scale(matmul(a, b), alpha)` to the output's rounding. Every pair of
    /// formats the layers use, outputs in f32, bf16 and f16, an unaligned
    /// shape, a batched left operand, and the weight read transposed in place.
    fn fp8_products_match_the_cpu(dev: &Device) {
        use ops::Fp8Format::{E4M3, E5M2};
        for dtype in FLOATS {
            for (fa, fb) in [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)] {
                for (lead, k, n) in [(&[32][..], 64, 48), (&[2, 16][..], 32, 16), (&[20][..], 24, 8)] {
                    let (sa, sb) = (8.0f32, 0.5f32);
                    let a_shape: Vec<usize> = lead.iter().copied().chain([k]).collect();
                    let (x, _) = pair(dev, &a_shape, dtype, 81);
                    let (w, _) = pair(dev, &[n, k], dtype, 82);
                    let a = ops::fp8_values(&x, fa, sa).unwrap();
                    let b = ops::fp8_values(&w, fb, sb).unwrap();
                    let (da, db) = (to_device(&a, dev), to_device(&b, dev));
                    let alpha = 1.0 / (f64::from(sa) * f64::from(sb));
                    let want = ops::matmul_fp8(&a, fa, &b.t().unwrap(), fb, alpha).unwrap();
                    let before = match dev {
                        Device::Cuda(gpu) => Some(gpu.work()),
                        Device::Cpu(_) => None,
                    };
                    let got = ops::matmul_fp8(&da, fa, &db.t().unwrap(), fb, alpha).unwrap();
                    let what = format!("matmul_fp8 {fa:?} x {fb:?} of {a_shape:?} by [{k}, {n}] in {dtype}");
                    let tol = if dtype == DType::F32 { 1e-5 } else { tolerance(dtype) };
                    assert_close(&what, &want, &got, dev, tol);
                    if let (Some(before), Device::Cuda(gpu)) = (before, dev) {
                        let m: usize = lead.iter().product();
                        let fits = gpu.has_fp8_tensor_cores() && [m, k, n].iter().all(|d| d % 16 == 0);
                        let work = gpu.work() - before;
                        if fits {
                            assert_eq!((work.kernels, work.gemms), (2, 1), "{what}: the codes encoded and one FP8 product: {work:?}");
                        } else {
                            assert_eq!((work.kernels, work.gemms), (1, 1), "{what}: the emulation's product and its scaling: {work:?}");
                        }
                    }
                }
            }
        }
    }
}

device_test! {
    fn attention_merge_matches_the_cpu(dev: &Device) {
        for dtype in FLOATS {
            let (q, dq) = pair(dev, &[2, 4, 5, 8], dtype, 80);
            let (k, dk) = pair(dev, &[2, 2, 12, 8], dtype, 81);
            let (v, dv) = pair(dev, &[2, 2, 12, 8], dtype, 82);
            let opts = ops::AttnOpts { causal: false, scale: None };
            let halves = |x: &Tensor| (x.narrow(2, 0, 6).unwrap(), x.narrow(2, 6, 6).unwrap());
            let ((k1, k2), (v1, v2), (dk1, dk2), (dv1, dv2)) = (halves(&k), halves(&v), halves(&dk), halves(&dv));
            let (o1, l1) = ops::attention(&q, &k1, &v1, opts).unwrap();
            let (o2, l2) = ops::attention(&q, &k2, &v2, opts).unwrap();
            let (want, want_lse) = ops::attention_merge(&o1, &l1, &o2, &l2).unwrap();
            let (go1, gl1) = ops::attention(&dq, &dk1, &dv1, opts).unwrap();
            let (go2, gl2) = ops::attention(&dq, &dk2, &dv2, opts).unwrap();
            let (got, got_lse) = ops::attention_merge(&go1, &gl1, &go2, &gl2).unwrap();
            assert_close(&format!("attention_merge {dtype}: output"), &want, &got, dev, tolerance(dtype));
            assert_close(&format!("attention_merge {dtype}: log-sum-exp"), &want_lse, &got_lse, dev, 1e-5);
        }
    }
}
