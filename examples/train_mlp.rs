//! Trains a small MLP on CPU to classify points of three interleaved spirals,
//! using Tessera's ops with their hand-written backward passes and the fused
//! AdamW update. Prints the loss as it falls and the final accuracy.
//!
//! Run: `cargo run --release --example train_mlp`

use anyhow::Result;
use clap::Parser;
use std::f64::consts::TAU;
use std::time::Instant;
use tessera::ops::{self, AdamWStep};
use tessera::prelude::*;

#[derive(Parser)]
#[command(about = "Train a small MLP on three spirals with Tessera's CPU backend")]
struct Args {
    /// Optimizer steps (each over the whole data set).
    #[arg(long, default_value_t = 400)]
    steps: u64,
    /// Width of the two hidden layers.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Points per spiral arm.
    #[arg(long, default_value_t = 200)]
    points: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Seed of the weight initialisation.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// A dense layer `y = x·W + b` with its AdamW state.
struct Linear {
    w: Tensor,
    b: Tensor,
    state: Vec<(Tensor, Tensor)>,
}

impl Linear {
    fn new(inputs: usize, outputs: usize, key: RngKey, dev: &Device) -> Result<Self> {
        // He initialisation for GELU layers.
        let std = (2.0 / inputs as f64).sqrt();
        let w = Tensor::rand(Init::Normal { mean: 0.0, std }, key, [inputs, outputs], DType::F32, dev)?;
        let b = Tensor::zeros([outputs], DType::F32, dev)?;
        let state = [&w, &b].iter().map(|p| Ok((p.zeros_like()?, p.zeros_like()?))).collect::<Result<_>>()?;
        Ok(Linear { w, b, state })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(ops::add_bias(&ops::matmul(x, &self.w)?, &self.b)?)
    }

    /// Returns the input gradient and applies the update to the parameters.
    fn backward_and_step(&self, x: &Tensor, dy: &Tensor, step: &AdamWStep) -> Result<Tensor> {
        let (dx, dw) = ops::matmul_backward(x, &self.w, dy)?;
        let db = ops::bias_grad(dy)?;
        for ((p, g), (m, v)) in [(&self.w, &dw), (&self.b, &db)].into_iter().zip(&self.state) {
            ops::adamw_update(step, p, g, m, v)?;
        }
        Ok(dx)
    }
}

/// Three spiral arms in the plane; the label is the arm.
fn spirals(points: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let noise = RngKey::new(42, 0);
    let (mut xy, mut labels) = (Vec::new(), Vec::new());
    for arm in 0..3u32 {
        for i in 0..points {
            let r = i as f64 / points as f64;
            let idx = (arm as usize * points + i) as u64;
            let angle = arm as f64 * TAU / 3.0 + 1.75 * TAU * r + 0.15 * noise.normal_at(idx);
            xy.extend([(r * angle.cos()) as f32, (r * angle.sin()) as f32]);
            labels.push(arm);
        }
    }
    let n = labels.len();
    Ok((Tensor::from_vec(xy, [n, 2], dev)?, Tensor::from_vec(labels, [n], dev)?))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = Device::cpu();
    let (x, y) = spirals(args.points, &dev)?;
    let key = |stream| RngKey::new(args.seed, stream);
    let layers = [Linear::new(2, args.hidden, key(0), &dev)?, Linear::new(args.hidden, args.hidden, key(1), &dev)?, Linear::new(args.hidden, 3, key(2), &dev)?];
    println!("training a 2-{h}-{h}-3 MLP on {} points of three spirals", y.elem_count(), h = args.hidden);
    let start = Instant::now();
    let (mut first, mut last) = (None, 0.0);
    for step in 1..=args.steps {
        // forward: keep every layer's input for the backward
        let mut inputs = vec![x.clone()];
        let mut pre = Vec::new();
        let mut h = x.clone();
        for (i, layer) in layers.iter().enumerate() {
            let z = layer.forward(&h)?;
            h = if i + 1 < layers.len() { ops::gelu(&z)? } else { z.clone() };
            pre.push(z);
            inputs.push(h.clone());
        }
        let (loss, saved) = ops::cross_entropy(&h, &y, None)?;
        let loss = loss.to_scalar()?;
        first.get_or_insert(loss);
        last = loss;
        // backward and update, last layer first
        let lr = cosine_lr(args.lr, step, args.steps);
        let adamw = AdamWStep { lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step, grad_scale: 1.0 };
        let mut dz = ops::cross_entropy_backward(&h, &y, None, &saved, 1.0)?;
        for i in (0..layers.len()).rev() {
            let dx = layers[i].backward_and_step(&inputs[i], &dz, &adamw)?;
            if i > 0 {
                dz = ops::gelu_backward(&pre[i - 1], &dx)?;
            }
        }
        if step == 1 || step % 50 == 0 || step == args.steps {
            println!("step {step:>4}  loss {loss:.4}  lr {lr:.2e}");
        }
    }
    let logits = layers.iter().enumerate().try_fold(x.clone(), |h, (i, l)| -> Result<Tensor> {
        let z = l.forward(&h)?;
        Ok(if i + 1 < layers.len() { ops::gelu(&z)? } else { z })
    })?;
    let (_, predicted) = ops::topk(&logits, 1)?;
    let predicted = predicted.to_vec::<u32>()?;
    let labels = y.to_vec::<u32>()?;
    let correct = predicted.iter().zip(&labels).filter(|(p, l)| p == l).count();
    println!(
        "loss {:.4} -> {last:.4}, accuracy {:.1}% in {:.2}s",
        first.unwrap_or(0.0),
        100.0 * correct as f64 / labels.len() as f64,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Linear warm-up over the first 5% of steps, then cosine decay to 10% of the peak.
fn cosine_lr(peak: f64, step: u64, total: u64) -> f64 {
    let warmup = (total / 20).max(1);
    if step <= warmup {
        return peak * step as f64 / warmup as f64;
    }
    let progress = (step - warmup) as f64 / (total - warmup).max(1) as f64;
    peak * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
}
