//! Every op's backward against central finite differences in f64, through the
//! public tensor API, on odd sizes (1, 3, 17, 129) and non-square shapes.

mod common;
use common::*;
use tessera::ops::{self, AttnOpts, Rope};
use tessera::prelude::*;

fn u32_t(ids: Vec<u32>, shape: &[usize], dev: &Device) -> Tensor {
    Tensor::from_vec(ids, shape, dev).unwrap()
}

#[test]
fn elementwise() {
    let dev = cpu();
    for (n, s) in [(1, 1), (3, 2), (17, 3), (129, 4)] {
        let a = rand_t(s, &[n], &dev);
        let b = rand_t(s + 10, &[n], &dev);
        gradcheck("add", &[a.clone(), b.clone()], &[0, 1], |x| ops::add(&x[0], &x[1]), |_, dy| Ok(vec![dy.clone(), dy.clone()]));
        gradcheck("sub", &[a.clone(), b.clone()], &[0, 1], |x| ops::sub(&x[0], &x[1]), |_, dy| Ok(vec![dy.clone(), ops::scale(dy, -1.0)?]));
        gradcheck(
            "mul",
            &[a.clone(), b.clone()],
            &[0, 1],
            |x| ops::mul(&x[0], &x[1]),
            |x, dy| {
                let (da, db) = ops::mul_backward(&x[0], &x[1], dy)?;
                Ok(vec![da, db])
            },
        );
        gradcheck("scale", std::slice::from_ref(&a), &[0], |x| ops::scale(&x[0], -2.5), |_, dy| Ok(vec![ops::scale(dy, -2.5)?]));
    }
}

#[test]
fn bias_add() {
    let dev = cpu();
    for (r, c) in [(1, 1), (3, 17), (17, 3), (2, 129)] {
        let x = rand_t(1, &[r, c], &dev);
        let b = rand_t(2, &[c], &dev);
        gradcheck("add_bias", &[x, b], &[0, 1], |x| ops::add_bias(&x[0], &x[1]), |_, dy| Ok(vec![dy.clone(), ops::bias_grad(dy)?]));
    }
}

#[test]
fn activations() {
    let dev = cpu();
    for n in [1, 3, 17, 129] {
        let x = ops::scale(&rand_t(n as u64, &[n], &dev), 3.0).unwrap();
        gradcheck("gelu", std::slice::from_ref(&x), &[0], |x| ops::gelu(&x[0]), |x, dy| Ok(vec![ops::gelu_backward(&x[0], dy)?]));
        gradcheck("silu", std::slice::from_ref(&x), &[0], |x| ops::silu(&x[0]), |x, dy| Ok(vec![ops::silu_backward(&x[0], dy)?]));
        let up = rand_t(n as u64 + 7, &[n], &dev);
        gradcheck(
            "swiglu",
            &[x, up],
            &[0, 1],
            |x| ops::swiglu(&x[0], &x[1]),
            |x, dy| {
                let (dg, du) = ops::swiglu_backward(&x[0], &x[1], dy)?;
                Ok(vec![dg, du])
            },
        );
    }
}

#[test]
fn softmaxes() {
    let dev = cpu();
    for shape in [[1, 1], [3, 17], [17, 3], [2, 129]] {
        let x = ops::scale(&rand_t(4, &shape, &dev), 4.0).unwrap();
        gradcheck("softmax", std::slice::from_ref(&x), &[0], |x| ops::softmax(&x[0]), |x, dy| Ok(vec![ops::softmax_backward(&ops::softmax(&x[0])?, dy)?]));
        gradcheck("log_softmax", &[x], &[0], |x| ops::log_softmax(&x[0]), |x, dy| Ok(vec![ops::log_softmax_backward(&ops::log_softmax(&x[0])?, dy)?]));
    }
}

#[test]
fn matmuls() {
    let dev = cpu();
    for (m, k, n) in [(1, 1, 1), (3, 17, 1), (17, 3, 5), (2, 129, 3)] {
        let a = rand_t(1, &[m, k], &dev);
        let b = rand_t(2, &[k, n], &dev);
        gradcheck(
            "matmul",
            &[a, b],
            &[0, 1],
            |x| ops::matmul(&x[0], &x[1]),
            |x, dy| {
                let (da, db) = ops::matmul_backward(&x[0], &x[1], dy)?;
                Ok(vec![da, db])
            },
        );
    }
    // batched, with a shared right operand, and with transposed views
    let a = rand_t(3, &[2, 3, 5, 4], &dev);
    let b = rand_t(4, &[2, 3, 4, 3], &dev);
    gradcheck(
        "matmul batched",
        &[a.clone(), b],
        &[0, 1],
        |x| ops::matmul(&x[0], &x[1]),
        |x, dy| {
            let (da, db) = ops::matmul_backward(&x[0], &x[1], dy)?;
            Ok(vec![da, db])
        },
    );
    let w = rand_t(5, &[4, 7], &dev);
    gradcheck(
        "matmul shared weight",
        &[a.clone(), w],
        &[0, 1],
        |x| ops::matmul(&x[0], &x[1]),
        |x, dy| {
            let (da, db) = ops::matmul_backward(&x[0], &x[1], dy)?;
            Ok(vec![da, db])
        },
    );
    // y = x · wᵀ with w stored [out, in], as linear layers hold it
    let w = rand_t(6, &[7, 4], &dev);
    gradcheck(
        "matmul transposed weight",
        &[a, w],
        &[0, 1],
        |x| ops::matmul(&x[0], &x[1].t()?),
        |x, dy| {
            let (da, dwt) = ops::matmul_backward(&x[0], &x[1].t()?, dy)?;
            Ok(vec![da, dwt.t()?.contiguous()?])
        },
    );
}

#[test]
fn norms() {
    let dev = cpu();
    for shape in [[1, 1], [3, 17], [17, 3], [2, 129]] {
        let x = rand_t(8, &shape, &dev);
        let g = rand_t(9, &shape[1..], &dev);
        let b = rand_t(10, &shape[1..], &dev);
        gradcheck(
            "layer_norm",
            &[x.clone(), g.clone(), b],
            &[0, 1, 2],
            |x| Ok(ops::layer_norm(&x[0], &x[1], Some(&x[2]), 1e-5)?.0),
            |x, dy| {
                let (_, saved) = ops::layer_norm(&x[0], &x[1], Some(&x[2]), 1e-5)?;
                let (dx, dg, db) = ops::layer_norm_backward(&x[0], &x[1], true, &saved, dy)?;
                Ok(vec![dx, dg, db.unwrap()])
            },
        );
        gradcheck(
            "layer_norm no bias",
            &[x.clone(), g.clone()],
            &[0, 1],
            |x| Ok(ops::layer_norm(&x[0], &x[1], None, 1e-5)?.0),
            |x, dy| {
                let (_, saved) = ops::layer_norm(&x[0], &x[1], None, 1e-5)?;
                let (dx, dg, db) = ops::layer_norm_backward(&x[0], &x[1], false, &saved, dy)?;
                assert!(db.is_none());
                Ok(vec![dx, dg])
            },
        );
        gradcheck(
            "rms_norm",
            &[x, g],
            &[0, 1],
            |x| Ok(ops::rms_norm(&x[0], &x[1], 1e-6)?.0),
            |x, dy| {
                let (_, saved) = ops::rms_norm(&x[0], &x[1], 1e-6)?;
                let (dx, dg) = ops::rms_norm_backward(&x[0], &x[1], &saved, dy)?;
                Ok(vec![dx, dg])
            },
        );
    }
}

#[test]
fn embeddings() {
    let dev = cpu();
    for (vocab, dim, n) in [(1, 1, 1), (17, 3, 5), (5, 17, 9)] {
        let table = rand_t(11, &[vocab, dim], &dev);
        let ids: Vec<u32> = (0..n).map(|i| ((i * 7 + 3) % vocab) as u32).collect();
        let ids = u32_t(ids, &[n], &dev);
        gradcheck("embedding", &[table], &[0], |x| ops::embedding(&x[0], &ids), |_, dy| Ok(vec![ops::embedding_backward(&ids, dy, vocab, 0, vocab)?]));
    }
    // vocab-parallel shard: rows 4..9 of a 12-row vocabulary, repeated and foreign ids
    let shard = rand_t(12, &[5, 3], &dev);
    let ids = u32_t(vec![0, 4, 4, 8, 11, 6, 4], &[7], &dev);
    gradcheck("embedding shard", &[shard], &[0], |x| ops::embedding_shard(&x[0], &ids, 4, 12), |_, dy| Ok(vec![ops::embedding_backward(&ids, dy, 5, 4, 12)?]));
}

#[test]
fn rotary() {
    let dev = cpu();
    for (b, h, t, d) in [(1, 1, 1, 2), (2, 3, 17, 4), (1, 2, 5, 6)] {
        let rope = Rope::new(d, 64, 10_000.0).unwrap();
        let pos: Vec<u32> = (0..t as u32).map(|p| p * 3 + 1).collect();
        let x = rand_t(13, &[b, h, t, d], &dev);
        gradcheck("rope", &[x], &[0], |x| ops::rope(&x[0], &rope, &pos), |_, dy| Ok(vec![ops::rope_backward(dy, &rope, &pos)?]));
    }
}

#[test]
fn attention() {
    let dev = cpu();
    // (batch, q_heads, kv_heads, seq_q, seq_kv, head_dim, causal)
    for (b, hq, hkv, tq, tkv, d, causal) in
        [(1, 1, 1, 1, 1, 1, true), (1, 2, 1, 3, 3, 3, true), (2, 4, 2, 17, 17, 3, true), (1, 2, 2, 5, 9, 4, true), (1, 3, 1, 7, 4, 2, false)]
    {
        let opts = AttnOpts { causal, scale: None };
        let q = rand_t(14, &[b, hq, tq, d], &dev);
        let k = rand_t(15, &[b, hkv, tkv, d], &dev);
        let v = rand_t(16, &[b, hkv, tkv, d], &dev);
        gradcheck(
            "attention",
            &[q, k, v],
            &[0, 1, 2],
            |x| Ok(ops::attention(&x[0], &x[1], &x[2], opts)?.0),
            |x, dy| {
                let (out, lse) = ops::attention(&x[0], &x[1], &x[2], opts)?;
                let (dq, dk, dv) = ops::attention_backward(&x[0], &x[1], &x[2], &out, &lse, dy, opts)?;
                Ok(vec![dq, dk, dv])
            },
        );
    }
}

#[test]
fn long_attention_rows() {
    // 129 positions: longer than one tile, so the online softmax rescales.
    let dev = cpu();
    let opts = AttnOpts::causal();
    let q = rand_t(17, &[1, 1, 129, 2], &dev);
    let k = rand_t(18, &[1, 1, 129, 2], &dev);
    let v = rand_t(19, &[1, 1, 129, 2], &dev);
    gradcheck(
        "attention 129",
        &[q, k, v],
        &[0, 1, 2],
        |x| Ok(ops::attention(&x[0], &x[1], &x[2], opts)?.0),
        |x, dy| {
            let (out, lse) = ops::attention(&x[0], &x[1], &x[2], opts)?;
            let (dq, dk, dv) = ops::attention_backward(&x[0], &x[1], &x[2], &out, &lse, dy, opts)?;
            Ok(vec![dq, dk, dv])
        },
    );
}

#[test]
fn cross_entropy() {
    let dev = cpu();
    for (n, vocab) in [(1, 1), (3, 17), (17, 3), (2, 129)] {
        let logits = ops::scale(&rand_t(20, &[n, vocab], &dev), 3.0).unwrap();
        let targets: Vec<u32> = (0..n).map(|i| ((i * 5 + 1) % vocab) as u32).collect();
        let targets = u32_t(targets, &[n], &dev);
        gradcheck(
            "cross_entropy",
            &[logits],
            &[0],
            |x| Ok(ops::cross_entropy(&x[0], &targets, None)?.0),
            |x, dy| {
                let (_, saved) = ops::cross_entropy(&x[0], &targets, None)?;
                Ok(vec![ops::cross_entropy_backward(&x[0], &targets, None, &saved, dy.to_scalar()?)?])
            },
        );
    }
    // ignored rows contribute neither loss nor gradient
    let logits = rand_t(21, &[2, 3, 5], &dev);
    let targets = u32_t(vec![1, 9999, 4, 0, 9999, 2], &[2, 3], &dev);
    gradcheck(
        "cross_entropy ignore",
        &[logits],
        &[0],
        |x| Ok(ops::cross_entropy(&x[0], &targets, Some(9999))?.0),
        |x, dy| {
            let (_, saved) = ops::cross_entropy(&x[0], &targets, Some(9999))?;
            assert_eq!(saved.count, 4);
            Ok(vec![ops::cross_entropy_backward(&x[0], &targets, Some(9999), &saved, dy.to_scalar()?)?])
        },
    );
}

#[test]
fn dropout() {
    let dev = cpu();
    let key = RngKey::new(5, 1);
    for n in [1, 3, 17, 129] {
        let x = rand_t(22, &[n], &dev);
        gradcheck("dropout", &[x], &[0], |x| ops::dropout(&x[0], 0.3, key, 11), |_, dy| Ok(vec![ops::dropout_backward(dy, 0.3, key, 11)?]));
    }
}

#[test]
fn topk() {
    let dev = cpu();
    for (r, c, k) in [(1, 1, 1), (3, 17, 2), (17, 3, 3), (2, 129, 4)] {
        let x = rand_t(23, &[r, c], &dev);
        gradcheck(
            "topk",
            &[x],
            &[0],
            |x| Ok(ops::topk(&x[0], k)?.0),
            |x, dy| {
                let (_, idx) = ops::topk(&x[0], k)?;
                Ok(vec![ops::topk_backward(&idx, dy, c)?])
            },
        );
    }
}

#[test]
fn reductions() {
    let dev = cpu();
    for n in [1, 3, 17, 129] {
        let x = rand_t(24, &[n, 2], &dev);
        gradcheck("sum", std::slice::from_ref(&x), &[0], |x| ops::sum(&x[0]), |x, dy| Ok(vec![ops::sum_backward(dy, x[0].shape())?]));
        gradcheck("sum_squares", &[x], &[0], |x| ops::sum_squares(&x[0]), |x, dy| Ok(vec![ops::sum_squares_backward(&x[0], dy.to_scalar()?)?]));
    }
}
