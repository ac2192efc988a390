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
    let x = Tensor::zeros([64, 32], DType::BF16, &dev).unwrap(); // 4 KiB
    dev.reset_peak();
    let y = ops::gelu(&x).unwrap();
    let s = dev.memory_stats();
    // in use: x and y (bf16). Peak also saw the f32 widening of x and the f32 result (8 KiB each).
    assert_eq!(s.in_use, 2 * 4096);
    // Peak: x, its f32 widening and the f32 result at once; the widening is
    // freed before the result is narrowed into y.
    assert_eq!(s.peak, 4096 + 2 * 8192, "{s:?}");
    drop(y);
    assert_eq!(dev.memory_stats().in_use, 4096);
}

#[test]
fn devices_account_separately() {
    let (d0, d1) = (Device::cpu(), Device::cpu());
    let _a = Tensor::zeros([1000], DType::F32, &d0).unwrap();
    assert_eq!(d0.memory_stats().in_use, 4000);
    assert_eq!(d1.memory_stats().in_use, 0);
}
