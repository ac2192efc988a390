//! FP8 training: a linear layer's products against an f64 reference made
//! from the formats' own encode and decode, with delayed scaling moving
//! the scales between steps; and runs of the trainer in FP8 against f32
//! and against one rank.

mod common;
use common::training::*;
use common::*;
use tessera::module::{self, Act, Cx, Fp8Recipe, Module, Plain, Vocab};
use tessera::nn::Linear;
use tessera::observe::read_metrics;
use tessera::ops::Fp8Format;
use tessera::prelude::*;

/// `v` as FP8 at `scale`, back at its own scale, in f64.
fn q(format: Fp8Format, v: f32, scale: f32) -> f64 {
    f64::from(format.decode(format.encode(v * scale))) / f64::from(scale)
}

/// `a [m, k] · b [k, n]` in f64.
fn product(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> Vec<f64> {
    (0..m * n).map(|i| (0..k).map(|c| a[i / n * k + c] * b[c * n + i % n]).sum()).collect()
}

fn transpose(a: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    (0..rows * cols).map(|i| a[(i % rows) * cols + i / rows]).collect()
}

/// Three steps of a linear layer in FP8: the first scaled by its own
/// amaxes (no history yet), the later ones at the scales the earlier
/// steps' amaxes set (448 / amax for the E4M3 input and weight, 57344 /
/// amax for the E5M2 gradient, the largest amax of the history).
/// Forward `Q(x)·Q(W)ᵀ + b`, backward `dX = Q(dY)·Q(W)` and `dW = Q(dY)ᵀ·Q(x)`,
/// the bias's gradient from the unquantized `dY`.
#[test]
fn a_linear_layer_in_fp8_multiplies_the_quantized_operands_at_the_delayed_scales() {
    let (m, k, n) = (6, 8, 5);
    let dev = Device::cpu();
    let mut cx = Cx::new(dev.clone()).with_fp8(Fp8Recipe::default()).unwrap();
    let layer = module::build(Linear::new(k, n, true).unwrap(), &cx).unwrap();
    let w: Vec<f32> = layer.weight().value().unwrap().to_vec().unwrap();
    let b: Vec<f32> = layer.bias().unwrap().value().unwrap().to_vec().unwrap();
    let (e4, e5) = (Fp8Format::E4M3, Fp8Format::E5M2);
    let amax = |v: &[f32]| v.iter().fold(0f32, |a, x| a.max(x.abs()));
    let mut scales = (1.0f32, 1.0f32, 1.0f32);
    let mut peaks = (0.0f32, 0.0f32, 0.0f32);
    for step in 0..3u64 {
        // Inputs of a few binades, so that the scale matters.
        let x: Vec<f32> = rand_vec(10 + step, m * k).iter().map(|v| (*v * 3.0 / (1 + step) as f64) as f32).collect();
        let dy: Vec<f32> = rand_vec(20 + step, m * n).iter().map(|v| (*v * 1e-3) as f32).collect();
        let xt = Tensor::from_vec(x.clone(), [m, k], &dev).unwrap();
        let (y, saved) = <Linear as Module<Plain>>::forward(&layer, &mut cx, Act::new(xt)).unwrap();
        let dx = <Linear as Module<Plain>>::backward(&layer, &mut cx, saved, Act::new(Tensor::from_vec(dy.clone(), [m, n], &dev).unwrap())).unwrap();
        if step == 0 {
            // No history yet: the first step is scaled by its own amaxes.
            scales = (448.0 / amax(&x), 448.0 / amax(&w), 57344.0 / amax(&dy));
        }
        let (sx, sw, sdy) = scales;
        let xq: Vec<f64> = x.iter().map(|&v| q(e4, v, sx)).collect();
        let wq: Vec<f64> = w.iter().map(|&v| q(e4, v, sw)).collect();
        let dyq: Vec<f64> = dy.iter().map(|&v| q(e5, v, sdy)).collect();
        let mut want_y = product(&xq, &transpose(&wq, n, k), m, k, n);
        want_y.iter_mut().enumerate().for_each(|(i, v)| *v += f64::from(b[i % n]));
        let want_dx = product(&dyq, &wq, m, n, k);
        let want_dw = product(&transpose(&dyq, m, n), &xq, n, m, k);
        let got = |t: &Tensor| t.to_f64_vec().unwrap();
        assert_close(&got(y.tensor()), &want_y, 1e-6, 1e-5, &format!("step {step}: y"));
        assert_close(&got(dx.tensor()), &want_dx, 1e-9, 1e-5, &format!("step {step}: dx"));
        assert_close(&got(&layer.weight().grad().unwrap()), &want_dw, 1e-9, 1e-5, &format!("step {step}: dw"));
        // FP8 is not f32: the quantized product differs from the exact one.
        let exact =
            product(&x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), &transpose(&w.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), n, k), m, k, n);
        assert!(exact.iter().zip(&want_y).any(|(e, y)| (e + f64::from(b[0]) - y).abs() > 1e-4), "step {step}: FP8 rounding shows");
        layer.weight().take_grad();
        layer.bias().unwrap().take_grad();
        cx.end_fp8_step().unwrap();
        // The largest amax of the history (here, of every step so far).
        peaks = (peaks.0.max(amax(&x)), peaks.1.max(amax(&w)), peaks.2.max(amax(&dy)));
        scales = (448.0 / peaks.0, 448.0 / peaks.1, 57344.0 / peaks.2);
        let got_scales: Vec<f32> = cx.fp8_scales().iter().map(|s| s.2).collect();
        // Ordered by operand: input, weight, grad.
        assert_eq!(got_scales, vec![scales.0, scales.1, scales.2], "step {step}: the next step's scales");
    }
}

/// The trainer in FP8 (`precision.fp8`) learns the counting task as f32
/// does (the mean of the last 5 of 40 steps within 10 %), and a dp2 × tp2
/// × pp2 run in FP8 (with sequence parallelism) takes the steps one rank
/// in FP8 takes: the amaxes reduced over the groups give every rank the
/// one rank's scales (a mutation that reduces no amax moves the first
/// step's loss by 5e-5).
#[test]
fn fp8_training_learns_like_f32_and_matches_one_rank() {
    let run = |name: &str, text: &str| {
        let out = scratch(&format!("fp8-{name}"));
        train(config(&out, text, &["run.steps=40", "optim.lr=1e-2"]), 0..0);
        let m = read_metrics(out.join("metrics.jsonl")).unwrap();
        let _ = std::fs::remove_dir_all(&out);
        m.iter().map(|m| m.loss).collect::<Vec<f64>>()
    };
    let batch = "[batch]\nmicro_batch = 4\ngrad_accum = 2\n";
    let f32_losses = run("f32", batch);
    let one = run("one-rank", &format!("{batch}[precision]\nfp8 = true\n"));
    let tail = |l: &[f64]| l[l.len() - 5..].iter().sum::<f64>() / 5.0;
    assert!(tail(&one) < 0.8 * one[0], "FP8 learns: {} -> {}", one[0], tail(&one));
    assert!((tail(&one) - tail(&f32_losses)).abs() <= 0.1 * tail(&f32_losses), "last losses {} in FP8, {} in f32", tail(&one), tail(&f32_losses));
    assert!(one != f32_losses, "FP8 rounds the products");
    // Two replicas of half the microbatch: the one rank's batch; the
    // tensor-parallel collectives cut in two pieces, each quantized at the
    // whole operand's scale.
    let mesh = run("mesh", "[batch]\nmicro_batch = 2\ngrad_accum = 2\n[mesh]\ndp = 2\ntp = 2\nsp = true\ntp_overlap = 2\npp = 2\n[precision]\nfp8 = true\n");
    // The same steps to rounding while no FP8 code lands on the other side
    // of a rounding boundary; then a flipped code now and then moves the
    // runs apart by a few parts in ten thousand, a few per thousand by the
    // end.
    for (step, (a, b)) in one.iter().zip(&mesh).enumerate() {
        let bound = if step < 4 { 1e-6 } else { 1e-2 };
        assert!((a - b).abs() <= bound * a.abs(), "step {}: loss {b} on dp2 × tp2 × pp2, {a} on one rank", step + 1);
    }
}

/// The output head (a linear layer in the vocabulary role) stays out of
/// FP8, as FP8 recipes keep it: its logits and gradients are the compute
/// dtype's, and it takes no scale.
#[test]
fn the_output_head_keeps_its_precision() {
    let dev = Device::cpu();
    let run = |fp8: bool| {
        let mut cx = Cx::new(dev.clone());
        if fp8 {
            cx = cx.with_fp8(Fp8Recipe::default()).unwrap();
        }
        let head = module::build(Linear::new(8, 12, false).unwrap(), &cx).unwrap();
        let x = Tensor::from_vec(rand_vec(3, 4 * 8).iter().map(|v| *v as f32).collect::<Vec<_>>(), [1, 4, 8], &dev).unwrap();
        let (y, saved) = <Linear as Module<Vocab>>::forward(&head, &mut cx, Act::new(x)).unwrap();
        let dy = Tensor::from_vec(rand_vec(4, 4 * 12).iter().map(|v| *v as f32).collect::<Vec<_>>(), [1, 4, 12], &dev).unwrap();
        let dx = <Linear as Module<Vocab>>::backward(&head, &mut cx, saved, Act::new(dy)).unwrap();
        let got = (y.tensor().to_vec::<f32>().unwrap(), dx.tensor().to_vec::<f32>().unwrap(), head.weight().grad().unwrap().to_vec::<f32>().unwrap());
        (got, cx.fp8_scales().len())
    };
    let (plain, _) = run(false);
    let (fp8, scales) = run(true);
    assert_eq!(fp8, plain);
    assert_eq!(scales, 0);
}

/// A run in FP8 stopped and resumed takes the uninterrupted run's steps
/// bit for bit, on one rank and over pipeline stages (each holding its
/// own layers' scalings, which the checkpoint gathers): the amax histories
/// and scales travel with the checkpoint. A mutation that saves no
/// scalings starts the resumed steps from fresh first-use scales and
/// moves their losses.
#[test]
fn an_fp8_run_resumes_bit_for_bit() {
    for (tag, mesh) in [("one", ""), ("dp2-tp2-pp2", "[mesh]\ndp = 2\ntp = 2\npp = 2\n")] {
        let (a, b) = (scratch(&format!("fp8-resume-{tag}-straight")), scratch(&format!("fp8-resume-{tag}-resumed")));
        let text = format!("{mesh}[batch]\nmicro_batch = 2\ngrad_accum = 2\n[precision]\nfp8 = true\nfp8_history = 4\n[optim]\nclip = 0.0\n");
        let straight = train(config(&a, &text, &["run.steps=8"]), 0..0);
        let first = train(config(&b, &text, &["run.steps=8", "run.stop_after=4"]), 0..0);
        let resumed = train(config(&b, &text, &["run.steps=8"]), 0..0);
        assert_eq!(resumed.resumed_from, 4);
        let losses: Vec<f64> = first.losses.iter().chain(&resumed.losses).map(|l| l.1).collect();
        assert_eq!(losses, straight.losses.iter().map(|l| l.1).collect::<Vec<_>>(), "FP8 on {tag}: losses");
        assert_eq!(final_params(&resumed), final_params(&straight), "FP8 on {tag}: parameters");
    }
}

/// A snapshot of the FP8 scalings restores to the same scales, and a key
/// that names no operand is refused with the form keys take.
#[test]
fn fp8_snapshots_restore_and_refuse_unknown_operands() {
    let dev = Device::cpu();
    let cx = Cx::new(dev.clone()).with_fp8(Fp8Recipe::default()).unwrap();
    let mut cx = cx;
    let layer = module::build(Linear::new(8, 4, true).unwrap(), &cx).unwrap();
    let x = Tensor::from_vec(rand_vec(2, 16).into_iter().map(|v| v as f32).collect(), [2, 8], &dev).unwrap();
    let (y, saved) = <Linear as Module<Plain>>::forward(&layer, &mut cx, Act::new(x)).unwrap();
    <Linear as Module<Plain>>::backward(&layer, &mut cx, saved, Act::new(y.tensor().clone())).unwrap();
    cx.end_fp8_step().unwrap();
    let snapshot = cx.fp8_snapshot();
    assert_eq!(snapshot.len(), 3, "input, weight and gradient: {snapshot:?}");
    let other = Cx::new(dev.clone()).with_fp8(Fp8Recipe::default()).unwrap();
    other.restore_fp8(&snapshot).unwrap();
    assert_eq!(other.fp8_scales(), cx.fp8_scales());
    let mut bad = snapshot.clone();
    let (key, value) = bad.pop_first().unwrap();
    bad.insert(format!("{key}-bias"), value);
    let e = other.restore_fp8(&bad).unwrap_err().to_string();
    assert!(e.contains("layer/input"), "{e}");
}
