//! The cost description `#[derive(Module)]` generates (`Module::describe`)
//! against what runs: the matrix FLOPs the ops count, the bytes the device
//! tracker holds between forward and backward, and every collective the
//! communicators see, for GPT-2, Llama and Mixtral on one rank, two
//! tensor-parallel ranks with and without sequence parallelism, and two
//! expert-parallel ranks, under each recompute policy. At full size, the
//! totals are checked against counts made by hand.

use std::sync::{Arc, Mutex};
use tessera::dist::inproc::InProcess;
use tessera::dist::{Communicator, Groups};
use tessera::module::{self, describe, Act, CollectiveCost, CollectiveKind, CostSettings, Cx, ModelCost, Module, RecomputeOverride, Replicated, SplitHidden};
use tessera::{ops, DType, Device, Result, Tensor};
use tessera_models::gpt2::{Gpt2, Gpt2Config};
use tessera_models::llama::{Llama, LlamaConfig};
use tessera_models::mixtral::{Mixtral, MixtralConfig};

/// A communicator that records each collective's kind and buffer bytes (see
/// `module::describe`: an all-gather's output, a reduce-scatter's input,
/// the rows an all-to-all sends).
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn Communicator>,
    log: Mutex<Vec<(CollectiveKind, f64)>>,
}

impl Counting {
    fn new(inner: Arc<dyn Communicator>) -> Arc<Counting> {
        Arc::new(Counting { inner, log: Mutex::new(Vec::new()) })
    }

    /// Notes a collective; on one rank a collective moves nothing.
    fn note(&self, kind: CollectiveKind, bytes: usize) {
        if self.inner.size() == 1 {
            return;
        }
        self.log.lock().unwrap().push((kind, bytes as f64));
    }

    fn take(&self) -> Vec<(CollectiveKind, f64)> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

fn bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

impl Communicator for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.note(CollectiveKind::AllReduce, bytes(t));
        self.inner.all_reduce_sum(t)
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.note(CollectiveKind::AllGather, bytes(t) * self.size());
        self.inner.all_gather(t, dim)
    }
    fn reduce_scatter_sum(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.note(CollectiveKind::ReduceScatter, bytes(t));
        self.inner.reduce_scatter_sum(t, dim)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.inner.broadcast(t, root)
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.note(CollectiveKind::AllToAll, parts.iter().map(bytes).sum());
        self.inner.all_to_all(parts)
    }
    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }
    /// A point-to-point send: one hop of ring attention's keys and values.
    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        self.note(CollectiveKind::Ring, bytes(t));
        self.inner.send(t, peer)
    }
    fn recv(&self, peer: usize) -> Result<Tensor> {
        self.inner.recv(peer)
    }
}

/// What one rank measured over a forward and a backward.
#[derive(Debug, Default)]
struct Measured {
    forward_flops: f64,
    backward_flops: f64,
    saved_bytes: f64,
    collectives: Vec<(CollectiveKind, f64)>,
}

/// Runs `model` forward and backward on `ids` in `cx`, measuring.
fn measure<M: Module<In = Replicated, Out = SplitHidden>>(model: &M, cx: &mut Cx, ids: &Tensor, comms: &[&Counting]) -> Measured {
    let dev = cx.device().clone();
    let (f0, m0) = (ops::flops_counted(), dev.memory_stats().in_use);
    // Every rank has read before any starts its forward: a peer's sends
    // land on this rank's device.
    for c in comms {
        c.barrier().unwrap();
    }
    let (y, saved) = model.forward(cx, Act::new(ids.clone())).unwrap();
    // Every rank past its forward: no send of one still waits for its
    // receiver, counted on the sender's device.
    for c in comms {
        c.barrier().unwrap();
    }
    let (f1, m1) = (ops::flops_counted(), dev.memory_stats().in_use);
    // ... and none has started its backward, whose first sends land on
    // their receivers' devices.
    for c in comms {
        c.barrier().unwrap();
    }
    // The description counts the ids the embedding keeps, which were here before.
    let saved_bytes = (m1 - m0) as f64 - bytes(y.tensor()) as f64 + bytes(ids) as f64;
    let dy = Tensor::full(0.01, y.tensor().shape().clone(), y.tensor().dtype(), &dev).unwrap();
    drop(y);
    model.backward(cx, saved, Act::new(dy)).unwrap();
    let f2 = ops::flops_counted();
    let collectives = comms.iter().flat_map(|c| c.take()).collect();
    Measured { forward_flops: f1 - f0, backward_flops: f2 - f1, saved_bytes, collectives }
}

/// The description's collectives of one micro-batch of `tokens`, as (kind, bytes).
/// (The replicated gradients' sums of every pipeline part are one
/// all-reduce here: the models run whole, as one pipeline stage.)
fn described_collectives(cost: &ModelCost, tokens: f64) -> Vec<(CollectiveKind, f64)> {
    let bytes = |c: &CollectiveCost| c.bytes_per_token * tokens + c.bytes_per_micro_batch;
    let mut out: Vec<_> = cost.collectives.iter().filter(|c| !c.backward_sum).map(|c| (c.kind, bytes(c))).collect();
    let sums: Vec<f64> = cost.collectives.iter().filter(|c| c.backward_sum).map(bytes).collect();
    if !sums.is_empty() {
        out.push((CollectiveKind::AllReduce, sums.iter().sum()));
    }
    out
}

/// `a` and `b` as the same multiset of (kind, bytes), in any order.
fn same_collectives(a: &[(CollectiveKind, f64)], b: &[(CollectiveKind, f64)]) -> bool {
    let key = |v: &[(CollectiveKind, f64)]| {
        let mut v: Vec<(String, i64)> = v.iter().map(|(k, b)| (format!("{k:?}"), b.round() as i64)).collect();
        v.sort();
        v
    };
    key(a) == key(b)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// One rank's measured FLOPs (forward, and backward with any recompute)
/// and kept bytes against the description of its `tokens`.
fn check_work(at: &str, m: &Measured, cost: &ModelCost, tokens: f64) {
    let forward = cost.forward_flops() * tokens;
    assert!(close(m.forward_flops, forward), "{at}: forward flops {} measured, {forward} described", m.forward_flops);
    let backward = (cost.backward_flops() + cost.recompute_flops()) * tokens;
    assert!(close(m.backward_flops, backward), "{at}: backward flops {} measured, {backward} described", m.backward_flops);
    let kept = cost.saved_bytes() * tokens;
    assert!(close(m.saved_bytes, kept), "{at}: kept bytes {} measured, {kept} described", m.saved_bytes);
}

const POLICIES: [RecomputeOverride; 3] = [RecomputeOverride::Off, RecomputeOverride::AsDeclared, RecomputeOverride::Full];

/// For each recompute policy and each tensor-parallel layout, every rank's
/// measured FLOPs, kept bytes and collectives equal the description's.
fn check_model<M, F>(name: &str, make: F, seq: usize)
where
    M: Module<In = Replicated, Out = SplitHidden>,
    F: Fn() -> M + Sync,
{
    let batch = 2;
    let tokens = (batch * seq) as f64;
    let layouts = [(1, false, DType::F32), (2, false, DType::F32), (2, true, DType::F32), (2, true, DType::BF16)];
    for (tp, sp, dtype) in layouts {
        for policy in POLICIES {
            let settings = CostSettings { tp, sp, dtype, recompute: policy, ..CostSettings::single(seq) };
            let cost = describe(&make(), settings).unwrap();
            let world = InProcess::new(tp).unwrap();
            std::thread::scope(|s| {
                for rank in 0..tp {
                    let (world, make, cost) = (&world, &make, &cost);
                    s.spawn(move || {
                        let dev = Device::cpu();
                        let counting = Counting::new(Arc::new(world.communicator(rank, &dev).unwrap()));
                        let mut groups = Groups::single();
                        groups.tp = counting.clone();
                        let mut cx = Cx::new(dev.clone()).with_groups(groups).with_sequence_parallel(sp).with_dtype(dtype);
                        cx.set_recompute_override(policy);
                        let model = module::build(make(), &cx).unwrap();
                        let ids: Vec<u32> = (0..batch * seq).map(|i| (i * 7 % 50) as u32).collect();
                        let ids = Tensor::from_vec(ids, [batch, seq], &dev).unwrap();
                        let m = measure(&model, &mut cx, &ids, &[&counting]);
                        let at = format!("{name} tp={tp} sp={sp} {dtype} {policy:?} rank {rank}");
                        check_work(&at, &m, cost, tokens);
                        let described = described_collectives(cost, tokens);
                        assert!(same_collectives(&m.collectives, &described), "{at}: collectives\n measured  {:?}\n described {described:?}", m.collectives);
                    });
                }
            });
        }
    }
}

#[test]
fn gpt2_costs_are_what_runs() {
    check_model("gpt2", || Gpt2::new(&Gpt2Config::tiny(64, 32, 4, 2, 16)).unwrap(), 8);
}

#[test]
fn llama_costs_are_what_runs() {
    check_model("llama", || Llama::new(&LlamaConfig::tiny(64, 32, 4, 2, 48, 2, 16)).unwrap(), 8);
}

#[test]
fn mixtral_costs_are_what_runs() {
    check_model("mixtral", || Mixtral::new(&MixtralConfig::tiny(64, 32, 4, 2, 24, 4, 2, 2, 16)).unwrap(), 8);
}

/// Over two expert-parallel ranks each rank's share depends on where its
/// tokens route, but the ranks together run what the description says of
/// two ranks: every token's slots through an expert, two all-to-alls each way.
#[test]
fn mixtral_expert_parallel_costs_sum_to_what_runs() {
    let (batch, seq, ep) = (2, 8, 2);
    let config = MixtralConfig::tiny(64, 32, 4, 2, 24, 4, 2, 2, 16);
    let tokens = (batch * seq) as f64;
    for policy in POLICIES {
        let settings = CostSettings { ep, recompute: policy, ..CostSettings::single(seq) };
        let cost = describe(&Mixtral::new(&config).unwrap(), settings).unwrap();
        let world = InProcess::new(ep).unwrap();
        let measured: Vec<Measured> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..ep)
                .map(|rank| {
                    let (world, config) = (&world, &config);
                    s.spawn(move || {
                        let dev = Device::cpu();
                        let counting = Counting::new(Arc::new(world.communicator(rank, &dev).unwrap()));
                        let mut groups = Groups::single();
                        groups.ep = counting.clone();
                        let mut cx = Cx::new(dev.clone()).with_groups(groups);
                        cx.set_recompute_override(policy);
                        let model = module::build(Mixtral::with_expert_parallel(config, rank, ep).unwrap(), &cx).unwrap();
                        let ids: Vec<u32> = (0..batch * seq).map(|i| ((i + rank * 5) * 7 % 50) as u32).collect();
                        let ids = Tensor::from_vec(ids, [batch, seq], &dev).unwrap();
                        measure(&model, &mut cx, &ids, &[&counting])
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let ranks = ep as f64;
        let sum = |f: fn(&Measured) -> f64| measured.iter().map(f).sum::<f64>();
        let at = format!("mixtral ep={ep} {policy:?}");
        assert!(close(sum(|m| m.forward_flops), ranks * cost.forward_flops() * tokens), "{at}: forward flops");
        assert!(close(sum(|m| m.backward_flops), ranks * (cost.backward_flops() + cost.recompute_flops()) * tokens), "{at}: backward flops");
        let all_to_all: f64 = measured.iter().flat_map(|m| &m.collectives).map(|(_, b)| b).sum();
        let described: f64 = described_collectives(&cost, tokens).iter().map(|(_, b)| b).sum();
        assert!(close(all_to_all, ranks * described), "{at}: all-to-all bytes {all_to_all} measured, {} described", ranks * described);
        assert_eq!(measured[0].collectives.len(), cost.collectives.len(), "{at}: one all-to-all per dispatch and combine, each way");
    }
}

/// Over context-parallel ranks (ring attention, each rank a zigzag half of
/// every sequence's chunks), every rank runs what the description says of
/// its tokens: the FLOPs, the bytes kept, and the ring's sends, `cp − 1`
/// hops of the described bytes per pass.
#[test]
fn context_parallel_costs_are_what_runs() {
    let (batch, seq) = (2, 16);
    for cp in [2, 4] {
        for policy in POLICIES {
            let make = || Llama::new(&LlamaConfig::tiny(64, 32, 4, 2, 48, 2, seq)).unwrap();
            let settings = CostSettings { cp, recompute: policy, ..CostSettings::single(seq) };
            let cost = describe(&make(), settings).unwrap();
            let tokens = (batch * seq / cp) as f64;
            let world = InProcess::new(cp).unwrap();
            std::thread::scope(|s| {
                for rank in 0..cp {
                    let (world, make, cost) = (&world, &make, &cost);
                    s.spawn(move || {
                        let dev = Device::cpu();
                        let counting = Counting::new(Arc::new(world.communicator(rank, &dev).unwrap()));
                        let mut groups = Groups::single();
                        groups.cp = counting.clone();
                        let mut cx = Cx::new(dev.clone()).with_groups(groups);
                        cx.set_recompute_override(policy);
                        let model = module::build(make(), &cx).unwrap();
                        let ids: Vec<u32> = (0..batch * seq).map(|i| (i * 7 % 50) as u32).collect();
                        let ids = Tensor::from_vec(ids, [batch, seq], &dev).unwrap();
                        let ids = tessera::module::ContextSplit::new(rank, cp).unwrap().local_of(&ids, 1).unwrap();
                        let m = measure(&model, &mut cx, &ids, &[&counting]);
                        let at = format!("llama cp={cp} {policy:?} rank {rank}");
                        check_work(&at, &m, cost, tokens);
                        let sent: f64 = m.collectives.iter().map(|(_, b)| b).sum();
                        let described: f64 = described_collectives(cost, tokens).iter().map(|(_, b)| b * (cp - 1) as f64).sum();
                        assert!(close(sent, described), "{at}: ring bytes {sent} sent, {described} described");
                    });
                }
            });
        }
    }
}

/// The description of the full-size models, for sequences of 2048 tokens
/// in bf16, against counts made by hand from each architecture: the
/// published parameter counts, matrix FLOPs per token, and the bytes each
/// layer keeps. Nothing is materialised: a description reads shapes only.
mod at_scale {
    use super::*;
    use tessera::module::StagePart;

    /// Sequences of `seq` tokens in bf16.
    fn settings(seq: usize, recompute: RecomputeOverride) -> CostSettings {
        CostSettings { dtype: DType::BF16, recompute, ..CostSettings::single(seq) }
    }

    /// Forward and backward FLOPs per token of `layers` blocks whose
    /// products hold `block_weights` multiply-adds per token, with causal
    /// attention over `q_width` query features and sequences of `t`, and a
    /// head of `head_weights`.
    fn flops(layers: f64, block_weights: f64, q_width: f64, head_weights: f64, t: f64) -> (f64, f64) {
        let matmul = 2.0 * (layers * block_weights + head_weights);
        let attention = layers * 4.0 * q_width * (t + 1.0) / 2.0;
        (matmul + attention, 2.0 * matmul + 2.5 * attention)
    }

    fn check(name: &str, cost: &ModelCost, (forward, backward): (f64, f64), saved: f64) {
        assert!(close(cost.forward_flops(), forward), "{name}: forward flops {} described, {forward} by hand", cost.forward_flops());
        assert!(close(cost.backward_flops(), backward), "{name}: backward flops {} described, {backward} by hand", cost.backward_flops());
        assert!(close(cost.saved_bytes(), saved), "{name}: kept bytes per token {} described, {saved} by hand", cost.saved_bytes());
    }

    #[test]
    fn gpt2_124m() {
        let model = Gpt2::new(&Gpt2Config::default()).unwrap();
        let (v, d, l, h) = (50257.0, 768.0, 12.0, 12.0);
        let t = 1024.0;
        let settings = |r| settings(1024, r);
        let off = describe(&model, settings(RecomputeOverride::Off)).unwrap();
        assert_eq!(off.param_count(), 124_439_808, "Hugging Face's count for gpt2");
        let fl = flops(l, 12.0 * d * d, d, d * v, t);
        // Per block, in bf16: ln_1's input and ln_2's (each with two f32
        // statistics), the inputs of c_attn, c_fc and both c_proj, the
        // attention's q/k/v and f32 log-sum-exp, gelu's input.
        let block = 2.0 * d * (1.0 + 1.0 + 3.0 + 1.0 + 1.0 + 1.0 + 4.0 + 4.0) + 2.0 * 8.0 + 4.0 * h;
        let ends = 4.0 + (2.0 * d + 8.0) + 2.0 * d; // the ids; ln_f; the head's input
        check("gpt2 off", &off, fl, l * block + ends);
        // The blocks declare selective recompute: the attention keeps its
        // input (the same q/k/v buffer) and drops only the log-sum-exp.
        let selective = describe(&model, settings(RecomputeOverride::AsDeclared)).unwrap();
        check("gpt2 selective", &selective, fl, l * (block - 4.0 * h) + ends);
        assert!(close(selective.recompute_flops(), l * 4.0 * d * (t + 1.0) / 2.0));
        // Full recompute keeps each block's input only, and brings one block back at a time.
        let full = describe(&model, settings(RecomputeOverride::Full)).unwrap();
        check("gpt2 full", &full, fl, l * 2.0 * d + ends);
        assert!(close(full.recompute_flops(), full.forward_flops() - 2.0 * d * v), "every block's forward runs again");
        assert!(close(full.recompute_peak_bytes, block));
        // The pipeline placement: embeddings first, head last, blocks by layer.
        let first = off.part(|s| s == StagePart::First);
        assert_eq!(first.param_count(), (v * d + 1024.0 * d) as usize);
        let last = off.part(|s| s == StagePart::Last);
        assert_eq!(last.param_count(), (v * d + 2.0 * d) as usize, "the tied head is held again on the last stage");
        assert!(close(last.forward_flops(), 2.0 * d * v));
        let layer3 = off.part(|s| matches!(s, StagePart::Layer { index: 3, count: 12 }));
        assert!(close(layer3.saved_bytes(), block));
    }

    #[test]
    fn llama2_7b() {
        let model = Llama::new(&LlamaConfig::default()).unwrap();
        let (v, d, i, l, q) = (32000.0, 4096.0, 11008.0, 32.0, 32.0);
        let settings = |r| settings(2048, r);
        let off = describe(&model, settings(RecomputeOverride::Off)).unwrap();
        assert_eq!(off.param_count(), 6_738_415_616, "Meta's count for Llama 2 7B");
        let fl = flops(l, d * 3.0 * d + d * d + 3.0 * d * i, d, d * v, 2048.0);
        // Per block: both norms' inputs (one f32 statistic each), the inputs
        // of qkv_proj and of gate/up (shared), the rotated q/k/v, the
        // attention output (o_proj's input), its log-sum-exp, swiglu's two
        // inputs and down_proj's.
        let block = 2.0 * d * (1.0 + 1.0 + 3.0 + 1.0 + 1.0 + 1.0) + 2.0 * 3.0 * i + 2.0 * 4.0 + 4.0 * q;
        let ends = 4.0 + (2.0 * d + 4.0) + 2.0 * d;
        check("llama off", &off, fl, l * block + ends);
        // Selective: the attention keeps qkv_proj's output instead of the
        // rotated copy (the same size) and drops the log-sum-exp.
        let selective = describe(&model, settings(RecomputeOverride::AsDeclared)).unwrap();
        check("llama selective", &selective, fl, l * (block - 4.0 * q) + ends);
        let full = describe(&model, settings(RecomputeOverride::Full)).unwrap();
        check("llama full", &full, fl, l * 2.0 * d + ends);

        // Eight tensor-parallel ranks with sequence parallelism: per rank,
        // the norms' tokens and the split heads and MLP are an eighth, and
        // so are the column-parallel layers' inputs: each keeps its slice of
        // the sequence and gathers it again in the backward (gate and up
        // share theirs), the head's too.
        let tp8 = describe(&model, CostSettings { tp: 8, sp: true, ..settings(RecomputeOverride::Off) }).unwrap();
        let per_rank = 2.0 * (2.0 * d + 4.0) / 8.0 + 2.0 * 2.0 * d / 8.0 + (2.0 * 3.0 * d + 2.0 * d + 4.0 * q + 2.0 * 3.0 * i) / 8.0;
        let ends8 = 4.0 + (2.0 * d + 4.0) / 8.0 + 2.0 * d / 8.0;
        assert!(close(tp8.saved_bytes(), l * per_rank + ends8), "llama tp8 sp: {} described, {} by hand", tp8.saved_bytes(), l * per_rank + ends8);
        assert!(close(tp8.forward_flops(), fl.0 / 8.0), "tensor parallelism divides every product");
        // Each block: all-gathers before qkv, gate and up (forward) and
        // reduce-scatters after o_proj and down_proj, and their duals; the
        // three gathers again in the backward. Both norms' gradients are
        // summed over the group, too, in the backward's one sum.
        let block: Vec<_> = tp8.collectives.iter().filter(|c| matches!(c.stage, StagePart::Layer { index: 0, .. })).collect();
        assert_eq!(block.len(), 3 * 2 + 2 * 2 + 1 + 3, "{block:?}");
        let sum: Vec<_> = block.iter().filter(|c| c.backward_sum).collect();
        assert!(sum.len() == 1 && sum[0].bytes_per_micro_batch == 2.0 * d * 2.0, "the norms' gains, in bf16: {sum:?}");
    }

    #[test]
    fn mixtral_8x7b() {
        let config = MixtralConfig { max_position_embeddings: 4096, ..MixtralConfig::default() };
        let model = Mixtral::new(&config).unwrap();
        let (v, d, i, l, q, e, k) = (32000.0, 4096.0, 14336.0, 32.0, 32.0, 8.0, 2.0);
        let settings = |r| settings(2048, r);
        let off = describe(&model, settings(RecomputeOverride::Off)).unwrap();
        assert_eq!(off.param_count(), 46_702_792_704, "Mistral's count for Mixtral 8x7B");
        let expert_params = off.param_count_where(|p| p.expert);
        assert_eq!(expert_params as f64, l * e * 3.0 * d * i);
        // Per token: attention (6144-wide q/k/v for 32 query and 8 key/value
        // heads), the router, two experts of three products, and the
        // products that mix their outputs (k multiply-adds per feature).
        let fl = flops(l, d * 6144.0 + d * d + d * e + k * 3.0 * d * i + k * d, d, d * v, 2048.0);
        // Per block: the norms' inputs and qkv_proj's, the rotated q/k/v,
        // the attention output and log-sum-exp, the norms' statistics; then
        // the layer's input, the choices (u32) and weights, the rows sent to
        // the experts, each expert's gate, up and hidden rows, the outputs
        // and the weights they are mixed by.
        let attention = 2.0 * d * 3.0 + 2.0 * 6144.0 + 2.0 * d + 4.0 * q + 2.0 * 4.0;
        let moe = 2.0 * d + 4.0 * k + 2.0 * k + 2.0 * k * d + 3.0 * 2.0 * k * i + 2.0 * k * d + 2.0 * k;
        let block = attention + moe;
        let ends = 4.0 + (2.0 * d + 4.0) + 2.0 * d;
        check("mixtral off", &off, fl, l * block + ends);
        // Eight expert-parallel ranks: the rows go out and back, each way.
        let ep8 = describe(&model, CostSettings { ep: 8, ..settings(RecomputeOverride::Off) }).unwrap();
        let rows: f64 = ep8.collectives.iter().map(|c| c.bytes_per_token).sum();
        assert!(close(rows, l * 4.0 * k * d * 2.0));
    }
}
