//! The CUDA backend as seen from outside: a machine without a GPU or driver
//! gets a typed error, and the device tests written once run on the CPU and,
//! where there is one, on a GPU (elsewhere they report that they skipped).

use tessera::backend::cuda::{testing::cuda_or_skip, COMPILED};
use tessera::{bf16, DType, Device, Error, Tensor};
use tessera_tests::device_test;

#[test]
fn a_missing_gpu_or_driver_is_a_typed_error_not_a_panic() {
    // No machine has a millionth GPU: this is an error everywhere.
    let e = Device::cuda(1 << 20).unwrap_err();
    if COMPILED {
        assert!(matches!(e, Error::CudaUnavailable { ordinal, .. } if ordinal == 1 << 20), "{e}");
        assert!(e.to_string().contains("Device::cpu()"), "{e}");
    } else {
        assert!(matches!(e, Error::NotCompiledWithCuda), "{e}");
    }
    // Device 0 exists only on a GPU machine; anywhere else the same typed error.
    match Device::cuda(0) {
        Ok(d) => assert_eq!(d.to_string(), "cuda:0"),
        Err(e) if COMPILED => assert!(matches!(e, Error::CudaUnavailable { ordinal: 0, .. }), "{e}"),
        Err(e) => assert!(matches!(e, Error::NotCompiledWithCuda), "{e}"),
    }
}

device_test! {
    fn host_round_trip_and_exact_memory_accounting(dev: &Device) {
        let before = dev.memory_stats().in_use;
        let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let t = Tensor::from_vec(data.clone(), [10, 100], dev).unwrap();
        assert!(dev.memory_stats().in_use >= before + 4000, "{:?}", dev.memory_stats());
        assert_eq!(t.to_vec::<f32>().unwrap(), data);
        let z = Tensor::zeros([3, 5], DType::BF16, dev).unwrap();
        assert_eq!(z.to_vec::<bf16>().unwrap(), vec![bf16::ZERO; 15]);
        assert!(dev.memory_stats().peak >= dev.memory_stats().in_use);
        drop((t, z));
        assert_eq!(dev.memory_stats().in_use, before, "every byte is returned on drop");
        dev.synchronize().unwrap();
    }
}

/// An op whose kernel has no CUDA implementation yet says so, naming itself,
/// and so does an op on a dtype the GPU kernels do not cover; operands of
/// mixed dtypes are a dtype error.
#[test]
fn ops_not_yet_on_cuda_say_so() {
    let Some(dev) = cuda_or_skip("ops_not_yet_on_cuda_say_so") else { return };
    let a = Tensor::zeros([4], DType::F32, &dev).unwrap();
    let e = tessera::ops::copy_blocks(&a, 1, &[(0, 1)]).unwrap_err();
    assert!(matches!(e, Error::NotImplementedOnCuda { op: "copy_blocks" }) && e.to_string().contains("Device::cpu()"), "{e}");
    let wide = Tensor::zeros([4], DType::F64, &dev).unwrap();
    let e = tessera::ops::add(&wide, &wide).unwrap_err();
    assert!(matches!(e, Error::NotImplementedOnCuda { op: "add" }), "{e}");
    // The CPU widens operands of mixed dtypes; the GPU kernels refuse them
    // with a typed error instead of reading one dtype as another.
    let half = Tensor::zeros([4], DType::BF16, &dev).unwrap();
    let e = tessera::ops::add(&half, &a).unwrap_err();
    assert!(matches!(e, Error::DType { op: "add", got: DType::F32, .. }), "{e}");
}

/// The device's work counts see each kind of request: a kernel for an add, a
/// cuBLAS call for a product, an upload for a tensor made from host values
/// and a read back for `to_vec`, nothing else for each.
#[test]
fn the_device_counts_its_kernels_products_uploads_and_reads() {
    use tessera::backend::cuda::DeviceWork;
    let Some(dev) = cuda_or_skip("the_device_counts_its_kernels_products_uploads_and_reads") else { return };
    let Device::Cuda(gpu) = &dev else { unreachable!("cuda_or_skip gives a CUDA device") };
    let a = Tensor::from_vec(vec![1.0f32; 64], [8, 8], &dev).unwrap();
    let b = Tensor::from_vec(vec![2.0f32; 64], [8, 8], &dev).unwrap();
    let start = gpu.work();
    let step = |f: &dyn Fn() -> Tensor, want: DeviceWork| {
        let before = gpu.work();
        let _ = f();
        assert_eq!(gpu.work() - before, want);
    };
    step(&|| tessera::ops::add(&a, &b).unwrap(), DeviceWork { kernels: 1, ..Default::default() });
    step(&|| tessera::ops::matmul(&a, &b).unwrap(), DeviceWork { gemms: 1, ..Default::default() });
    step(&|| Tensor::from_vec(vec![0.5f32; 4], [4], &dev).unwrap(), DeviceWork { uploads: 1, ..Default::default() });
    let c = tessera::ops::matmul(&a, &b).unwrap();
    let before = gpu.work();
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![16.0f32; 64]);
    assert_eq!(gpu.work() - before, DeviceWork { host_reads: 1, ..Default::default() });
    assert_eq!(gpu.work() - start, DeviceWork { kernels: 1, gemms: 2, uploads: 1, host_reads: 1 });
}
