//! Numerical behaviour beyond gradients: the fused attention against the
//! naive T×T reference, f32 against f64, and bit-identical reruns.

mod common;
use common::*;
use tessera::ops::{self, AttnOpts};
use tessera::prelude::*;
use tessera_kernels::cpu::attention::{attention_reference_forward, AttnDims};

#[test]
fn fused_attention_matches_the_materialised_reference() {
    let dev = cpu();
    for (b, hq, hkv, tq, tkv, d, causal) in [(2, 4, 2, 129, 129, 16, true), (1, 8, 1, 33, 200, 8, true), (1, 2, 2, 70, 70, 5, false)] {
        let q = rand_t(1, &[b, hq, tq, d], &dev).to_dtype(DType::F32).unwrap();
        let k = rand_t(2, &[b, hkv, tkv, d], &dev).to_dtype(DType::F32).unwrap();
        let v = rand_t(3, &[b, hkv, tkv, d], &dev).to_dtype(DType::F32).unwrap();
        let (out, _) = ops::attention(&q, &k, &v, AttnOpts { causal, scale: None }).unwrap();
        let dims = AttnDims { batch: b, q_heads: hq, kv_heads: hkv, seq_q: tq, seq_kv: tkv, head_dim: d, causal, scale: 1.0 / (d as f64).sqrt() };
        let mut reference = vec![0f64; b * hq * tq * d];
        attention_reference_forward(&dims, &q.to_f64_vec().unwrap(), &k.to_f64_vec().unwrap(), &v.to_f64_vec().unwrap(), &mut reference);
        assert_close(&out.to_f64_vec().unwrap(), &reference, 2e-6, 1e-5, "attention vs reference");
    }
}

#[test]
fn f32_agrees_with_f64() {
    let dev = cpu();
    let x = rand_t(4, &[33, 65], &dev);
    let w = rand_t(5, &[65, 17], &dev);
    let g = rand_t(6, &[65], &dev);
    let f64_path = |x: &Tensor, w: &Tensor, g: &Tensor| {
        let (h, _) = ops::layer_norm(x, g, None, 1e-5).unwrap();
        let h = ops::gelu(&h).unwrap();
        ops::softmax(&ops::matmul(&h, w).unwrap()).unwrap().to_f64_vec().unwrap()
    };
    let exact = f64_path(&x, &w, &g);
    let f32s: Vec<Tensor> = [&x, &w, &g].iter().map(|t| t.to_dtype(DType::F32).unwrap()).collect();
    let approx = f64_path(&f32s[0], &f32s[1], &f32s[2]);
    assert_close(&approx, &exact, 1e-6, 1e-4, "f32 pipeline vs f64");
}

/// A small training-like step touching every parallel kernel; returns all bits it produced.
fn step_bits(dev: &Device) -> Vec<u32> {
    let f = |seed, shape: &[usize]| rand_t(seed, shape, dev).to_dtype(DType::F32).unwrap();
    let (x, w, g) = (f(7, &[256, 192]), f(8, &[192, 160]), f(9, &[192]));
    let (h, saved) = ops::rms_norm(&x, &g, 1e-6).unwrap();
    let z = ops::matmul(&h, &w).unwrap();
    let q = z.reshape([2, 4, 32, 160]).unwrap().narrow(3, 0, 64).unwrap().contiguous().unwrap();
    let (o, lse) = ops::attention(&q, &q, &q, AttnOpts::causal()).unwrap();
    let (dq, dk, dv) = ops::attention_backward(&q, &q, &q, &o, &lse, &o, AttnOpts::causal()).unwrap();
    let (dh, dw) = ops::matmul_backward(&h, &w, &z).unwrap();
    let (dx, dg) = ops::rms_norm_backward(&x, &g, &saved, &dh).unwrap();
    let total = ops::sum_squares(&dx).unwrap();
    [o, dq, dk, dv, dw, dx, dg, total.to_dtype(DType::F32).unwrap()].iter().flat_map(|t| t.to_vec::<f32>().unwrap().into_iter().map(f32::to_bits)).collect()
}

#[test]
fn reruns_and_thread_counts_give_identical_bits() {
    let dev = cpu();
    let first = step_bits(&dev);
    assert_eq!(first, step_bits(&dev), "two runs differ");
    let one_thread = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(|| step_bits(&dev));
    assert_eq!(first, one_thread, "one thread and the default pool differ");
    let three = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap().install(|| step_bits(&dev));
    assert_eq!(first, three, "three threads and the default pool differ");
}

/// The packed op (what attention layers call) gives what splitting the fused
/// projection into heads and calling `attention` gives, forward and backward,
/// with RoPE on the queries and keys, and names the expected width on a wrong one.
#[test]
fn packed_attention_matches_split_heads() {
    let dev = cpu();
    let (b, t, kv, r, d) = (2, 37, 2, 3, 8);
    let heads = ops::QkvHeads { q_heads: kv * r, kv_heads: kv, head_dim: d };
    let x = rand_t(11, &[b, t, heads.width()], &dev).to_dtype(DType::F32).unwrap();
    let dy = rand_t(12, &[b, t, kv * r * d], &dev).to_dtype(DType::F32).unwrap();
    let rope = ops::Rope::new(d, 64, 10_000.0).unwrap();
    let pos: Vec<u32> = (0..t as u32).collect();

    let xr = ops::rope_packed(&x, &rope, &pos, heads).unwrap();
    let (y, lse) = ops::attention_packed(&xr, heads, AttnOpts::causal()).unwrap();
    let dxr = ops::attention_packed_backward(&xr, &y, &lse, &dy, heads, AttnOpts::causal()).unwrap();
    let dx = ops::rope_packed_backward(&dxr, &rope, &pos, heads).unwrap();

    // The same through per-head tensors: [b, t, kv, r + 2, d] -> [b, heads, t, d].
    let x5 = x.reshape([b, t, kv, r + 2, d]).unwrap();
    let split = |start: usize, n: usize| x5.narrow(3, start, n).unwrap().reshape([b, t, kv * n, d]).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
    let q = ops::rope(&split(0, r), &rope, &pos).unwrap();
    let k = ops::rope(&split(r, 1), &rope, &pos).unwrap();
    let v = split(r + 1, 1);
    let (o, lse_ref) = ops::attention(&q, &k, &v, AttnOpts::causal()).unwrap();
    let y_ref = o.transpose(1, 2).unwrap().reshape([b, t, kv * r * d]).unwrap();
    let bits = |t: &Tensor| t.to_vec::<f32>().unwrap().into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert_eq!(bits(&y), bits(&y_ref), "packed output");
    assert_eq!(bits(&lse), bits(&lse_ref), "packed lse");

    let dout = dy.reshape([b, t, kv * r, d]).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
    let (dq, dk, dv) = ops::attention_backward(&q, &k, &v, &o, &lse_ref, &dout, AttnOpts::causal()).unwrap();
    let (dq, dk) = (ops::rope_backward(&dq, &rope, &pos).unwrap(), ops::rope_backward(&dk, &rope, &pos).unwrap());
    let dx5 = dx.reshape([b, t, kv, r + 2, d]).unwrap();
    let part = |start: usize, n: usize| dx5.narrow(3, start, n).unwrap().reshape([b, t, kv * n, d]).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
    assert_eq!(bits(&part(0, r)), bits(&dq), "packed dq");
    assert_eq!(bits(&part(r, 1)), bits(&dk), "packed dk");
    assert_eq!(bits(&part(r + 1, 1)), bits(&dv), "packed dv");

    let wrong = rand_t(13, &[b, t, heads.width() - d], &dev);
    let err = ops::attention_packed(&wrong, heads, AttnOpts::causal()).unwrap_err().to_string();
    assert!(err.contains(&format!("[batch, seq, {}]", heads.width())), "{err}");
}
