//! Models written with the DSL: the generated backward against f64 finite
//! differences, recompute against no recompute (bits and measured memory),
//! the parameter visitor's names, and gradient-ready announcements.

mod common;
use common::models::*;
use common::*;
use std::sync::{Arc, Mutex};
use tessera::module::{self, Cx, Hooks, Param, RecomputeOverride};
use tessera::nn::{Embedding, LayerNorm, Linear, Moe, RmsNorm, Stack};
use tessera::prelude::*;
use tessera::Result;

/// A stack of blocks whose layers recompute (fully, or selectively).
#[derive(Module)]
pub struct FullRecompute {
    #[recompute]
    blocks: Stack<GptBlock>,
}

#[forward]
impl FullRecompute {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.blocks(x)
    }
}

#[derive(Module)]
pub struct SelectiveRecompute {
    #[recompute(selective)]
    blocks: Stack<GptBlock>,
}

#[forward]
impl SelectiveRecompute {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.blocks(x)
    }
}

fn f64_cx() -> Cx {
    Cx::new(Device::cpu()).with_dtype(DType::F64).with_seed(3)
}

/// Distinct parameters of a model with their names (a tied weight once).
fn params<M: Module>(m: &M) -> Vec<(String, Param)> {
    let mut out: Vec<(String, Param)> = Vec::new();
    module::visit_params(m, |e| {
        if !out.iter().any(|(_, p)| p.same(e.param)) {
            out.push((e.name.to_string(), e.param.clone()));
        }
        Ok(())
    })
    .unwrap();
    out
}

/// The generated backward of `model` against central finite differences in
/// f64: every parameter (up to `per_param` elements each, spread over the
/// tensor) and, for float inputs, the input.
fn model_gradcheck<M: Module<In = Replicated>>(name: &str, model: &M, cx: &mut Cx, x: &Tensor, per_param: usize) {
    let (y, saved) = model.forward(cx, Act::new(x.clone())).unwrap();
    let dy_vals = rand_vec(77, y.tensor().elem_count());
    let dy = Tensor::from_vec(dy_vals.clone(), y.tensor().shape().clone(), cx.device()).unwrap();
    let dx = model.backward(cx, saved, Act::new(dy)).unwrap();
    let ps = params(model);
    let grads: Vec<Tensor> = ps.iter().map(|(n, p)| p.take_grad().unwrap_or_else(|| panic!("{name}: no gradient for {n}"))).collect();
    cx.set_training(false);
    let objective = |cx: &mut Cx, x: &Tensor| -> f64 {
        let (y, _) = model.forward(cx, Act::new(x.clone())).unwrap();
        y.tensor().to_f64_vec().unwrap().iter().zip(&dy_vals).map(|(a, b)| a * b).sum()
    };
    let eps = 1e-6;
    for ((pname, p), g) in ps.iter().zip(&grads) {
        let base = p.value().unwrap().to_f64_vec().unwrap();
        let shape = p.value().unwrap().shape().clone();
        let g = g.to_f64_vec().unwrap();
        let step = (base.len() / per_param).max(1);
        for j in (0..base.len()).step_by(step) {
            let mut eval = |delta: f64| {
                let mut v = base.clone();
                v[j] += delta;
                p.set_value(Tensor::from_vec(v, shape.clone(), cx.device()).unwrap()).unwrap();
                objective(cx, x)
            };
            let numeric = (eval(eps) - eval(-eps)) / (2.0 * eps);
            assert_close(&[g[j]], &[numeric], 1e-6, 1e-5, &format!("{name}: d/d {pname}[{j}]"));
        }
        p.set_value(Tensor::from_vec(base, shape, cx.device()).unwrap()).unwrap();
    }
    if x.dtype().is_float() {
        let base = x.to_f64_vec().unwrap();
        let g = dx.tensor().to_f64_vec().unwrap();
        for j in 0..base.len() {
            let mut eval = |delta: f64| {
                let mut v = base.clone();
                v[j] += delta;
                objective(cx, &Tensor::from_vec(v, x.shape().clone(), cx.device()).unwrap())
            };
            let numeric = (eval(eps) - eval(-eps)) / (2.0 * eps);
            assert_close(&[g[j]], &[numeric], 1e-6, 1e-5, &format!("{name}: d/d input[{j}]"));
        }
    }
    cx.set_training(true);
}

#[test]
fn gpt_block_backward_matches_finite_differences() {
    let mut cx = f64_cx();
    let block = module::build(GptBlock::new(8, 2).unwrap(), &cx).unwrap();
    let x = rand_t(1, &[2, 3, 8], cx.device());
    model_gradcheck("gpt block", &block, &mut cx, &x, 24);
}

#[test]
fn llama_block_backward_matches_finite_differences() {
    let mut cx = f64_cx();
    let block = module::build(LlamaBlock::new(8, 4, 2, 12).unwrap(), &cx).unwrap();
    let x = rand_t(2, &[2, 3, 8], cx.device());
    model_gradcheck("llama block", &block, &mut cx, &x, 24);
}

#[test]
fn moe_block_backward_matches_finite_differences() {
    let mut cx = f64_cx();
    let block = MoeBlock { norm: RmsNorm::new(6, 1e-6).unwrap(), moe: Moe::new(6, 8, 4, 2).unwrap() };
    let block = module::build(block, &cx).unwrap();
    let x = rand_t(3, &[2, 3, 6], cx.device());
    model_gradcheck("moe block", &block, &mut cx, &x, 24);
}

#[test]
fn small_gpt_backward_matches_finite_differences() {
    let mut cx = f64_cx();
    let gpt = module::build(Gpt::new(11, 8, 2, 2).unwrap(), &cx).unwrap();
    assert!(gpt.head.weight().same(gpt.tok.weight()), "the head is tied to the token embedding");
    let ids = Tensor::from_vec(vec![1u32, 5, 10, 0, 3, 3], [2, 3], cx.device()).unwrap();
    model_gradcheck("small gpt", &gpt, &mut cx, &ids, 16);
}

#[test]
fn parameter_names_are_stable_dotted_paths() {
    let cx = f64_cx();
    let gpt = module::build(Gpt::new(11, 8, 2, 2).unwrap(), &cx).unwrap();
    let mut names = Vec::new();
    module::visit_params(&gpt, |e| {
        names.push(format!("{} {} {:?}", e.name, e.param.global_shape(), e.role));
        Ok(())
    })
    .unwrap();
    assert_eq!(names[0], "tok.weight [11, 8] Vocab");
    assert!(names.contains(&"blocks.1.qkv.weight [24, 8] Column".to_string()), "{names:?}");
    assert!(names.contains(&"blocks.0.down.bias [8] Row".to_string()), "{names:?}");
    assert_eq!(names.last().unwrap(), "head.weight [11, 8] Vocab");
}

/// Counts each parameter's gradient-ready announcements.
#[derive(Default)]
struct ReadyLog(Mutex<Vec<String>>);
impl Hooks for ReadyLog {
    fn grad_ready(&self, p: &Param) -> Result<()> {
        self.0.lock().unwrap().push(p.name().unwrap_or_default());
        Ok(())
    }
}

#[test]
fn each_gradient_is_announced_once_when_final() {
    let log = Arc::new(ReadyLog::default());
    let mut cx = f64_cx().with_hooks(log.clone());
    let gpt = module::build(Gpt::new(11, 8, 2, 2).unwrap(), &cx).unwrap();
    let ids = Tensor::from_vec(vec![1u32, 5, 10, 0], [1, 4], cx.device()).unwrap();
    let (y, saved) = gpt.forward(&mut cx, Act::new(ids)).unwrap();
    let dy = Act::new(y.tensor().zeros_like().unwrap());
    gpt.backward(&mut cx, saved, dy).unwrap();
    let mut got = log.0.lock().unwrap().clone();
    let n = got.len();
    got.sort();
    got.dedup();
    assert_eq!(n, got.len(), "a parameter was announced twice");
    assert_eq!(n, params(&gpt).len(), "every parameter is announced");
    // The tied weight is used first by `tok` and last by `head`: it is final
    // only after the embedding's backward, which runs last.
    assert_eq!(log.0.lock().unwrap().last().unwrap(), "tok.weight");
}

/// Runs forward and backward; returns the bytes held between them and every gradient's bits.
fn held_and_grads<M: Module<In = Replicated>>(model: &M, cx: &mut Cx, x: &Tensor) -> (usize, Vec<u64>) {
    let dev = cx.device().clone();
    let before = dev.memory_stats().in_use;
    let (y, saved) = model.forward(cx, Act::new(x.clone())).unwrap();
    let held = dev.memory_stats().in_use - before;
    let dy = Act::new(y.tensor().clone());
    drop(y);
    model.backward(cx, saved, dy).unwrap();
    let bits = params(model).iter().flat_map(|(_, p)| p.take_grad().unwrap().to_f64_vec().unwrap().into_iter().map(f64::to_bits)).collect();
    (held, bits)
}

#[test]
fn recompute_gives_identical_gradients_and_holds_less() {
    let layers = 3;
    let (b, t, d) = (2, 16, 8);
    let mut cx = Cx::new(Device::cpu()).with_seed(5);
    let x = rand_t(9, &[b, t, d], cx.device()).to_dtype(DType::F32).unwrap();
    let act = b * t * d * 4;

    let full = module::build(FullRecompute { blocks: Stack::from_fn(layers, |_| GptBlock::new(d, 2)).unwrap() }, &cx).unwrap();
    let (held_full, bits_full) = held_and_grads(&full, &mut cx, &x);
    cx.set_recompute_override(RecomputeOverride::Off);
    let (held_none, bits_none) = held_and_grads(&full, &mut cx, &x);
    cx.set_recompute_override(RecomputeOverride::AsDeclared);
    assert_eq!(bits_full, bits_none, "full recompute changes no gradient bit");
    // Only the block inputs are held (layer 0's input is the caller's `x`,
    // allocated before), plus the output itself.
    assert_eq!(held_full, (layers - 1) * act + act, "full recompute holds only block inputs");
    assert!(held_none > 4 * held_full, "no recompute holds far more: {held_none} vs {held_full}");

    let sel = SelectiveRecompute { blocks: Stack::from_fn(layers, |_| GptBlock::new(d, 2)).unwrap() };
    let sel = module::build(sel, &cx).unwrap();
    let (held_sel, bits_sel) = held_and_grads(&sel, &mut cx, &x);
    assert_eq!(bits_sel, bits_none, "selective recompute changes no gradient bit (same init as the full model)");
    // Selective keeps the attention's packed input (q|k|v, 3 activations) instead
    // of its core. Without RoPE the core is that same input (the kernel reads
    // q, k and v in place), the output (which the output projection holds as
    // its input anyway) and one lse per query and head: the lse is all that
    // selective recompute drops.
    let lse = b * 2 * t * 4;
    assert_eq!(held_none - held_sel, layers * lse, "selective recompute drops exactly the attention core");

    // Nothing of size T×T is held in either mode: doubling the sequence
    // exactly doubles the bytes held between forward and backward.
    let x2 = rand_t(9, &[b, 2 * t, d], cx.device()).to_dtype(DType::F32).unwrap();
    let (held_sel2, _) = held_and_grads(&sel, &mut cx, &x2);
    assert_eq!(held_sel2, 2 * held_sel, "selective: held bytes grow linearly in T");
    cx.set_recompute_override(RecomputeOverride::Off);
    let (held_none2, _) = held_and_grads(&sel, &mut cx, &x2);
    assert_eq!(held_none2, 2 * held_none, "no recompute: held bytes grow linearly in T");
}

/// A group that only reports its size: enough for the checks that run
/// before anything is allocated.
#[derive(Debug)]
struct SizeOnly(usize);
impl tessera::dist::Communicator for SizeOnly {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        self.0
    }
    fn all_reduce_sum(&self, _: &Tensor) -> Result<Tensor> {
        unimplemented!("not used by materialize")
    }
    fn all_gather(&self, _: &Tensor, _: usize) -> Result<Tensor> {
        unimplemented!("not used by materialize")
    }
    fn reduce_scatter_sum(&self, _: &Tensor, _: usize) -> Result<Tensor> {
        unimplemented!("not used by materialize")
    }
    fn broadcast(&self, _: &Tensor, _: usize) -> Result<Tensor> {
        unimplemented!("not used by materialize")
    }
    fn all_to_all(&self, _: Vec<Tensor>) -> Result<Vec<Tensor>> {
        unimplemented!("not used by materialize")
    }
    fn barrier(&self) -> Result<()> {
        unimplemented!("not used by materialize")
    }
}

#[test]
fn degrees_that_do_not_divide_are_refused_before_allocation() {
    let mut groups = module::Groups::single();
    groups.tp = Arc::new(SizeOnly(2));
    let dev = Device::cpu();
    let cx = Cx::new(dev.clone()).with_groups(groups);
    // vocabulary 11 and 3 heads do not split over 2 ranks
    let Err(err) = module::build(Gpt::new(11, 6, 3, 2).unwrap(), &cx) else { panic!("a vocabulary of 11 split over 2 ranks was accepted") };
    let err = err.to_string();
    assert!(err.contains("`tok.weight`") && err.contains("size 11"), "{err}");
    assert!(err.contains("`blocks.0.attn`") && err.contains("3 query heads"), "{err}");
    assert!(err.contains("choose a tensor-parallel degree"), "{err}");
    assert_eq!(dev.memory_stats().allocations, 0, "nothing was allocated");
}

#[derive(Module)]
#[model(tp = 2, dims(vocab = 12, hidden = 8, heads = 2))]
pub struct StaticGpt {
    #[shard(vocab)]
    tok: Embedding,
    blocks: Stack<GptBlock>,
    #[shard(vocab)]
    #[tied(tok)]
    head: Linear,
}

#[forward]
impl StaticGpt {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        self.head(self.blocks(all_reduce(self.tok(ids))))
    }
}

#[test]
fn static_dimensions_become_constants() {
    assert_eq!((StaticGpt::TP, StaticGpt::VOCAB, StaticGpt::HIDDEN, StaticGpt::HEADS), (2, 12, 8, 2));
    let m = StaticGpt {
        tok: Embedding::new(StaticGpt::VOCAB, StaticGpt::HIDDEN).unwrap(),
        blocks: Stack::from_fn(1, |_| GptBlock::new(StaticGpt::HIDDEN, StaticGpt::HEADS)).unwrap(),
        head: Linear::new(StaticGpt::HIDDEN, StaticGpt::VOCAB, false).unwrap(),
    };
    let mut groups = module::Groups::single();
    groups.tp = Arc::new(SizeOnly(StaticGpt::TP));
    assert!(module::build(m, &Cx::new(Device::cpu()).with_groups(groups)).is_ok());
}

/// Runs `gpt` as a pipeline of `stages` stages in one process, passing each
/// stage's output on; returns the output bits and the gradient bits.
fn pipelined(gpt: &Gpt, cx: &mut Cx, ids: &Tensor, stages: usize) -> (Vec<u64>, Vec<u64>) {
    let n = gpt.split_layers();
    let ranges: Vec<_> = (0..stages).map(|s| gpt.blocks.stage_range(s, stages)).collect();
    let (h, first) = gpt.forward_first(cx, Act::new(ids.clone())).unwrap();
    let mut h = h;
    let mut saved = Vec::new();
    for r in &ranges {
        let (y, s) = gpt.forward_split(cx, r.clone(), h).unwrap();
        saved.push(s);
        h = y;
    }
    assert_eq!(ranges.last().unwrap().end, n);
    let (y, last) = gpt.forward_last(cx, h).unwrap();
    let out = y.tensor().to_f64_vec().unwrap().into_iter().map(f64::to_bits).collect();
    let mut g = gpt.backward_last(cx, last, Act::new(y.tensor().clone())).unwrap();
    for (r, s) in ranges.iter().zip(saved).rev() {
        g = gpt.backward_split(cx, r.clone(), s, g).unwrap();
    }
    gpt.backward_first(cx, first, g).unwrap();
    let grads = params(gpt).iter().flat_map(|(_, p)| p.take_grad().unwrap().to_f64_vec().unwrap().into_iter().map(f64::to_bits)).collect();
    (out, grads)
}

#[test]
fn stage_entry_points_compose_to_the_whole_model() {
    let mut cx = Cx::new(Device::cpu()).with_seed(1);
    let gpt = module::build(Gpt::new(11, 8, 2, 3).unwrap(), &cx).unwrap();
    let ids = Tensor::from_vec(vec![1u32, 5, 10, 0, 3, 3, 7, 2], [2, 4], cx.device()).unwrap();
    let (y, saved) = gpt.forward(&mut cx, Act::new(ids.clone())).unwrap();
    let out: Vec<u64> = y.tensor().to_f64_vec().unwrap().into_iter().map(f64::to_bits).collect();
    gpt.backward(&mut cx, saved, Act::new(y.tensor().clone())).unwrap();
    let grads: Vec<u64> = params(&gpt).iter().flat_map(|(_, p)| p.take_grad().unwrap().to_f64_vec().unwrap().into_iter().map(f64::to_bits)).collect();
    for stages in [1, 2, 3] {
        let (o, g) = pipelined(&gpt, &mut cx, &ids, stages);
        assert_eq!(o, out, "{stages} stages: outputs differ");
        assert_eq!(g, grads, "{stages} stages: gradients differ");
    }
}

#[test]
fn a_forward_without_backward_does_not_hold_back_the_next_step() {
    let log = Arc::new(ReadyLog::default());
    let mut cx = f64_cx().with_hooks(log.clone());
    let block = module::build(GptBlock::new(8, 2).unwrap(), &cx).unwrap();
    let x = rand_t(4, &[1, 3, 8], cx.device());
    // an evaluation left in training mode: uses are counted, no backward follows
    let _ = block.forward(&mut cx, Act::new(x.clone())).unwrap();
    module::zero_grad(&block).unwrap();
    let (y, saved) = block.forward(&mut cx, Act::new(x)).unwrap();
    block.backward(&mut cx, saved, Act::new(y.tensor().clone())).unwrap();
    assert_eq!(log.0.lock().unwrap().len(), params(&block).len(), "every gradient announced after zero_grad");
}

#[derive(Module)]
#[model(precision = bf16)]
pub struct Bf16Gpt {
    #[shard(vocab)]
    tok: Embedding,
    blocks: Stack<GptBlock>,
    #[precision(f32)]
    norm: LayerNorm,
    #[shard(vocab)]
    #[tied(tok)]
    head: Linear,
}

#[forward]
impl Bf16Gpt {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        let h = all_reduce(self.tok(ids));
        self.head(self.norm(self.blocks(h)))
    }
}

#[test]
fn bf16_model_keeps_f32_master_weights_and_gradients() {
    let (vocab, d) = (16, 16);
    let mut cx = Cx::new(Device::cpu()).with_seed(2);
    let f32_model = module::build(Gpt::new(vocab, d, 2, 2).unwrap(), &cx).unwrap();
    let bf16_model = Bf16Gpt {
        tok: Embedding::new(vocab, d).unwrap(),
        blocks: Stack::from_fn(2, |_| GptBlock::new(d, 2)).unwrap(),
        norm: LayerNorm::new(d, 1e-5, true).unwrap(),
        head: Linear::new(d, vocab, false).unwrap(),
    };
    let bf16_model = module::build(bf16_model, &cx).unwrap();
    let ids = Tensor::from_vec((0..32u32).map(|i| (i * 7) % vocab as u32).collect::<Vec<_>>(), [2, 16], cx.device()).unwrap();
    let targets = Tensor::from_vec((0..32u32).map(|i| (i * 5 + 1) % vocab as u32).collect::<Vec<_>>(), [2, 16], cx.device()).unwrap();

    let (loss32, held32, dt32) = train_step(&f32_model, &mut cx, &ids, &targets);
    let (loss16, held16, dt16) = train_step(&bf16_model, &mut cx, &ids, &targets);
    assert_eq!((dt32, dt16), (DType::F32, DType::F32), "the model's output leaves the bf16 region as f32");
    assert!((loss32 - loss16).abs() < 0.05 * loss32.abs(), "bf16 loss {loss16} vs f32 {loss32}");
    assert!(held16 * 10 < held32 * 7, "bf16 activations hold less: {held16} vs {held32}");
    for (name, p) in params(&bf16_model) {
        assert_eq!(p.value().unwrap().dtype(), DType::F32, "{name}: master weight");
        assert_eq!(p.grad().unwrap().dtype(), DType::F32, "{name}: gradient");
    }
}

/// The description of a model with precision regions (bf16 for the whole
/// model, f32 for its final norm) keeps and computes what the forward does:
/// the casts at each border are buffers too.
#[test]
fn a_model_with_precision_regions_describes_what_it_keeps() {
    let (vocab, d, seq) = (16, 16, 8);
    let mut cx = Cx::new(Device::cpu()).with_seed(2);
    let model = Bf16Gpt {
        tok: Embedding::new(vocab, d).unwrap(),
        blocks: Stack::from_fn(2, |_| GptBlock::new(d, 2)).unwrap(),
        norm: LayerNorm::new(d, 1e-5, true).unwrap(),
        head: Linear::new(d, vocab, false).unwrap(),
    };
    let model = module::build(model, &cx).unwrap();
    let cost = module::describe(&model, module::CostSettings::single(seq)).unwrap();
    let ids = Tensor::from_vec((0..2 * seq as u32).map(|i| (i * 7) % vocab as u32).collect::<Vec<_>>(), [2, seq], cx.device()).unwrap();
    let tokens = (2 * seq) as f64;
    let dev = cx.device().clone();
    let (f0, m0) = (tessera::ops::flops_counted(), dev.memory_stats().in_use);
    let (y, saved) = model.forward(&mut cx, Act::new(ids.clone())).unwrap();
    let (f1, m1) = (tessera::ops::flops_counted(), dev.memory_stats().in_use);
    let out = y.tensor().elem_count() * y.tensor().dtype().size_in_bytes();
    let kept = (m1 - m0 - out + 4 * ids.elem_count()) as f64;
    assert_eq!(kept, cost.saved_bytes() * tokens, "kept bytes");
    assert_eq!(f1 - f0, cost.forward_flops() * tokens, "forward flops");
    assert_eq!(cost.output_bytes * tokens, out as f64, "the output leaves the region as f32");
    model.backward(&mut cx, saved, Act::new(y.tensor().clone())).unwrap();
    assert_eq!(tessera::ops::flops_counted() - f1, cost.backward_flops() * tokens, "backward flops");
}

/// One forward and backward with a cross-entropy loss: the loss, the bytes
/// held between forward and backward, and the dtype of the logits.
fn train_step<M: Module<In = Replicated, Out = SplitHidden>>(m: &M, cx: &mut Cx, ids: &Tensor, targets: &Tensor) -> (f64, usize, DType) {
    let dev = cx.device().clone();
    let before = dev.memory_stats().in_use;
    let (logits, saved) = m.forward(cx, Act::new(ids.clone())).unwrap();
    let held = dev.memory_stats().in_use - before;
    let logits = logits.into_tensor();
    let (loss, ce) = tessera::ops::cross_entropy(&logits, targets, None).unwrap();
    let dlogits = tessera::ops::cross_entropy_backward(&logits, targets, None, &ce, 1.0).unwrap();
    m.backward(cx, saved, Act::new(dlogits)).unwrap();
    (loss.to_scalar().unwrap(), held, logits.dtype())
}

/// A model whose tensor-parallel degree and hidden size are fixed in its type.
#[derive(Module)]
#[model(tp = 2, dims(hidden = 8, inner = 16))]
pub struct StaticMlp {
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl StaticMlp {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + all_reduce(self.down(gelu(self.up(x))))
    }
}

fn static_mlp() -> StaticMlp {
    StaticMlp { up: Linear::new(StaticMlp::HIDDEN, StaticMlp::INNER, true).unwrap(), down: Linear::new(StaticMlp::INNER, StaticMlp::HIDDEN, true).unwrap() }
}

/// Builds `make()` on every rank of a tensor-parallel group of `tp`; the first error.
fn build_on<M: Module>(tp: usize, make: impl Fn() -> M + Sync) -> Option<String> {
    use tessera::dist::inproc::InProcess;
    let world = InProcess::new(tp).unwrap();
    let errors: Vec<Option<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..tp)
            .map(|rank| {
                let (world, make) = (&world, &make);
                s.spawn(move || {
                    let dev = Device::cpu();
                    let mut groups = module::Groups::single();
                    groups.tp = Arc::new(world.communicator(rank, &dev).unwrap());
                    module::build(make(), &Cx::new(dev).with_groups(groups)).err().map(|e| e.to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    errors.into_iter().flatten().next()
}

#[test]
fn a_static_degree_is_checked_against_the_real_group_at_build() {
    assert_eq!(build_on(2, static_mlp), None);
    for tp in [1, 4] {
        let err = build_on(tp, static_mlp).expect("the wrong degree is refused");
        assert!(err.contains(&format!("declares `#[model(tp = 2)]` but is built for a tensor-parallel group of {tp}")), "{err}");
    }
}

/// An embedding and a head tied though their shapes differ (the head's
/// vocabulary is 12, the table's 16): only known when the model is built.
#[derive(Module)]
pub struct MistiedLm {
    tok: Embedding,
    #[tied(tok)]
    head: Linear,
}

#[forward]
impl MistiedLm {
    fn forward(&self, ids: Act<Replicated>) -> Act<Replicated> {
        self.head(self.tok(ids))
    }
}

#[test]
fn tied_weights_of_different_shapes_are_refused_naming_both_fields() {
    let model = MistiedLm { tok: Embedding::new(16, 8).unwrap(), head: Linear::new(8, 12, false).unwrap() };
    let err = module::build(model, &f64_cx()).err().expect("a mistied model is refused").to_string();
    assert!(err.contains("`MistiedLm.head` is `#[tied(tok)]` to `MistiedLm.tok`"), "{err}");
    assert!(err.contains("[16, 8]") && err.contains("[12, 8]"), "{err}");
}
