//! AdamW and ZeRO stages 1, 2 and 3: sharded training on 2 and 4
//! in-process ranks equals plain AdamW on one rank over the whole batch, and
//! each rank's model-state memory matches the analytic figures of
//! `docs/zero.md`.

mod common;
use common::models::{Gpt, GptBlock};
use common::*;
use std::ops::Range;
use std::sync::Arc;
use tessera::dist::inproc::InProcess;
use tessera::dist::Communicator;
use tessera::module::{self, Act, Cx, Groups, Module};
use tessera::optim::{AdamW, AdamWConfig};
use tessera::parallel::zero::{Stage, Zero, ZeroConfig, ZeroStats};
use tessera::prelude::*;

/// A learning-rate schedule: one rate per step.
const LRS: [f64; 3] = [3e-3, 2e-3, 1e-3];

fn adamw() -> AdamWConfig {
    AdamWConfig { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 }
}

/// Builds the input rows `rows` of the global batch on `dev`.
type Input = dyn Fn(Range<usize>, &Device) -> Tensor + Sync;

/// The half mean squared error of `y` (rows `rows` of a batch of `batch`)
/// against fixed random targets, and its gradient.
fn mse(y: &Tensor, rows: Range<usize>, batch: usize) -> (f64, Tensor) {
    let y_vals = y.to_f64_vec().unwrap();
    let per_row = y_vals.len() / rows.len();
    let target = rand_vec(100, per_row * batch);
    let target = &target[rows.start * per_row..rows.end * per_row];
    let count = y_vals.len() as f64;
    let loss = y_vals.iter().zip(target).map(|(a, b)| (a - b) * (a - b)).sum::<f64>() / (2.0 * count);
    let dy: Vec<f64> = y_vals.iter().zip(target).map(|(a, b)| (a - b) / count).collect();
    let dy = Tensor::from_vec(dy, y.shape().clone(), y.device()).unwrap().to_dtype(y.dtype()).unwrap();
    (loss, dy)
}

/// Every distinct parameter's values, by name.
fn params_of<M: Module>(m: &M) -> Vec<(String, Vec<f64>)> {
    let mut seen: Vec<Param> = Vec::new();
    let mut out = Vec::new();
    module::visit_params(m, |e| {
        if !seen.iter().any(|p| p.same(e.param)) {
            seen.push(e.param.clone());
            out.push((e.name.to_string(), e.param.value()?.to_f64_vec()?));
        }
        Ok(())
    })
    .unwrap();
    out
}

struct Run {
    /// Each step's loss on this rank's share of the batch.
    losses: Vec<f64>,
    params: Vec<(String, Vec<f64>)>,
}

/// Plain AdamW on one rank over the whole batch.
fn single<M: Module>(build: &(dyn Fn() -> M + Sync), input: &Input, batch: usize) -> Run {
    let mut cx = Cx::new(Device::cpu()).with_dtype(DType::F64).with_seed(7);
    let model = module::build(build(), &cx).unwrap();
    let mut opt = AdamW::new(&model, adamw()).unwrap();
    let mut losses = Vec::new();
    for lr in LRS {
        let x = input(0..batch, cx.device());
        let (y, saved) = model.forward(&mut cx, Act::new(x)).unwrap();
        let (loss, dy) = mse(y.tensor(), 0..batch, batch);
        model.backward(&mut cx, saved, Act::new(dy)).unwrap();
        opt.step(lr).unwrap();
        opt.zero_grad();
        losses.push(loss);
    }
    Run { losses, params: params_of(&model) }
}

/// A rank's bytes in use at the points the memory test checks.
#[derive(Clone, Copy, Debug, Default)]
struct Mem {
    /// After the gradients of the second step are averaged (parameters,
    /// gradients and optimizer state; activations dropped).
    with_grads: usize,
    /// After the second step's update (parameters and optimizer state).
    after_step: usize,
    /// The most in use during the second step (forward to update).
    peak: usize,
    /// With offload: the most the host pool held during the second step.
    host: usize,
}

struct RankOut {
    run: Run,
    stats: ZeroStats,
    mem: Mem,
    psi: usize,
}

/// ZeRO at `stage` over `dp` in-process ranks, each on its rows of the batch.
#[allow(clippy::too_many_arguments)]
fn zero_run<M: Module>(
    stage: Stage,
    offload: bool,
    dp: usize,
    dtype: DType,
    bucket_bytes: usize,
    build: &(dyn Fn() -> M + Sync),
    input: &Input,
    batch: usize,
) -> Vec<RankOut> {
    let world = InProcess::new(dp).unwrap();
    let per = batch / dp;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..dp)
            .map(|rank| {
                let world = &world;
                s.spawn(move || {
                    let dev = Device::cpu();
                    let comm: Arc<dyn Communicator> = Arc::new(world.communicator(rank, &dev).unwrap());
                    let mut groups = Groups::single();
                    groups.dp = comm.clone();
                    let cx = Cx::new(dev.clone()).with_dtype(dtype).with_seed(7).with_groups(groups);
                    // Mixed precision that saves memory: half-precision
                    // parameters and gradients, f32 master copy in the engine.
                    let cx = if dtype.is_half() { cx.with_half_params() } else { cx };
                    let model = module::build(build(), &cx).unwrap();
                    let config = ZeroConfig::new(stage).with_adamw(adamw()).with_bucket_bytes(bucket_bytes).with_offload(offload);
                    let zero = Arc::new(Zero::new(&model, comm, config).unwrap());
                    let mut cx = cx.with_hooks(zero.clone());
                    let rows = rank * per..(rank + 1) * per;
                    let (mut losses, mut mem) = (Vec::new(), Mem::default());
                    for (step, lr) in LRS.into_iter().enumerate() {
                        dev.reset_peak();
                        if let Some(h) = zero.host() {
                            h.reset_peak();
                        }
                        let x = {
                            let x = input(rows.clone(), &dev);
                            if x.dtype().is_float() {
                                x.to_dtype(dtype).unwrap()
                            } else {
                                x
                            }
                        };
                        let (y, saved) = model.forward(&mut cx, Act::new(x)).unwrap();
                        let (loss, dy) = mse(y.tensor(), rows.clone(), batch);
                        drop(y);
                        model.backward(&mut cx, saved, Act::new(dy)).unwrap();
                        zero.finish().unwrap();
                        let with_grads = dev.memory_stats().in_use;
                        zero.step(lr).unwrap();
                        if step == 1 {
                            let host = zero.host().map_or(0, |h| h.memory_stats().peak);
                            mem = Mem { with_grads, after_step: dev.memory_stats().in_use, peak: dev.memory_stats().peak, host };
                        }
                        losses.push(loss);
                    }
                    let params = zero.gather_parameters().unwrap().into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())).collect();
                    RankOut { run: Run { losses, params }, stats: zero.stats(), mem, psi: zero.layout().numel }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Checks every rank of a ZeRO run against the single-rank reference.
fn check_equal(what: &str, outs: &[RankOut], reference: &Run) {
    let dp = outs.len();
    for step in 0..LRS.len() {
        let mean = outs.iter().map(|o| o.run.losses[step]).sum::<f64>() / dp as f64;
        let want = reference.losses[step];
        assert!((mean - want).abs() <= 1e-12 * want.abs().max(1.0), "{what}: loss at step {step}: {mean} vs {want}");
    }
    for (rank, o) in outs.iter().enumerate() {
        assert_eq!(o.run.params.len(), reference.params.len(), "{what}: one value per distinct parameter");
        for ((name, got), (want_name, want)) in o.run.params.iter().zip(&reference.params) {
            assert_eq!(name, want_name, "{what}: parameters in visit order");
            assert_close(got, want, 1e-11, 1e-9, &format!("{what} rank {rank}: {name}"));
        }
    }
}

fn block_input(d: usize, seq: usize) -> impl Fn(Range<usize>, &Device) -> Tensor + Sync {
    move |rows: Range<usize>, dev: &Device| {
        let row = seq * d;
        let all = rand_vec(1, 4 * row);
        Tensor::from_vec(all[rows.start * row..rows.end * row].to_vec(), [rows.len(), seq, d], dev).unwrap()
    }
}

#[test]
fn stages_one_two_three_on_two_and_four_ranks_equal_adamw_on_one_rank() {
    // Hidden 6: Ψ = 510, which 4 does not divide, so the last shard is padded
    // and parameters straddle shards; 256-byte buckets make several of them.
    let build = || GptBlock::new(6, 2).unwrap();
    let input = block_input(6, 3);
    let reference = single(&build, &input, 4);
    assert!(reference.losses[2] < reference.losses[0], "the loss goes down: {:?}", reference.losses);
    for stage in [Stage::One, Stage::Two, Stage::Three] {
        for dp in [2, 4] {
            let outs = zero_run(stage, false, dp, DType::F64, 256, &build, &input, 4);
            check_equal(&format!("{stage:?}, dp {dp}"), &outs, &reference);
            let stats = outs[0].stats;
            assert_eq!(stats.steps, 3);
            assert!(stats.grad_buckets >= 9, "several buckets per step: {stats:?}");
            assert!(stats.grad_buckets_during_backward >= 6, "buckets start during the backward: {stats:?}");
            if stage == Stage::Three {
                // Six layers own parameters: each gathered for its forward and its backward.
                assert_eq!(stats.gathers, 3 * 12, "{stats:?}");
                // From the second step on, all but each step's first gather were prefetched.
                assert_eq!(stats.prefetched, 2 * 11, "{stats:?}");
            } else {
                assert_eq!(stats.gathers, 0);
            }
        }
    }
}

#[test]
fn stage_three_handles_tied_weights_and_stacked_layers() {
    // Embedding tied to the output head, two blocks in a stack: the head's
    // gather brings the shared table back, and its gradient (from both uses)
    // is reduced once.
    let (vocab, seq, batch) = (11, 3, 4);
    let build = || Gpt::new(vocab, 8, 2, 2).unwrap();
    let input = move |rows: Range<usize>, dev: &Device| {
        let ids: Vec<u32> = (rows.start * seq..rows.end * seq).map(|i| (i * 7 % vocab) as u32).collect();
        Tensor::from_vec(ids, [rows.len(), seq], dev).unwrap()
    };
    let reference = single(&build, &input, batch);
    for stage in [Stage::Two, Stage::Three] {
        let outs = zero_run(stage, false, 2, DType::F64, 512, &build, &input, batch);
        check_equal(&format!("GPT {stage:?}, dp 2"), &outs, &reference);
    }
}

/// The analytic per-rank bytes of docs/zero.md, before padding:
/// parameters, gradients and the optimizer state (the two Adam moments, and
/// the f32 master copy when parameters are held in half precision). With
/// gradients and after the step (when the step has consumed them). In f32
/// that is 4 + 4 + 8 bytes per element; in half precision 2 + 2 + 12, the
/// paper's 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N.
fn analytic(stage: Option<Stage>, psi: f64, n: f64, half: bool) -> (f64, f64) {
    let (held, state) = if half { (2.0 * psi, 12.0 * psi) } else { (4.0 * psi, 8.0 * psi) };
    let (params, grads, opt) = match stage {
        None => (held, held, state),
        Some(Stage::One) => (held, held, state / n),
        Some(Stage::Two) => (held, held / n, state / n),
        Some(Stage::Three) => (held / n, held / n, state / n),
    };
    (params + grads + opt, params + opt)
}

/// AdamW on one rank (no ZeRO) in `dtype` (half precision holds the
/// parameters and gradients in it): Ψ and the memory with gradients and
/// after the second step.
fn adamw_memory<M: Module>(build: &(dyn Fn() -> M + Sync), input: &Input, dtype: DType) -> (usize, Mem) {
    let dev = Device::cpu();
    let cx = Cx::new(dev.clone()).with_dtype(dtype).with_seed(7);
    let mut cx = if dtype.is_half() { cx.with_half_params() } else { cx };
    let model = module::build(build(), &cx).unwrap();
    let mut opt = AdamW::new(&model, adamw()).unwrap();
    let psi = params_of(&model).iter().map(|(_, v)| v.len()).sum();
    let mut mem = Mem::default();
    for (step, lr) in LRS.into_iter().enumerate() {
        dev.reset_peak();
        let x = input(0..4, &dev);
        let x = if x.dtype().is_float() { x.to_dtype(dtype).unwrap() } else { x };
        let (y, saved) = model.forward(&mut cx, Act::new(x)).unwrap();
        let (_, dy) = mse(y.tensor(), 0..4, 4);
        drop(y);
        model.backward(&mut cx, saved, Act::new(dy)).unwrap();
        let with_grads = dev.memory_stats().in_use;
        opt.step(lr).unwrap();
        opt.zero_grad();
        if step == 1 {
            mem = Mem { with_grads, after_step: dev.memory_stats().in_use, peak: dev.memory_stats().peak, host: 0 };
        }
    }
    (psi, mem)
}

#[test]
fn per_rank_memory_matches_the_analytic_model_states() {
    // Hidden 64: Ψ = 49 984 elements (195 KiB of f32).
    let build = || GptBlock::new(64, 4).unwrap();
    let input = block_input(64, 4);
    let mut peaks = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let half = dtype.is_half();
        // Without ZeRO: AdamW on one rank holds everything, 16Ψ in both.
        let (psi, mem) = adamw_memory(&build, &input, dtype);
        let (with_grads, after_step) = analytic(None, psi as f64, 1.0, half);
        for (what, got, want) in [("with gradients", mem.with_grads, with_grads), ("after the step", mem.after_step, after_step)] {
            println!("{dtype} AdamW, {what}: measured {got} B, analytic {want:.0} B ({:+.2} %)", 100.0 * (got as f64 - want) / want);
            assert!((got as f64 - want).abs() <= 0.05 * want, "{dtype} AdamW, {what}: measured {got} bytes, analytic {want:.0}");
        }
        for n in [2, 4] {
            for stage in [Stage::One, Stage::Two, Stage::Three] {
                let outs = zero_run(stage, false, n, dtype, 64 << 10, &build, &input, 4);
                for (rank, o) in outs.iter().enumerate() {
                    let (with_grads, after_step) = analytic(Some(stage), o.psi as f64, n as f64, half);
                    for (what, got, want) in [("with gradients", o.mem.with_grads, with_grads), ("after the step", o.mem.after_step, after_step)] {
                        let err = (got as f64 - want).abs() / want;
                        println!(
                            "{dtype} stage {stage:?}, N = {n}, rank {rank}, {what}: measured {got} B, analytic {want:.0} B ({:+.2} %)",
                            100.0 * (got as f64 - want) / want
                        );
                        assert!(err <= 0.05, "{dtype} stage {stage:?}, N = {n}, rank {rank}, {what}: measured {got} bytes, analytic {want:.0}");
                    }
                }
                println!("{dtype} stage {stage:?}, N = {n}: peak during a step {} B", outs[0].mem.peak);
                if !half {
                    peaks.push((stage, n, outs[0].mem.peak, outs[0].psi));
                }
            }
        }
    }
    // Stage 3's peak holds its shards, the gathered layers in flight (the
    // running one and the prefetched next one, each as its gathered rows and
    // its parameters) and the activations; stage 1 holds full parameters and
    // gradients and, during the all-gather, the old and new parameters.
    for n in [2, 4] {
        let peak = |stage| peaks.iter().find(|p| p.0 == stage && p.1 == n).unwrap().2;
        assert!(peak(Stage::Three) < peak(Stage::One), "N = {n}: {peaks:?}");
    }
}

#[test]
fn adamw_skips_parameters_without_gradients_and_rejects_bad_hyper_parameters() {
    let cx = Cx::new(Device::cpu());
    let block = module::build(GptBlock::new(8, 2).unwrap(), &cx).unwrap();
    let bad = AdamWConfig { beta1: 1.0, ..AdamWConfig::default() };
    let err = AdamW::new(&block, bad).unwrap_err().to_string();
    assert!(err.contains("beta1") && err.contains("< 1"), "{err}");
    let mut opt = AdamW::new(&block, AdamWConfig::default()).unwrap();
    // Both moments of every parameter, in f32, on the parameters' device.
    let psi: usize = params_of(&block).iter().map(|(_, v)| v.len()).sum();
    assert_eq!(opt.state_bytes(), 8 * psi);
    let before = params_of(&block);
    opt.step(1e-2).unwrap();
    assert_eq!(params_of(&block), before, "no gradients: nothing moves");
    assert!(opt.step(f64::NAN).unwrap_err().to_string().contains("learning rate"));
}

#[test]
fn zero_reports_missing_gradients_and_empty_models() {
    let cx = Cx::new(Device::cpu());
    let block = module::build(GptBlock::new(8, 2).unwrap(), &cx).unwrap();
    let zero = Zero::new(&block, cx.groups().dp.clone(), ZeroConfig::new(Stage::Two)).unwrap();
    let err = zero.step(1e-3).unwrap_err().to_string();
    assert!(err.contains("has no gradient") && err.contains("backward"), "{err}");
    let err = Zero::new(&block, cx.groups().dp.clone(), ZeroConfig::new(Stage::One).with_bucket_bytes(0)).unwrap_err().to_string();
    assert!(err.contains("bucket size"), "{err}");
    let unbuilt = GptBlock::new(8, 2).unwrap();
    let err = Zero::new(&unbuilt, cx.groups().dp.clone(), ZeroConfig::new(Stage::Three)).unwrap_err().to_string();
    assert!(err.contains("materialise"), "{err}");
}

/// Every parameter's values of two runs, bit for bit.
fn assert_bitwise_equal(what: &str, got: &[RankOut], want: &[RankOut]) {
    for (rank, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.run.losses, w.run.losses, "{what} rank {rank}: losses");
        for ((name, a), (_, b)) in g.run.params.iter().zip(&w.run.params) {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{what} rank {rank}: `{name}` differs from the update made on the device");
        }
    }
}

#[test]
fn offloaded_updates_equal_the_device_update_bit_for_bit() {
    // Ψ = 510 over 4 ranks: a padded last shard and parameters straddling
    // shards; 256-byte buckets: several per step.
    let build = || GptBlock::new(6, 2).unwrap();
    let input = block_input(6, 3);
    let reference = single(&build, &input, 4);
    for stage in [Stage::One, Stage::Two, Stage::Three] {
        for dp in [1, 4] {
            let what = format!("{stage:?}, dp {dp}, offloaded");
            let outs = zero_run(stage, true, dp, DType::F64, 256, &build, &input, 4);
            check_equal(&what, &outs, &reference);
            assert_bitwise_equal(&what, &outs, &zero_run(stage, false, dp, DType::F64, 256, &build, &input, 4));
            let stats = outs[0].stats;
            assert!(stats.host_update > std::time::Duration::ZERO && stats.host_update_waited <= stats.host_update, "{what}: {stats:?}");
            match stage {
                // Each of the six layers gathered once per step after the first.
                Stage::One | Stage::Two => assert_eq!(stats.gathers, 2 * 6, "{what}: {stats:?}"),
                Stage::Three => assert_eq!((stats.gathers, stats.prefetched), (3 * 12, 2 * 11), "{what}: {stats:?}"),
            }
        }
    }
    // Half-precision parameters (the f32 master copy on the host), and a
    // tied embedding whose first use brings it back for both.
    let outs = |offload| zero_run(Stage::Two, offload, 2, DType::BF16, 256, &build, &input, 4);
    assert_bitwise_equal("bf16, stage 2", &outs(true), &outs(false));
    let (vocab, seq) = (11, 3);
    let gpt = || Gpt::new(vocab, 8, 2, 2).unwrap();
    let ids = move |rows: Range<usize>, dev: &Device| {
        let ids: Vec<u32> = (rows.start * seq..rows.end * seq).map(|i| (i * 7 % vocab) as u32).collect();
        Tensor::from_vec(ids, [rows.len(), seq], dev).unwrap()
    };
    let reference = single(&gpt, &ids, 4);
    for stage in [Stage::One, Stage::Three] {
        check_equal(&format!("GPT {stage:?}, offloaded"), &zero_run(stage, true, 2, DType::F64, 512, &gpt, &ids, 4), &reference);
    }
}

#[test]
fn offload_moves_the_optimizer_state_and_stage_three_shards_to_the_host() {
    // Hidden 64: Ψ = 49 984 elements.
    let build = || GptBlock::new(64, 4).unwrap();
    let input = block_input(64, 4);
    for dtype in [DType::F32, DType::BF16] {
        let held = if dtype.is_half() { 2.0 } else { 4.0 };
        for n in [1, 2] {
            for stage in [Stage::One, Stage::Two, Stage::Three] {
                let on = zero_run(stage, true, n, dtype, 64 << 10, &build, &input, 4);
                let off = zero_run(stage, false, n, dtype, 64 << 10, &build, &input, 4);
                let psi = on[0].psi as f64;
                let nf = n as f64;
                // On the device with the gradients averaged: the parameters
                // (none at stage 3 between uses) and the gradients.
                let want = match stage {
                    Stage::One => 2.0 * held * psi,
                    Stage::Two => held * psi + held * psi / nf,
                    Stage::Three => held * psi / nf,
                };
                for (rank, (a, b)) in on.iter().zip(&off).enumerate() {
                    let what = format!("{dtype} {stage:?}, N = {n}, rank {rank}");
                    let got = a.mem.with_grads as f64;
                    println!("{what}: device {got} B with offload, {} B without; host {} B", b.mem.with_grads, a.mem.host);
                    assert!((got - want).abs() <= 0.05 * want, "{what}: {got} bytes on the device, analytic {want:.0}");
                    // The host holds the master copy and both moments in
                    // f32, during the update the gradient shard copied over,
                    // and briefly the rows on their way to the device: the
                    // running gather's and (stage 3) the prefetched one's,
                    // each as its pieces and the joined row, at most the
                    // largest layer's (the 64 x 256 MLP weight and its
                    // bias). How many overlap the update depends on timing.
                    let host = (12.0 + held) * psi / nf;
                    let row = 2.0 * 2.0 * held * (64.0 * 256.0 + 256.0);
                    let got = a.mem.host as f64;
                    assert!(got >= host && got <= host + row, "{what}: {got} bytes on the host at most, analytic {host:.0} + {row:.0}");
                    assert!(a.mem.peak < b.mem.peak, "{what}: peak {} with offload, {} without", a.mem.peak, b.mem.peak);
                }
            }
        }
    }
}
