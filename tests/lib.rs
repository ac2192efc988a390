//! Integration tests live in `tests/`; this library holds what they share.

/// Declares a test once and runs it per device: `<name>::cpu` on a CPU
/// device, and `<name>::cuda` on CUDA device 0, which reports
/// `skipped: no CUDA device` (and why) where there is none, so a machine
/// without a GPU never counts it as passed in silence.
///
/// ```ignore
/// device_test! {
///     fn zeros_are_zero(dev: &Device) {
///         assert_eq!(Tensor::zeros([2], DType::F32, dev).unwrap().to_vec::<f32>().unwrap(), [0.0; 2]);
///     }
/// }
/// ```
#[macro_export]
macro_rules! device_test {
    ($(#[$attr:meta])* fn $name:ident($dev:ident: &Device) $body:block) => {
        $(#[$attr])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn body($dev: &::tessera::Device) $body

            #[test]
            fn cpu() {
                body(&::tessera::Device::cpu());
            }

            #[test]
            fn cuda() {
                if let Some(dev) = ::tessera::backend::cuda::testing::cuda_or_skip(concat!(module_path!(), "::cuda")) {
                    body(&dev);
                }
            }
        }
    };
}
