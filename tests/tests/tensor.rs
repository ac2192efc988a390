//! Tensors: creation, views, dtypes, counter-based initialisation, errors.

mod common;
use common::*;
use tessera::prelude::*;
use tessera::Error;
use tessera::{bf16, f16};

#[test]
fn host_round_trip_and_views() {
    let dev = cpu();
    let t = Tensor::from_vec((0..12).map(|x| x as f32).collect::<Vec<_>>(), [3, 4], &dev).unwrap();
    assert_eq!(t.dims(), &[3, 4]);
    assert_eq!(t.to_vec::<f32>().unwrap(), (0..12).map(|x| x as f32).collect::<Vec<_>>());
    let tt = t.t().unwrap();
    assert!(!tt.is_contiguous());
    assert!(tt.shares_storage(&t));
    assert_eq!(tt.to_vec::<f32>().unwrap(), vec![0., 4., 8., 1., 5., 9., 2., 6., 10., 3., 7., 11.]);
    let cols = t.narrow(1, 1, 2).unwrap();
    assert_eq!(cols.to_vec::<f32>().unwrap(), vec![1., 2., 5., 6., 9., 10.]);
    let rows = t.narrow(0, 1, 2).unwrap();
    assert!(rows.is_contiguous());
    assert_eq!(rows.reshape([8]).unwrap().to_vec::<f32>().unwrap(), (4..12).map(|x| x as f32).collect::<Vec<_>>());
    // reshape of a non-contiguous view gathers first
    assert_eq!(tt.reshape([12]).unwrap().to_vec::<f32>().unwrap()[..4], [0., 4., 8., 1.]);
}

#[test]
fn half_precision_round_trips() {
    let dev = cpu();
    // values exactly representable in both formats survive f32 -> half -> f32
    let exact: Vec<f32> = vec![0.0, -0.0, 1.0, -2.5, 0.15625, 1024.0, -3072.0, 2.0f32.powi(-14)];
    let t = Tensor::from_slice(&exact, [exact.len()], &dev).unwrap();
    for dt in [DType::BF16, DType::F16] {
        let back = t.to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(back, exact, "{dt}");
    }
    // rounding is to nearest even: 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7
    let t = Tensor::from_slice(&[1.0f32 + 1.0 / 256.0, 1.0 + 3.0 / 256.0], [2], &dev).unwrap();
    let b = t.to_dtype(DType::BF16).unwrap().to_vec::<bf16>().unwrap();
    assert_eq!(b, vec![bf16::from_f32(1.0), bf16::from_f32(1.0 + 4.0 / 256.0)]);
    let h = Tensor::from_slice(&[f16::from_f32(0.1)], [1], &dev).unwrap();
    assert_eq!(h.to_f64_vec().unwrap()[0], f16::from_f32(0.1).to_f64());
    // a half tensor is computed in f32 and stored back in its own dtype
    let x = Tensor::from_slice(&[1.0f32, -1.0, 0.5], [3], &dev).unwrap().to_dtype(DType::BF16).unwrap();
    let y = tessera::ops::gelu(&x).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    let y32 = tessera::ops::gelu(&x.to_dtype(DType::F32).unwrap()).unwrap().to_vec::<f32>().unwrap();
    let expect: Vec<bf16> = y32.iter().map(|&v| bf16::from_f32(v)).collect();
    assert_eq!(y.to_vec::<bf16>().unwrap(), expect);
}

#[test]
fn counter_based_init_is_sliceable_and_reproducible() {
    let dev = cpu();
    let key = RngKey::new(1234, 7);
    let init = Init::Normal { mean: 0.0, std: 0.02 };
    let global = Shape::from([6, 10]);
    let whole = Tensor::rand(init, key, global.clone(), DType::F32, &dev).unwrap();
    let again = Tensor::rand(init, key, global.clone(), DType::F32, &dev).unwrap();
    assert_eq!(whole.to_vec::<f32>().unwrap(), again.to_vec::<f32>().unwrap());
    // a column block, as a tensor-parallel rank would own it
    let block = Tensor::rand_slice(init, key, &global, &[2, 3], [3, 4], DType::F32, &dev).unwrap();
    let expected = whole.narrow(0, 2, 3).unwrap().narrow(1, 3, 4).unwrap();
    assert_eq!(block.to_vec::<f32>().unwrap(), expected.to_vec::<f32>().unwrap());
    let other = Tensor::rand(init, RngKey::new(1234, 8), global, DType::F32, &dev).unwrap();
    assert_ne!(whole.to_vec::<f32>().unwrap(), other.to_vec::<f32>().unwrap());
    // bf16 init is the f32 draw rounded
    let b = Tensor::rand(init, key, [6, 10], DType::BF16, &dev).unwrap().to_vec::<bf16>().unwrap();
    let w = whole.to_vec::<f32>().unwrap();
    assert!(b.iter().zip(&w).all(|(b, w)| *b == bf16::from_f32(*w)));
}

#[test]
fn integer_dtypes() {
    let dev = cpu();
    let ids = Tensor::from_vec(vec![3u32, 0, 7], [3], &dev).unwrap();
    assert_eq!(ids.dtype(), DType::U32);
    assert_eq!(ids.to_dtype(DType::I32).unwrap().to_vec::<i32>().unwrap(), vec![3, 0, 7]);
    assert_eq!(ids.to_f64_vec().unwrap(), vec![3.0, 0.0, 7.0]);
    let z = Tensor::zeros([2, 2], DType::I32, &dev).unwrap();
    assert_eq!(z.to_vec::<i32>().unwrap(), vec![0; 4]);
}

#[test]
fn mistakes_are_typed_errors_that_say_what_to_do() {
    let dev = cpu();
    let e = Tensor::from_vec(vec![1.0f32; 5], [2, 3], &dev).unwrap_err();
    assert!(e.to_string().contains("5 elements given for shape [2, 3] which holds 6"), "{e}");
    let t = Tensor::zeros([2, 3], DType::F32, &dev).unwrap();
    let e = t.reshape([4]).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("[2, 3]"), "{e}");
    let e = t.to_vec::<f64>().unwrap_err();
    assert!(e.to_string().contains("to_dtype"), "{e}");
    let e = t.narrow(1, 2, 2).unwrap_err();
    assert!(e.to_string().contains("outside dimension 1 of size 3"), "{e}");
    // Without the CUDA backend a GPU request names the feature; with it, this
    // machine's missing GPU or driver. (`cuda_device_test` covers a machine with one.)
    if !tessera::backend::cuda::COMPILED {
        let e = Device::cuda(0).unwrap_err();
        assert!(matches!(e, Error::NotCompiledWithCuda) && e.to_string().contains("--features cuda"), "{e}");
    }
    let other = Tensor::zeros([2, 3], DType::F32, &cpu()).unwrap();
    let e = tessera::ops::add(&t, &other).unwrap_err();
    assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    let b = Tensor::zeros([3, 2], DType::F32, &dev).unwrap();
    let e = tessera::ops::add(&t, &b).unwrap_err();
    assert!(e.to_string().contains("[2, 3] vs [3, 2]"), "{e}");
    let e = tessera::ops::matmul(&t, &t).unwrap_err();
    assert!(e.to_string().contains("inner dimensions differ"), "{e}");
    let ids = Tensor::from_vec(vec![0u32, 5], [2], &dev).unwrap();
    let e = tessera::ops::embedding(&Tensor::zeros([4, 2], DType::F32, &dev).unwrap(), &ids).unwrap_err();
    assert!(matches!(e, Error::IndexOutOfRange { index: 5, position: 1, bound: 4, .. }), "{e}");
    let e = tessera::ops::embedding(&t, &t).unwrap_err();
    assert!(e.to_string().contains("expected dtype u32"), "{e}");
    let e = tessera::ops::dropout(&t, 1.0, RngKey::new(0, 0), 0).unwrap_err();
    assert!(e.to_string().contains("[0, 1)"), "{e}");
    let q = Tensor::zeros([1, 3, 4, 2], DType::F32, &dev).unwrap();
    let kv = Tensor::zeros([1, 2, 4, 2], DType::F32, &dev).unwrap();
    let e = tessera::ops::attention(&q, &kv, &kv, tessera::ops::AttnOpts::causal()).unwrap_err();
    assert!(e.to_string().contains("multiple of kv heads"), "{e}");
}

/// `concat` along every dimension of generated shapes, with parts that are
/// contiguous, narrowed views and transposed views, against the elementwise
/// definition (each output index read from the part it falls in).
#[test]
fn concat_along_a_dimension_matches_its_definition() {
    let dev = cpu();
    let mut seed = 7u64;
    let mut next = |n: usize| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) as usize % n
    };
    for case in 0..200 {
        let rank = 1 + next(4);
        let dims: Vec<usize> = (0..rank).map(|_| 1 + next(4)).collect();
        let dim = next(rank);
        let n_parts = 1 + next(4);
        let mut parts = Vec::new();
        let mut lens = Vec::new();
        for p in 0..n_parts {
            let len = 1 + next(3);
            let mut shape = dims.clone();
            shape[dim] = len;
            let count: usize = shape.iter().product();
            let base = Tensor::from_vec((0..count).map(|i| (1000 * p + i) as f32).collect::<Vec<_>>(), shape.clone(), &dev).unwrap();
            // Vary how each part lies in memory without changing its values.
            let part = match next(3) {
                0 => base,
                1 => {
                    // A narrow of a longer tensor along `dim`: the same values at an offset.
                    let mut wide = shape.clone();
                    wide[dim] += 2;
                    let mut v = vec![-1.0f32; wide.iter().product()];
                    let w = Tensor::from_vec(v.clone(), wide.clone(), &dev).unwrap();
                    let strides = w.layout().strides().to_vec();
                    let values = base.to_vec::<f32>().unwrap();
                    for (flat, x) in values.iter().enumerate() {
                        let mut rem = flat;
                        let mut at = 0;
                        for d in (0..rank).rev() {
                            let i = rem % shape[d];
                            rem /= shape[d];
                            at += (i + usize::from(d == dim)) * strides[d];
                        }
                        v[at] = *x;
                    }
                    Tensor::from_vec(v, wide, &dev).unwrap().narrow(dim, 1, len).unwrap()
                }
                _ if rank >= 2 => base.t().unwrap().contiguous().unwrap().t().unwrap(),
                _ => base,
            };
            assert_eq!(part.to_vec::<f32>().unwrap(), (0..count).map(|i| (1000 * p + i) as f32).collect::<Vec<_>>());
            parts.push(part);
            lens.push(len);
        }
        let refs: Vec<&Tensor> = parts.iter().collect();
        let got = Tensor::concat(&refs, dim).unwrap();
        let mut want_dims = dims.clone();
        want_dims[dim] = lens.iter().sum();
        assert_eq!(got.dims(), &want_dims[..], "case {case}");
        let got = got.to_vec::<f32>().unwrap();
        let values: Vec<Vec<f32>> = parts.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
        for (flat, g) in got.iter().enumerate() {
            let mut idx = vec![0; rank];
            let mut rem = flat;
            for d in (0..rank).rev() {
                idx[d] = rem % want_dims[d];
                rem /= want_dims[d];
            }
            let (mut p, mut at) = (0, idx[dim]);
            while at >= lens[p] {
                at -= lens[p];
                p += 1;
            }
            idx[dim] = at;
            let mut shape = dims.clone();
            shape[dim] = lens[p];
            let local = idx.iter().zip(&shape).fold(0, |acc, (i, n)| acc * n + i);
            assert_eq!(*g, values[p][local], "case {case}: dims {dims:?} along {dim}, element {flat}");
        }
    }
    // Mismatched parts are refused with what differs.
    let a = Tensor::zeros([2, 3], DType::F32, &dev).unwrap();
    let b = Tensor::zeros([3, 3], DType::F32, &dev).unwrap();
    let e = Tensor::concat(&[&a, &b], 1).unwrap_err().to_string();
    assert!(e.contains("differ outside dimension 1"), "{e}");
    assert!(Tensor::concat(&[&a, &b], 2).unwrap_err().to_string().contains("dimension 2"));
    assert!(Tensor::concat(&[], 0).is_err());
    assert_eq!(Tensor::concat(&[&a, &b], 0).unwrap().dims(), &[5, 3]);
}
