//! Memory accounting is exact: every allocation and free is counted.

use tessera::ops;
use tessera::prelude::*;

#[test]
fn allocations_and_frees_are_counted_exactly() {
    let dev = Device::cpu();
    assert_eq!(dev.memory_stats().in_use, 0);
    let a = Tensor::zeros([100, 10], DType::F32, &dev).unwrap();
    assert_eq!(dev.memory_stats().in_use, 4000);
    let b = Tensor::zeros([100, 10], DType::BF16, &dev).unwrap();
    assert_eq!(dev.memory_stats().in_use, 6000);
    let view = a.t().unwrap();
    assert_eq!(dev.memory_stats().in_use, 6000, "views allocate nothing");
    let copy = view.contiguous().unwrap();
    assert_eq!(dev.memory_stats().in_use, 10_000);
    drop((a, view));
    assert_eq!(dev.memory_stats().in_use, 6000, "the storage lives while any view does, and is freed with the last");
    drop((b, copy));
    let s = dev.memory_stats();
    assert_eq!(s.in_use, 0);
    assert_eq!(s.peak, 10_000);
    dev.reset_peak();
    assert_eq!(dev.memory_stats().peak, 0);
}

#[test]
fn op_temporaries_count_towards_the_peak() {
    let dev = Device::cpu();
    let x = Tensor::zeros([64, 32], DType::F16, &dev).unwrap(); // 4 KiB
    let w = Tensor::zeros([32, 32], DType::F16, &dev).unwrap(); // 2 KiB
    dev.reset_peak();
    // An f16 product still widens its operands to f32 (the CPU has no f16
    // dot product): those temporaries count.
    let y = ops::matmul(&x, &w).unwrap();
    let s = dev.memory_stats();
    // in use: x, w and y (f16).
    assert_eq!(s.in_use, 4096 + 2048 + 4096);
    // Peak: x, w, their f32 widenings (8 + 4 KiB) and the f32 result (8 KiB)
    // at once; the widenings are freed before the result is narrowed into y.
    assert_eq!(s.peak, 4096 + 2048 + 8192 + 4096 + 8192, "{s:?}");
    drop(y);
    assert_eq!(dev.memory_stats().in_use, 4096 + 2048);
}

#[test]
fn half_precision_point_wise_ops_allocate_only_their_output() {
    let dev = Device::cpu();
    for dtype in [DType::BF16, DType::F16] {
        let x = Tensor::zeros([64, 32], dtype, &dev).unwrap(); // 4 KiB
        dev.reset_peak();
        // Computed in f32 a block at a time (in registers on bf16): no
        // whole-tensor f32 copy of the input or the result.
        let y = ops::gelu(&x).unwrap();
        let s = dev.memory_stats();
        assert_eq!((s.in_use, s.peak), (2 * 4096, 2 * 4096), "{dtype}: {s:?}");
        drop(y);
    }
}

#[test]
fn devices_account_separately() {
    let (d0, d1) = (Device::cpu(), Device::cpu());
    let _a = Tensor::zeros([1000], DType::F32, &d0).unwrap();
    assert_eq!(d0.memory_stats().in_use, 4000);
    assert_eq!(d1.memory_stats().in_use, 0);
}

/// Ops whose kernels write every output element get reused buffers without
/// zeroing them first; filling the pool with NaNs beforehand must not change
/// a single bit of what they return.
#[test]
fn reused_buffers_never_leak_stale_values() {
    let run = |dev: &Device, poison: bool| -> Vec<u32> {
        let f = |seed: u64, shape: &[usize]| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n).map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 - 500.0) / 700.0).collect();
            Tensor::from_vec(v, shape.to_vec(), dev).unwrap()
        };
        // Every output at least 64 KiB: smaller buffers are not pooled.
        let (b, t, d) = (2, 128, 96);
        let heads = ops::QkvHeads { q_heads: 4, kv_heads: 2, head_dim: 16 };
        let x = f(1, &[b * t, d]);
        let w = f(2, &[d, d]);
        let qkv = f(3, &[b, t, heads.width()]);
        let rope = ops::Rope::new(16, t, 10_000.0).unwrap();
        let pos: Vec<u32> = (0..t as u32).collect();
        if poison {
            // NaN buffers of every length the ops below ask for, freed into the pool.
            let nan = |n: usize| Tensor::from_vec(vec![f32::NAN; n], [n], dev).unwrap();
            let held: Vec<Tensor> = [b * t * d, b * t * heads.width(), b * t * 64].iter().flat_map(|&n| (0..8).map(move |_| n)).map(nan).collect();
            drop(held);
        }
        let y = ops::matmul(&x, &w).unwrap();
        let y = ops::add_bias(&y, &f(4, &[d])).unwrap();
        let g = ops::gelu(&y).unwrap();
        let dg = ops::gelu_backward(&y, &x).unwrap();
        let s = ops::add(&g, &dg).unwrap();
        let s = ops::mul(&ops::scale(&s, 0.5).unwrap(), &ops::sub(&g, &x).unwrap()).unwrap();
        let r = ops::rope_packed(&qkv, &rope, &pos, heads).unwrap();
        let (o, lse) = ops::attention_packed(&r, heads, ops::AttnOpts::causal()).unwrap();
        let dqkv = ops::attention_packed_backward(&r, &o, &lse, &o, heads, ops::AttnOpts::causal()).unwrap();
        [y, g, dg, s, r, o, lse, dqkv].iter().flat_map(|t| t.to_vec::<f32>().unwrap().into_iter().map(f32::to_bits)).collect()
    };
    let clean = run(&Device::cpu(), false);
    assert_eq!(run(&Device::cpu(), true), clean);
}

#[test]
fn buffers_kept_for_reuse_never_take_the_device_past_its_peak() {
    let dev = Device::cpu();
    // Large buffers of lengths never asked for again, as a run's conversions free.
    for i in 0..64 {
        let t = Tensor::zeros([(1 << 16) + 64 * i], DType::F32, &dev).unwrap();
        drop(t);
        let s = dev.memory_stats();
        assert!(s.in_use + s.cached <= s.peak, "after {i}: {} in use + {} cached > peak {}", s.in_use, s.cached, s.peak);
    }
    // A buffer in use leaves room for no more than the rest of the peak.
    let held = Tensor::zeros([1 << 16], DType::F32, &dev).unwrap();
    let s = dev.memory_stats();
    assert!(s.in_use + s.cached <= s.peak, "{} in use + {} cached > peak {}", s.in_use, s.cached, s.peak);
    drop(held);
}
