//! The primitive layers against central finite differences in f64: every
//! layer's input gradient and every parameter gradient, in each role on a
//! single rank; recompute paths against the plain ones, bit for bit, with
//! their activation memory; and gradient-readiness announcements.

mod common;
use common::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tessera::module::{call, call_backward, call_recompute, call_recompute_backward, materialize, Column, Hooks, Plain, Recompute, Role, Row, Visitor, Vocab};
use tessera::nn::{CausalAttention, Dropout, Embedding, LayerNorm, Linear, LinearSaved, Moe, NormState, RmsNorm, Stack};
use tessera::prelude::*;

/// A single-rank context computing in f64 with f64 master weights.
fn cx(dev: &Device) -> Cx {
    Cx::new(dev.clone()).with_dtype(DType::F64)
}

/// Gives every parameter uniform values in [-1, 1) (better conditioned than the initialisation).
fn randomize(params: &[Param], seed: u64) {
    for (i, p) in params.iter().enumerate() {
        let dev = p.value().unwrap().device().clone();
        p.set_value(rand_t(seed + 31 * i as u64, p.local_shape().dims(), &dev)).unwrap();
    }
}

fn set_values(params: &[Param], values: &[Tensor]) {
    for (p, v) in params.iter().zip(values) {
        p.set_value(v.clone()).unwrap();
    }
}

/// Every parameter of a layer used in role `R`, in visiting order.
fn params_of<R: Role, M: Module<R>>(m: &M) -> Vec<(String, Param, Option<usize>)> {
    let mut out = Vec::new();
    let mut f = |e: tessera::module::ParamEntry<'_>| {
        out.push((e.name.to_string(), e.param.clone(), e.split_dim));
        Ok(())
    };
    let mut v = Visitor::new(&mut f);
    v.child::<R>("layer", |v| <M as Module<R>>::visit_params(m, v)).unwrap();
    out
}

/// Runs `m` (in role `R`) forward and backward with upstream gradient `dy`;
/// returns the input gradient and each parameter's gradient.
fn run<R: Role, M: Module<R>>(m: &M, params: &[Param], c: &mut Cx, x: Tensor, dy: Tensor) -> tessera::Result<(Tensor, Vec<Tensor>)> {
    for p in params {
        p.take_grad();
    }
    let (_, saved) = <M as Module<R>>::forward(m, c, Act::new(x))?;
    let dx = <M as Module<R>>::backward(m, c, saved, Act::new(dy))?;
    let grads = params.iter().map(|p| p.grad().expect("every parameter receives a gradient")).collect();
    Ok((dx.into_tensor(), grads))
}

/// Checks the input gradient (when `with_x`) and every parameter gradient of
/// `m` in role `R` against finite differences of `<forward(x), dy>`;
/// `setup` prepares each fresh context.
#[track_caller]
fn check<R: Role, M: Module<R>>(name: &str, m: &M, params: &[Param], x: Tensor, with_x: bool, setup: impl Fn(&mut Cx)) {
    let dev = x.device().clone();
    let mut inputs = vec![x];
    inputs.extend(params.iter().map(|p| p.value().unwrap()));
    let wrt: Vec<usize> = (usize::from(!with_x)..inputs.len()).collect();
    let fresh = || {
        let mut c = cx(&dev);
        setup(&mut c);
        c
    };
    gradcheck(
        name,
        &inputs,
        &wrt,
        |xs| {
            set_values(params, &xs[1..]);
            Ok(<M as Module<R>>::forward(m, &mut fresh(), Act::new(xs[0].clone()))?.0.into_tensor())
        },
        |xs, dy| {
            set_values(params, &xs[1..]);
            let (dx, grads) = run::<R, M>(m, params, &mut fresh(), xs[0].clone(), dy.clone())?;
            Ok(if with_x { std::iter::once(dx).chain(grads).collect() } else { grads })
        },
    );
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_f64_vec().unwrap().iter().map(|v| v.to_bits()).collect()
}

fn in_use(dev: &Device) -> usize {
    dev.memory_stats().in_use
}

#[test]
fn linear_in_every_role() {
    let dev = cpu();
    let c = cx(&dev);
    for bias in [false, true] {
        let layer = Linear::new(5, 3, bias).unwrap();
        materialize(&layer, &c).unwrap();
        let params: Vec<Param> = std::iter::once(layer.weight().clone()).chain(layer.bias().cloned()).collect();
        randomize(&params, 1);
        let x = rand_t(2, &[2, 4, 5], &dev);
        check::<Plain, _>(&format!("linear plain bias={bias}"), &layer, &params, x.clone(), true, |_| {});
        check::<Column, _>(&format!("linear column bias={bias}"), &layer, &params, x.clone(), true, |_| {});
        check::<Row, _>(&format!("linear row bias={bias}"), &layer, &params, x.clone(), true, |_| {});
        check::<Vocab, _>(&format!("linear vocab bias={bias}"), &layer, &params, x, true, |_| {});
    }
    // rank 2 inputs too
    let layer = Linear::new(3, 2, true).unwrap();
    materialize(&layer, &c).unwrap();
    let params = vec![layer.weight().clone(), layer.bias().unwrap().clone()];
    randomize(&params, 3);
    check::<Plain, _>("linear 2-d", &layer, &params, rand_t(4, &[5, 3], &dev), true, |_| {});
}

#[test]
fn linear_sharding_and_errors() {
    let layer = Linear::new(6, 4, true).unwrap();
    assert_eq!(layer.weight().global_shape().dims(), &[4, 6]);
    let split = |entries: Vec<(String, Param, Option<usize>)>| entries.into_iter().map(|(n, _, s)| (n, s)).collect::<Vec<_>>();
    let named = |w: Option<usize>, b: Option<usize>| vec![("layer.weight".to_string(), w), ("layer.bias".to_string(), b)];
    assert_eq!(split(params_of::<Plain, _>(&layer)), named(None, None));
    assert_eq!(split(params_of::<Column, _>(&layer)), named(Some(0), Some(0)));
    assert_eq!(split(params_of::<Row, _>(&layer)), named(Some(1), None));
    assert_eq!(split(params_of::<Vocab, _>(&layer)), named(Some(0), Some(0)));

    let err = Linear::new(0, 4, false).unwrap_err().to_string();
    assert!(err.contains("in_features"), "{err}");
    let dev = cpu();
    let c = &mut cx(&dev);
    materialize(&layer, c).unwrap();
    let err = <Linear as Module>::forward(&layer, c, Act::new(rand_t(1, &[2, 5], &dev))).unwrap_err().to_string();
    assert!(err.contains("last dimension is 6"), "{err}");
    let mut head = Linear::new(3, 7, false).unwrap();
    let err = head.tie_weight(layer.weight()).unwrap_err().to_string();
    assert!(err.contains("equal shape"), "{err}");
}

#[test]
fn embedding_plain_and_vocab() {
    let dev = cpu();
    let c = cx(&dev);
    let emb = Embedding::new(7, 3).unwrap();
    materialize(&emb, &c).unwrap();
    let params = vec![emb.weight().clone()];
    randomize(&params, 5);
    // repeated ids accumulate
    let ids = Tensor::from_vec(vec![0u32, 6, 3, 3, 1, 6, 6, 2], [2, 4], &dev).unwrap();
    check::<Plain, _>("embedding plain", &emb, &params, ids.clone(), false, |_| {});
    check::<Vocab, _>("embedding vocab", &emb, &params, ids.clone(), false, |_| {});
    // the ids come back in the input-gradient position
    let (y, saved) = <Embedding as Module<Vocab>>::forward(&emb, &mut cx(&dev), Act::new(ids.clone())).unwrap();
    assert_eq!(y.tensor().dims(), &[2, 4, 3]);
    let back = <Embedding as Module<Vocab>>::backward(&emb, &mut cx(&dev), saved, Act::new(y.into_tensor())).unwrap();
    assert_eq!(back.tensor().to_vec::<u32>().unwrap(), ids.to_vec::<u32>().unwrap());
    assert_eq!(params_of::<Vocab, _>(&emb)[0].2, Some(0));

    // an output head tied to the table: [vocab, dim] both
    let mut head = Linear::new(3, 7, false).unwrap();
    head.tie_weight(emb.weight()).unwrap();
    assert!(head.weight().same(emb.weight()));
    assert!(Embedding::new(7, 0).is_err());
    let bad = Tensor::from_vec(vec![7u32], [1], &dev).unwrap();
    assert!(<Embedding as Module>::forward(&emb, &mut cx(&dev), Act::new(bad)).is_err());
}

#[test]
fn norms() {
    let dev = cpu();
    let c = cx(&dev);
    let x = rand_t(6, &[2, 3, 5], &dev);
    for bias in [false, true] {
        let ln = LayerNorm::new(5, 1e-5, bias).unwrap();
        materialize(&ln, &c).unwrap();
        let params: Vec<Param> = std::iter::once(ln.weight().clone()).chain(ln.bias().cloned()).collect();
        assert_eq!(params[0].value().unwrap().to_f64_vec().unwrap(), vec![1.0; 5]);
        randomize(&params, 7);
        check::<Plain, _>(&format!("layer_norm bias={bias}"), &ln, &params, x.clone(), true, |_| {});
    }
    let rms = RmsNorm::new(5, 1e-6).unwrap();
    materialize(&rms, &c).unwrap();
    let params = vec![rms.weight().clone()];
    randomize(&params, 8);
    check::<Plain, _>("rms_norm", &rms, &params, x, true, |_| {});
    assert!(LayerNorm::new(5, 0.0, true).is_err());
    assert!(RmsNorm::new(0, 1e-6).is_err());
}

#[test]
fn causal_attention_gqa() {
    let dev = cpu();
    // 4 query heads over 2 kv heads of 2 values: packed width (4 + 2·2)·2 = 16
    let x = rand_t(9, &[2, 4, 16], &dev);
    let plain = CausalAttention::new(4, 2, 2).unwrap();
    check::<Plain, _>("attention", &plain, &[], x.clone(), true, |_| {});
    let roped = CausalAttention::new(4, 2, 2).unwrap().with_rope(10_000.0, 16).unwrap();
    check::<Plain, _>("attention rope", &roped, &[], x.clone(), true, |_| {});
    check::<Plain, _>("attention rope selective", &roped, &[], x.clone(), true, |c| {
        c.set_selective_recompute(true);
    });

    // selective recompute: identical gradients, less kept between the passes
    let dy = rand_t(10, &[2, 4, 8], &dev);
    let pass = |selective: bool| {
        let c = &mut cx(&dev);
        c.set_selective_recompute(selective);
        let before = in_use(&dev);
        let (y, saved) = roped.forward(c, Act::new(x.clone())).unwrap();
        let held = in_use(&dev) - before;
        assert_eq!(saved.is_input_only(), selective);
        let bytes = saved.bytes();
        drop(y);
        let dx = roped.backward(c, saved, Act::new(dy.clone())).unwrap();
        (bits(dx.tensor()), held, bytes)
    };
    let (full_dx, full_held, full_bytes) = pass(false);
    let (sel_dx, sel_held, sel_bytes) = pass(true);
    assert_eq!(full_dx, sel_dx, "selective recompute changes the input gradient");
    assert!(sel_held < full_held, "selective keeps {sel_held} bytes, full {full_held}");
    assert_eq!(sel_bytes, 2 * 4 * 16 * 8);
    assert!(sel_bytes < full_bytes);

    let err = CausalAttention::new(4, 3, 2).unwrap_err().to_string();
    assert!(err.contains("multiple of kv_heads"), "{err}");
    assert!(CausalAttention::new(4, 2, 3).unwrap().with_rope(10_000.0, 16).is_err(), "odd head_dim cannot rotate");
    let err = plain.forward(&mut cx(&dev), Act::new(rand_t(1, &[2, 4, 12], &dev))).unwrap_err().to_string();
    assert!(err.contains("[batch, seq, 16]"), "{err}");
}

#[test]
fn dropout_training_and_eval() {
    let dev = cpu();
    let drop = Dropout::new(0.3).unwrap();
    let x = rand_t(11, &[2, 5, 3], &dev);
    check::<Plain, _>("dropout", &drop, &[], x.clone(), true, |_| {});
    // training: some dropped, the rest scaled; the backward applies the same mask
    let (y, saved) = drop.forward(&mut cx(&dev), Act::new(x.clone())).unwrap();
    let (xv, yv) = (x.to_f64_vec().unwrap(), y.tensor().to_f64_vec().unwrap());
    let zeros = yv.iter().filter(|v| **v == 0.0).count();
    assert!(zeros > 0 && zeros < yv.len());
    for (a, b) in xv.iter().zip(&yv) {
        assert!(*b == 0.0 || (b - a / 0.7).abs() < 1e-12);
    }
    let ones = Tensor::full(1.0, [2, 5, 3], DType::F64, &dev).unwrap();
    let dx = drop.backward(&mut cx(&dev), saved, Act::new(ones)).unwrap().tensor().to_f64_vec().unwrap();
    for (d, b) in dx.iter().zip(&yv) {
        assert_eq!(*d == 0.0, *b == 0.0);
    }
    // evaluation: the identity both ways
    let c = &mut cx(&dev);
    c.set_training(false);
    let (y, saved) = drop.forward(c, Act::new(x.clone())).unwrap();
    assert_eq!(bits(y.tensor()), bits(&x));
    let dy = rand_t(12, &[2, 5, 3], &dev);
    assert_eq!(bits(drop.backward(c, saved, Act::new(dy.clone())).unwrap().tensor()), bits(&dy));
    assert!(Dropout::new(1.0).is_err());
}

/// A test block whose saved state is larger than its input: norm, then projection.
struct Block {
    norm: RmsNorm,
    proj: Linear,
}

impl Module for Block {
    type In = Replicated;
    type Out = Replicated;
    type Saved = (NormState, LinearSaved);

    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> tessera::Result<(Act<Replicated>, Self::Saved)> {
        let (h, s1) = call::<Plain, _, _>(&self.norm, cx, "norm", x)?;
        let (y, s2) = call::<Plain, _, _>(&self.proj, cx, "proj", h)?;
        Ok((y, (s1, s2)))
    }

    fn backward(&self, cx: &mut Cx, saved: Self::Saved, dy: Act<Replicated>) -> tessera::Result<Act<Replicated>> {
        let dh = call_backward::<Plain, Linear>(&self.proj, cx, "proj", saved.1, dy)?;
        call_backward::<Plain, RmsNorm>(&self.norm, cx, "norm", saved.0, dh)
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> tessera::Result<()> {
        v.child::<Plain>("norm", |v| self.norm.visit_params(v))?;
        v.child::<Plain>("proj", |v| <Linear as Module>::visit_params(&self.proj, v))
    }
}

/// Input gradient, parameter gradients and bytes held between the passes,
/// for a plain call or one declaring full recompute on the stack.
fn stack_pass<M>(stack: &Stack<M>, params: &[Param], dev: &Device, x: &Tensor, dy: &Tensor, recompute: bool) -> (Vec<u64>, Vec<Vec<u64>>, usize)
where
    M: Module<Plain, In = Replicated, Out = Replicated>,
{
    for p in params {
        p.take_grad();
    }
    let c = &mut cx(dev);
    let before = in_use(dev);
    let (dx, held) = if recompute {
        let (y, kept) = call_recompute::<Plain, Stack<M>, Replicated>(stack, c, "blocks", Act::new(x.clone()), Recompute::Full).unwrap();
        drop(y);
        let held = in_use(dev) - before;
        (call_recompute_backward::<Plain, Stack<M>>(stack, c, "blocks", kept, Act::new(dy.clone())).unwrap(), held)
    } else {
        let (y, saved) = call::<Plain, Stack<M>, Replicated>(stack, c, "blocks", Act::new(x.clone())).unwrap();
        drop(y);
        let held = in_use(dev) - before;
        (call_backward::<Plain, Stack<M>>(stack, c, "blocks", saved, Act::new(dy.clone())).unwrap(), held)
    };
    let grads = params.iter().map(|p| bits(&p.grad().unwrap())).collect();
    (bits(dx.tensor()), grads, held)
}

#[test]
fn stack_of_linears() {
    let dev = cpu();
    let c = cx(&dev);
    let stack = Stack::from_fn(3, |_| Linear::new(4, 4, true)).unwrap();
    materialize(&stack, &c).unwrap();
    let entries = params_of::<Plain, _>(&stack);
    let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(names, ["layer.0.weight", "layer.0.bias", "layer.1.weight", "layer.1.bias", "layer.2.weight", "layer.2.bias"]);
    let params: Vec<Param> = entries.into_iter().map(|e| e.1).collect();
    randomize(&params, 13);
    let x = rand_t(14, &[2, 3, 4], &dev);
    check::<Plain, _>("stack", &stack, &params, x.clone(), true, |_| {});

    // per-layer recompute: the same bits, no more memory held
    let dy = rand_t(15, &[2, 3, 4], &dev);
    let plain = stack_pass(&stack, &params, &dev, &x, &dy, false);
    let recomputed = stack_pass(&stack, &params, &dev, &x, &dy, true);
    assert_eq!(plain.0, recomputed.0, "input gradient");
    assert_eq!(plain.1, recomputed.1, "parameter gradients");
    assert!(recomputed.2 <= plain.2, "recompute keeps {} bytes, plain {}", recomputed.2, plain.2);

    assert_eq!(stack.len(), 3);
    assert_eq!(stack.iter().count(), 3);
    assert_eq!(stack.layers().len(), 3);
    assert!(Stack::<Linear>::new(Vec::new()).is_err());
    assert!(Stack::from_fn(2, |i| Linear::new(4, 4 - i, false)).is_ok());
    assert!(Stack::from_fn(2, |i| Linear::new(4, i, false)).is_err());
}

#[test]
fn stack_recompute_per_layer_saves_memory() {
    let dev = cpu();
    let stack = Stack::from_fn(3, |_| Ok(Block { norm: RmsNorm::new(4, 1e-6)?, proj: Linear::new(4, 4, false)? })).unwrap();
    materialize(&stack, &cx(&dev)).unwrap();
    let params: Vec<Param> = params_of::<Plain, _>(&stack).into_iter().map(|e| e.1).collect();
    assert_eq!(params.len(), 6);
    randomize(&params, 16);
    let x = rand_t(17, &[2, 3, 4], &dev);
    let dy = rand_t(18, &[2, 3, 4], &dev);
    let plain = stack_pass(&stack, &params, &dev, &x, &dy, false);
    let recomputed = stack_pass(&stack, &params, &dev, &x, &dy, true);
    assert_eq!(plain.0, recomputed.0, "input gradient");
    assert_eq!(plain.1, recomputed.1, "parameter gradients");
    assert!(recomputed.2 < plain.2, "recompute keeps {} bytes, plain {}", recomputed.2, plain.2);
}

#[test]
fn stack_stage_ranges() {
    let stack = Stack::from_fn(10, |_| Dropout::new(0.0)).unwrap();
    let ranges: Vec<_> = (0..4).map(|s| stack.stage_range(s, 4)).collect();
    assert_eq!(ranges, [0..3, 3..6, 6..8, 8..10]);
    assert_eq!(stack.stage_range(0, 1), 0..10);
    assert_eq!(stack.stage_range(4, 4), 10..10);
    let few = Stack::from_fn(2, |_| Dropout::new(0.0)).unwrap();
    let ranges: Vec<_> = (0..3).map(|s| few.stage_range(s, 3)).collect();
    assert_eq!(ranges, [0..1, 1..2, 2..2]);
}

#[test]
fn mixture_of_experts() {
    let dev = cpu();
    let moe = Moe::new(4, 6, 4, 2).unwrap();
    materialize(&moe, &cx(&dev)).unwrap();
    let entries = params_of::<Plain, _>(&moe);
    let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(&names[..4], ["layer.router.weight", "layer.experts.0.gate.weight", "layer.experts.0.up.weight", "layer.experts.0.down.weight"]);
    assert_eq!(names.len(), 13);
    assert_eq!(entries[3].1.global_shape().dims(), &[4, 6]);
    let params: Vec<Param> = entries.into_iter().map(|e| e.1).collect();
    randomize(&params, 19);
    check::<Plain, _>("moe", &moe, &params, rand_t(20, &[2, 3, 4], &dev), true, |_| {});

    assert!(Moe::new(4, 6, 4, 5).is_err());
    assert!(Moe::new(4, 6, 0, 1).is_err());
    let err = moe.forward(&mut cx(&dev), Act::new(rand_t(1, &[2, 5], &dev))).unwrap_err().to_string();
    assert!(err.contains("[.., 4]"), "{err}");
}

/// Counts `grad_ready` announcements per parameter name.
#[derive(Default)]
struct Ready {
    calls: AtomicUsize,
    names: Mutex<Vec<String>>,
}

impl Hooks for Ready {
    fn grad_ready(&self, p: &Param) -> tessera::Result<()> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.names.lock().unwrap().push(p.name().unwrap_or_default());
        Ok(())
    }
}

#[test]
fn gradients_announced_once_final() {
    let dev = cpu();
    // a tied embedding and output head: the shared table is final after both uses
    let ready = Arc::new(Ready::default());
    let c = &mut cx(&dev).with_hooks(ready.clone());
    let emb = Embedding::new(7, 3).unwrap();
    let mut head = Linear::new(3, 7, true).unwrap();
    head.tie_weight(emb.weight()).unwrap();
    materialize(&emb, c).unwrap();
    materialize(&head, c).unwrap();
    let ids = Tensor::from_vec(vec![1u32, 4, 6, 0], [2, 2], &dev).unwrap();
    let (h, s_emb) = call::<Plain, Embedding, Replicated>(&emb, c, "tok", Act::new(ids)).unwrap();
    let (logits, s_head) = call::<Plain, Linear, _>(&head, c, "head", h).unwrap();
    let dy = rand_t(21, logits.tensor().dims(), &dev);
    let dh = call_backward::<Plain, Linear>(&head, c, "head", s_head, Act::new(dy)).unwrap();
    assert_eq!(*ready.names.lock().unwrap(), ["bias"], "the tied table is not final after one of its two uses");
    call_backward::<Plain, Embedding>(&emb, c, "tok", s_emb, dh).unwrap();
    assert_eq!(*ready.names.lock().unwrap(), ["bias", "weight"]);

    // a stack recomputing per layer: recomputed forwards do not count uses again
    let ready = Arc::new(Ready::default());
    let c = &mut cx(&dev).with_hooks(ready.clone());
    let stack = Stack::from_fn(3, |_| Linear::new(4, 4, false)).unwrap();
    materialize(&stack, c).unwrap();
    let x = rand_t(22, &[2, 4], &dev);
    let (y, kept) = call_recompute::<Plain, Stack<Linear>, Replicated>(&stack, c, "blocks", Act::new(x), Recompute::Full).unwrap();
    call_recompute_backward::<Plain, Stack<Linear>>(&stack, c, "blocks", kept, y).unwrap();
    assert_eq!(ready.calls.load(Ordering::SeqCst), 3);

    // a mixture of experts: every parameter once, unused experts included
    let ready = Arc::new(Ready::default());
    let c = &mut cx(&dev).with_hooks(ready.clone());
    let moe = Moe::new(4, 6, 4, 1).unwrap();
    materialize(&moe, c).unwrap();
    let x = rand_t(23, &[1, 2, 4], &dev);
    let (y, saved) = moe.forward(c, Act::new(x)).unwrap();
    moe.backward(c, saved, y).unwrap();
    assert_eq!(ready.calls.load(Ordering::SeqCst), 13);
    let mut names = ready.names.lock().unwrap().clone();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 13);
}
