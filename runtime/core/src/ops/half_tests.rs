//! Ops on bf16 and f16 tensors against the path they replace.
//!
//! Before half-precision forms existed, every op on a bf16/f16 tensor
//! widened its inputs to f32, ran the f32 kernel and rounded its primary
//! outputs once with `half` (statistics stayed f32). That is exactly "the op
//! on the f32 tensors, then each value rounded": each test below computes it
//! that way and demands the same bits from the op run on the half-precision
//! tensors, whose inputs are read block by block in their own dtype.

use crate::ops;
use crate::tensor::{DType, Tensor};
use crate::Device;
use half::{bf16, f16};

thread_local! {
    /// One device per test thread: operands of one op must share a device.
    static DEV: Device = Device::cpu();
}

fn dev() -> Device {
    DEV.with(Device::clone)
}

/// Deterministic values in `[-scale, scale)`, stored in `dtype` (so that
/// widening them to f32 is exact).
fn rand(seed: u32, dims: &[usize], scale: f32, dtype: DType) -> Tensor {
    let n: usize = dims.iter().product();
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(12_345);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            scale * ((s >> 8) as f32 / (1u32 << 23) as f32 - 1.0)
        })
        .collect();
    Tensor::from_vec(v, dims.to_vec(), &dev()).unwrap().to_dtype(dtype).unwrap()
}

fn wide(t: &Tensor) -> Tensor {
    t.to_dtype(DType::F32).unwrap()
}

/// `got` (in `dtype`, or f32 for statistics) holds the bits of `want` (f32)
/// rounded once to `got`'s dtype with `half`.
#[track_caller]
fn same(got: &Tensor, want: &Tensor, what: &str) {
    let want = want.to_vec::<f32>().unwrap();
    let (got_bits, want_bits): (Vec<u32>, Vec<u32>) = match got.dtype() {
        DType::BF16 => {
            (got.to_vec::<bf16>().unwrap().iter().map(|v| v.to_bits() as u32).collect(), want.iter().map(|&v| bf16::from_f32(v).to_bits() as u32).collect())
        }
        DType::F16 => {
            (got.to_vec::<f16>().unwrap().iter().map(|v| v.to_bits() as u32).collect(), want.iter().map(|&v| f16::from_f32(v).to_bits() as u32).collect())
        }
        _ => (got.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect(), want.iter().map(|v| v.to_bits()).collect()),
    };
    assert_eq!(got_bits.len(), want_bits.len(), "{what}: lengths");
    let bad = got_bits.iter().zip(&want_bits).position(|(g, w)| g != w);
    assert!(
        bad.is_none(),
        "{what} ({}): element {} has bits {:#x}, the widening path {:#x}",
        got.dtype(),
        bad.unwrap(),
        got_bits[bad.unwrap()],
        want_bits[bad.unwrap()]
    );
}

/// Shapes: rows shorter and longer than a block, and enough elements for
/// several parallel tasks.
const SHAPES: [[usize; 2]; 3] = [[300, 129], [2, 5000], [17, 3]];

#[test]
fn point_wise_ops_give_the_bits_of_the_widening_path() {
    for dt in [DType::BF16, DType::F16] {
        for dims in SHAPES {
            let (a, b, c) = (rand(1, &dims, 4.0, dt), rand(2, &dims, 4.0, dt), rand(3, &dims, 1.0, dt));
            let (aw, bw, cw) = (wide(&a), wide(&b), wide(&c));
            same(&ops::add(&a, &b).unwrap(), &ops::add(&aw, &bw).unwrap(), "add");
            same(&ops::sub(&a, &b).unwrap(), &ops::sub(&aw, &bw).unwrap(), "sub");
            same(&ops::mul(&a, &b).unwrap(), &ops::mul(&aw, &bw).unwrap(), "mul");
            same(&ops::scale(&a, 0.3).unwrap(), &ops::scale(&aw, 0.3).unwrap(), "scale");
            same(&ops::gelu(&a).unwrap(), &ops::gelu(&aw).unwrap(), "gelu");
            same(&ops::gelu_backward(&a, &c).unwrap(), &ops::gelu_backward(&aw, &cw).unwrap(), "gelu_backward");
            same(&ops::silu(&a).unwrap(), &ops::silu(&aw).unwrap(), "silu");
            same(&ops::silu_backward(&a, &c).unwrap(), &ops::silu_backward(&aw, &cw).unwrap(), "silu_backward");
            same(&ops::swiglu(&a, &b).unwrap(), &ops::swiglu(&aw, &bw).unwrap(), "swiglu");
            let (g, u) = ops::swiglu_backward(&a, &b, &c).unwrap();
            let (gw, uw) = ops::swiglu_backward(&aw, &bw, &cw).unwrap();
            same(&g, &gw, "swiglu_backward dgate");
            same(&u, &uw, "swiglu_backward dup");
            let bias = rand(4, &[dims[1]], 1.0, dt);
            same(&ops::add_bias(&a, &bias).unwrap(), &ops::add_bias(&aw, &wide(&bias)).unwrap(), "add_bias");
            same(&ops::bias_grad(&c).unwrap(), &ops::bias_grad(&cw).unwrap(), "bias_grad");
            // A half-precision operand with an f32 one: the f32 one is read as is.
            same(&ops::add(&a, &bw).unwrap(), &ops::add(&aw, &bw).unwrap(), "add with an f32 operand");
        }
    }
}

#[test]
fn row_ops_give_the_bits_of_the_widening_path() {
    for dt in [DType::BF16, DType::F16] {
        for dims in SHAPES {
            let row = dims[1];
            let (x, dy) = (rand(5, &dims, 3.0, dt), rand(6, &dims, 1.0, dt));
            let (xw, dyw) = (wide(&x), wide(&dy));
            let y = ops::softmax(&x).unwrap();
            same(&y, &ops::softmax(&xw).unwrap(), "softmax");
            same(&ops::softmax_backward(&y, &dy).unwrap(), &ops::softmax_backward(&wide(&y), &dyw).unwrap(), "softmax_backward");
            let l = ops::log_softmax(&x).unwrap();
            same(&l, &ops::log_softmax(&xw).unwrap(), "log_softmax");
            same(&ops::log_softmax_backward(&l, &dy).unwrap(), &ops::log_softmax_backward(&wide(&l), &dyw).unwrap(), "log_softmax_backward");

            let (g, b) = (rand(7, &[row], 1.0, dt), rand(8, &[row], 1.0, dt));
            for beta in [Some(&b), None] {
                let (y, saved) = ops::layer_norm(&x, &g, beta, 1e-5).unwrap();
                let bw = beta.map(wide);
                let (yw, saved_w) = ops::layer_norm(&xw, &wide(&g), bw.as_ref(), 1e-5).unwrap();
                same(&y, &yw, "layer_norm");
                same(saved.mean.as_ref().unwrap(), saved_w.mean.as_ref().unwrap(), "layer_norm mean");
                same(&saved.rstd, &saved_w.rstd, "layer_norm rstd");
                let (dx, dg, db) = ops::layer_norm_backward(&x, &g, beta.is_some(), &saved, &dy).unwrap();
                let (dxw, dgw, dbw) = ops::layer_norm_backward(&xw, &wide(&g), beta.is_some(), &saved_w, &dyw).unwrap();
                same(&dx, &dxw, "layer_norm_backward dx");
                same(&dg, &dgw, "layer_norm_backward dgamma");
                if let (Some(db), Some(dbw)) = (db, dbw) {
                    same(&db, &dbw, "layer_norm_backward dbeta");
                }
            }
            let (y, saved) = ops::rms_norm(&x, &g, 1e-6).unwrap();
            let (yw, saved_w) = ops::rms_norm(&xw, &wide(&g), 1e-6).unwrap();
            same(&y, &yw, "rms_norm");
            same(&saved.rstd, &saved_w.rstd, "rms_norm rstd");
            let (dx, dg) = ops::rms_norm_backward(&x, &g, &saved, &dy).unwrap();
            let (dxw, dgw) = ops::rms_norm_backward(&xw, &wide(&g), &saved_w, &dyw).unwrap();
            same(&dx, &dxw, "rms_norm_backward dx");
            same(&dg, &dgw, "rms_norm_backward dgamma");
        }
    }
}

#[test]
fn cross_entropy_gives_the_bits_of_the_widening_path() {
    let dev = dev();
    for dt in [DType::BF16, DType::F16] {
        for (rows, vocab) in [(300, 65), (3, 9000), (1000, 7)] {
            let logits = rand(9, &[rows, vocab], 8.0, dt);
            let lw = wide(&logits);
            // Every third row ignored.
            let ignore = Some(vocab as u32 + 1);
            let t: Vec<u32> = (0..rows).map(|r| if r % 3 == 2 { vocab as u32 + 1 } else { (r * 7919 % vocab) as u32 }).collect();
            let targets = Tensor::from_vec(t, [rows], &dev).unwrap();
            let (loss, saved) = ops::cross_entropy(&logits, &targets, ignore).unwrap();
            let (loss_w, saved_w) = ops::cross_entropy(&lw, &targets, ignore).unwrap();
            same(&loss, &loss_w, "cross_entropy loss");
            same(&saved.lse, &saved_w.lse, "cross_entropy lse");
            let d = ops::cross_entropy_backward(&logits, &targets, ignore, &saved, 1.0).unwrap();
            same(&d, &ops::cross_entropy_backward(&lw, &targets, ignore, &saved_w, 1.0).unwrap(), "cross_entropy_backward");
            // One shard of a vocabulary twice as large.
            let (lse, tl) = ops::vocab_shard_stats(&logits, &targets, vocab, 2 * vocab, ignore).unwrap();
            let (lse_w, tl_w) = ops::vocab_shard_stats(&lw, &targets, vocab, 2 * vocab, ignore).unwrap();
            same(&lse, &lse_w, "vocab_shard_stats lse");
            same(&tl, &tl_w, "vocab_shard_stats target logit");
            let dloss = rand(10, &[rows], 1.0, DType::F32);
            let d = ops::vocab_shard_backward(&logits, &targets, vocab, 2 * vocab, ignore, &lse, &dloss).unwrap();
            same(&d, &ops::vocab_shard_backward(&lw, &targets, vocab, 2 * vocab, ignore, &lse_w, &dloss).unwrap(), "vocab_shard_backward");
        }
    }
}

#[test]
fn bf16_products_run_natively_and_track_the_f32_product() {
    // The op layer routes bf16 products to the bf16 kernel (where the CPU has
    // the instruction, otherwise the widening path); both sum in f32 and
    // round once, so the result is within a rounding of the f32 product of
    // the same values (here: |error| <= 2^-8 |exact| plus a depth-sized f32 term).
    let (a, w, bias) = (rand(11, &[3, 70, 130], 1.0, DType::BF16), rand(12, &[90, 130], 1.0, DType::BF16), rand(13, &[90], 1.0, DType::BF16));
    let y = ops::matmul_bias(&a, &w.t().unwrap(), &bias).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    let yw = ops::matmul_bias(&wide(&a), &wide(&w).t().unwrap(), &wide(&bias)).unwrap();
    let (got, want) = (y.to_vec::<bf16>().unwrap(), yw.to_vec::<f32>().unwrap());
    for (g, w) in got.iter().zip(&want) {
        assert!((g.to_f32() - w).abs() <= w.abs() / 256.0 + 1e-4, "{g} vs {w}");
    }
    // Backward through the same dispatch, transposed operands included.
    let (da, dw) = ops::matmul_backward(&a, &w.t().unwrap(), &y).unwrap();
    let (daw, dww) = ops::matmul_backward(&wide(&a), &wide(&w).t().unwrap(), &wide(&y)).unwrap();
    for (got, want) in [(da, daw), (dw, dww)] {
        assert_eq!(got.dtype(), DType::BF16);
        let (g, w) = (got.to_vec::<bf16>().unwrap(), want.to_vec::<f32>().unwrap());
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(g.iter().zip(&w).all(|(g, w)| (g.to_f32() - w).abs() <= w.abs() / 256.0 + 1e-4 * scale));
    }
}

/// Where the CPU has bf16 dot products, attention on bf16 runs its tile
/// products on them (rounding probabilities and score gradients to bf16;
/// tessera-kernels tests it against an exact reference with its error
/// bounds): here it only has to stay within a few bf16 roundings of the
/// widening path. Elsewhere it must give that path's bits.
#[track_caller]
fn attention_close(got: &Tensor, want: &Tensor, what: &str) {
    if !tessera_kernels::cpu::attention::bf16_dot_products() {
        return same(got, want, what);
    }
    let (g, w) = (got.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
    let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    let bad = g.iter().zip(&w).position(|(g, w)| (g - w).abs() > scale / 32.0);
    assert!(bad.is_none(), "{what}: element {} is {} against {} (scale {scale})", bad.unwrap(), g[bad.unwrap()], w[bad.unwrap()]);
}

#[test]
fn attention_on_bf16_follows_the_widening_path() {
    use crate::ops::{AttnOpts, QkvHeads};
    let dt = DType::BF16;
    // Separate heads: 2 sequences, 4 query heads sharing 2 kv heads.
    let (q, k, v) = (rand(20, &[2, 4, 90, 16], 2.0, dt), rand(21, &[2, 2, 90, 16], 2.0, dt), rand(22, &[2, 2, 90, 16], 1.0, dt));
    let opts = AttnOpts::causal();
    let (out, lse) = ops::attention(&q, &k, &v, opts).unwrap();
    let (out_w, lse_w) = ops::attention(&wide(&q), &wide(&k), &wide(&v), opts).unwrap();
    attention_close(&out, &out_w, "attention out");
    attention_close(&lse, &lse_w, "attention lse");
    let dout = rand(23, &[2, 4, 90, 16], 1.0, dt);
    let (dq, dk, dv) = ops::attention_backward(&q, &k, &v, &out, &lse, &dout, opts).unwrap();
    let (dqw, dkw, dvw) = ops::attention_backward(&wide(&q), &wide(&k), &wide(&v), &wide(&out), &lse, &wide(&dout), opts).unwrap();
    attention_close(&dq, &dqw, "attention dq");
    attention_close(&dk, &dkw, "attention dk");
    attention_close(&dv, &dvw, "attention dv");
    // The fused projection of a self-attention layer: [batch, seq, (6 + 2·3)·8].
    let heads = QkvHeads { q_heads: 6, kv_heads: 3, head_dim: 8 };
    let qkv = rand(24, &[3, 70, heads.width()], 2.0, dt);
    let (out, lse) = ops::attention_packed(&qkv, heads, opts).unwrap();
    let (out_w, lse_w) = ops::attention_packed(&wide(&qkv), heads, opts).unwrap();
    attention_close(&out, &out_w, "attention_packed out");
    attention_close(&lse, &lse_w, "attention_packed lse");
    let dout = rand(25, &[3, 70, 48], 1.0, dt);
    let g = ops::attention_packed_backward(&qkv, &out, &lse, &dout, heads, opts).unwrap();
    let gw = ops::attention_packed_backward(&wide(&qkv), &wide(&out), &lse, &wide(&dout), heads, opts).unwrap();
    attention_close(&g, &gw, "attention_packed dqkv");
}
