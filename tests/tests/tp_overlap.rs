//! Tensor-parallel communication cut into pieces that overlap the products
//! (`Cx::with_tp_overlap`): the same outputs and gradients as the whole
//! collectives (to the rounding of products computed a piece at a time),
//! and the collectives really are cut.

mod common;
use common::models::{Gpt, LlamaBlock};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tessera::dist::inproc::InProcess;
use tessera::dist::{Communicator, Pending};
use tessera::module::{self, Act, Cx, Groups, Module};
use tessera::nn::{Linear, Stack};
use tessera::prelude::*;

/// A communicator that counts each call by name, and whether it moved a
/// piece of a sequence of `seq` tokens or all of it, and passes it on.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn Communicator>,
    seq: usize,
    calls: Mutex<BTreeMap<String, usize>>,
}

impl Counting {
    /// Counts `op` on `t`, whose dimension 1 is `whole` tokens unless it is a piece.
    fn count_of(&self, op: &str, t: &Tensor, whole: usize) {
        let piece = t.rank() >= 3 && t.dims()[1] < whole;
        *self.calls.lock().unwrap().entry(if piece { format!("{op} piece") } else { op.to_string() }).or_default() += 1;
    }
    fn count(&self, op: &str) {
        *self.calls.lock().unwrap().entry(op.to_string()).or_default() += 1;
    }
    fn calls(&self) -> BTreeMap<String, usize> {
        self.calls.lock().unwrap().clone()
    }
}

impl Communicator for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> tessera::Result<Tensor> {
        self.count("all_reduce");
        self.inner.all_reduce_sum(t)
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> tessera::Result<Tensor> {
        self.count_of("all_gather", t, self.seq / self.size());
        self.inner.all_gather(t, dim)
    }
    fn reduce_scatter_sum(&self, t: &Tensor, dim: usize) -> tessera::Result<Tensor> {
        self.count_of("reduce_scatter", t, self.seq);
        self.inner.reduce_scatter_sum(t, dim)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> tessera::Result<Tensor> {
        self.count("broadcast");
        self.inner.broadcast(t, root)
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> tessera::Result<Vec<Tensor>> {
        self.count("all_to_all");
        self.inner.all_to_all(parts)
    }
    fn barrier(&self) -> tessera::Result<()> {
        self.inner.barrier()
    }
    fn all_gather_async(&self, t: &Tensor, dim: usize) -> tessera::Result<Pending> {
        self.count_of("all_gather_async", t, self.seq / self.size());
        self.inner.all_gather_async(t, dim)
    }
    fn reduce_scatter_sum_async(&self, t: &Tensor, dim: usize) -> tessera::Result<Pending> {
        self.count_of("reduce_scatter_async", t, self.seq);
        self.inner.reduce_scatter_sum_async(t, dim)
    }
    fn all_reduce_sum_async(&self, t: &Tensor) -> tessera::Result<Pending> {
        self.count("all_reduce_async");
        self.inner.all_reduce_sum_async(t)
    }
    fn send(&self, t: &Tensor, peer: usize) -> tessera::Result<()> {
        self.count("send");
        self.inner.send(t, peer)
    }
    fn send_async(&self, t: &Tensor, peer: usize) -> tessera::Result<Pending<()>> {
        self.count("send_async");
        self.inner.send_async(t, peer)
    }
    fn recv(&self, peer: usize) -> tessera::Result<Tensor> {
        self.count("recv");
        self.inner.recv(peer)
    }
}

/// What one rank ends a forward and backward with: its output, every
/// parameter gradient by name, and its tensor-parallel calls.
struct RankRun {
    output: Vec<f64>,
    grads: BTreeMap<String, Vec<f64>>,
    calls: BTreeMap<String, usize>,
    /// The FP8 scales the step leaves (empty without FP8).
    fp8_scales: Vec<(String, &'static str, f32)>,
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_f64_vec().unwrap()
}

/// Runs `make`'s model on `tp` ranks with sequence parallelism and the
/// collectives cut into `pieces`, on the input `x` of every rank (`slice`:
/// each rank gets its part of dimension 1) and a fixed output gradient.
fn run<M: Module + Send>(tp: usize, pieces: usize, dtype: DType, make: &(dyn Fn() -> tessera::Result<M> + Sync), x: &Tensor, slice: bool) -> Vec<RankRun> {
    run_with(tp, pieces, dtype, false, make, x, slice)
}

/// [`run`], with the linear layers' products in FP8 when `fp8` (the step
/// then ends with `end_fp8_step`, and the run records the scales it leaves).
fn run_with<M: Module + Send>(
    tp: usize,
    pieces: usize,
    dtype: DType,
    fp8: bool,
    make: &(dyn Fn() -> tessera::Result<M> + Sync),
    x: &Tensor,
    slice: bool,
) -> Vec<RankRun> {
    let world = InProcess::new(tp).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..tp)
            .map(|rank| {
                let world = &world;
                s.spawn(move || {
                    let dev = Device::cpu();
                    let seq = x.dims()[1];
                    let counting = Arc::new(Counting { inner: Arc::new(world.communicator(rank, &dev).unwrap()), seq, calls: Mutex::default() });
                    let mut groups = Groups::single();
                    groups.tp = counting.clone();
                    let mut cx = Cx::new(dev.clone()).with_dtype(dtype).with_seed(5).with_groups(groups).with_sequence_parallel(true).with_tp_overlap(pieces);
                    if fp8 {
                        cx = cx.with_fp8(Default::default()).unwrap();
                    }
                    let m = module::build(make().unwrap(), &cx).unwrap();
                    let x = if slice {
                        let part = x.dims()[1] / tp;
                        x.narrow(1, rank * part, part).unwrap().to_device(&dev).unwrap()
                    } else {
                        x.to_device(&dev).unwrap()
                    };
                    let (y, saved) = m.forward(&mut cx, Act::new(x)).unwrap();
                    let n = y.tensor().elem_count();
                    let dy: Vec<f32> = (0..n).map(|i| (((i * 37 + rank * 11) % 23) as f32 - 11.0) / 16.0).collect();
                    let dy = Tensor::from_vec(dy, y.tensor().shape().clone(), &dev).unwrap().to_dtype(y.tensor().dtype()).unwrap();
                    m.backward(&mut cx, saved, Act::new(dy)).unwrap();
                    cx.end_fp8_step().unwrap();
                    let mut grads = BTreeMap::new();
                    module::visit_params(&m, |e| {
                        grads.entry(e.name.to_string()).or_insert_with(|| values(&e.param.grad().expect("every parameter has a gradient")));
                        Ok(())
                    })
                    .unwrap();
                    RankRun { output: values(y.tensor()), grads, calls: counting.calls(), fp8_scales: cx.fp8_scales() }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `got` against `want` on every rank, each tensor to a relative error
/// (of its norm) of `tol`.
fn assert_same(name: &str, got: &[RankRun], want: &[RankRun], tol: f64) {
    let close = |what: &str, g: &[f64], w: &[f64]| {
        assert_eq!(g.len(), w.len(), "{what}");
        let diff = g.iter().zip(w).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt();
        let norm = w.iter().map(|b| b * b).sum::<f64>().sqrt();
        assert!(diff <= tol * norm.max(1e-30), "{name}: {what}: relative error {:.2e} against the whole collectives'", diff / norm);
    };
    for (rank, (g, w)) in got.iter().zip(want).enumerate() {
        close(&format!("rank {rank}'s output"), &g.output, &w.output);
        assert_eq!(g.grads.keys().collect::<Vec<_>>(), w.grads.keys().collect::<Vec<_>>());
        for (p, v) in &g.grads {
            close(&format!("rank {rank}'s gradient of {p}"), v, &w.grads[p]);
        }
    }
}

/// A GPT (vocabulary-parallel embedding and head, two blocks) on two and
/// four ranks, in f64 and f32, with the slices cut into 2, 3 and 5 pieces
/// (uneven ones included): every output and gradient equals the run with
/// whole collectives (the products of pieces may round apart from the whole
/// product: the CPU kernels choose their blocking by size). Then the calls:
/// every column product gathers its input beside its own slice's product
/// and reduce-scatters its input gradient piece by piece, every row
/// product (and the embedding) sends the other ranks their slices' parts
/// and leaves its own slice's sum to its `all_reduce`, the backward of
/// that `all_reduce` gathers the gradient beside the row product's (or the
/// embedding's) own slice's work, and nothing is left whole; the norms'
/// gradients are summed over the group in one all-reduce, in the background
/// beside the embedding's backward.
#[test]
fn cut_collectives_give_the_whole_collectives_results() {
    const LAYERS: usize = 2;
    const VOCAB: usize = 16;
    let make = || Gpt::new(VOCAB, 16, 4, LAYERS);
    for (tp, seq) in [(2, 12), (4, 20)] {
        let ids = Tensor::from_vec((0..2 * seq as u32).map(|i| (i * 7 + 3) % VOCAB as u32).collect::<Vec<u32>>(), [2, seq], &Device::cpu()).unwrap();
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            let whole = run(tp, 1, dtype, &make, &ids, false);
            for pieces in [2, 3, 5] {
                let name = format!("tp{tp} {dtype} in {pieces} pieces");
                let cut = run(tp, pieces, dtype, &make, &ids, false);
                assert_same(&name, &cut, &whole, tol);
                // Columns: q/k/v and the first MLP product per block, and the head.
                let (columns, rows) = (2 * LAYERS + 1, 2 * LAYERS);
                let n = pieces.min(seq / tp);
                let (w, c) = (&whole[0].calls, &cut[0].calls);
                let get = |m: &BTreeMap<String, usize>, k: &str| m.get(k).copied().unwrap_or(0);
                // Whole: the backward of every `all_reduce` (the rows' and the
                // embedding's) gathers, and so does every column product.
                assert_eq!(get(w, "all_gather"), columns + rows + 1, "{name}: whole: {w:?}");
                assert_eq!(get(w, "reduce_scatter"), 1 + rows + columns, "{name}: whole: {w:?}");
                assert_eq!(get(w, "all_gather_async"), columns, "{name}: the slice gathered again for dW: {w:?}");
                // Overlapped, nothing is whole: every gather (each column
                // product's input, each row product's and the embedding's
                // output gradient) runs in the background beside the own
                // slice's product, besides the slices gathered again for dW.
                assert_eq!(get(c, "all_gather") + get(c, "reduce_scatter"), 0, "{name}: {c:?}");
                assert_eq!(get(c, "all_gather_async"), 2 * columns + rows + 1, "{name}: {c:?}");
                assert_eq!(get(c, "all_gather piece") + get(c, "all_gather_async piece"), 0, "{name}: gathers are not cut: {c:?}");
                // The replicated parameters (the norms') sum their gradients
                // over the group once: at the end of the backward with whole
                // collectives, beside the embedding's backward overlapped.
                assert_eq!(get(w, "all_reduce"), 1, "{name}: whole: {w:?}");
                assert_eq!((get(c, "all_reduce"), get(c, "all_reduce_async")), (0, 1), "{name}: {c:?}");
                // A row product's (and the embedding's) output is not
                // reduce-scattered: each other rank's slice is sent to it
                // in the background, and this rank's own slice summed with
                // what the others sent. A column product's input gradient
                // travels in `n` pieces.
                let reductions = rows + 1;
                assert_eq!((get(c, "send_async"), get(c, "recv")), (reductions * (tp - 1), reductions * (tp - 1)), "{name}: {c:?}");
                assert_eq!(get(c, "send") + get(c, "reduce_scatter piece"), 0, "{name}: {c:?}");
                assert_eq!(get(c, "reduce_scatter_async piece") + get(c, "reduce_scatter_async"), columns * n, "{name}: {c:?}");
            }
        }
    }
}

/// Llama blocks (grouped-query attention, a gated MLP whose two column
/// products each gather the input) on a float input that is each rank's
/// slice of the sequence, in f64: the whole collectives' output and
/// parameter gradients.
#[test]
fn llama_blocks_with_cut_collectives_match_the_whole_ones() {
    let make = || Stack::from_fn(2, |_| LlamaBlock::new(16, 4, 2, 32));
    let x = Tensor::rand(Init::Normal { mean: 0.0, std: 1.0 }, RngKey::new(3, 0), [2, 8, 16], DType::F64, &Device::cpu()).unwrap();
    let whole = run(2, 1, DType::F64, &make, &x, true);
    for pieces in [2, 4] {
        assert_same(&format!("llama tp2 in {pieces} pieces"), &run(2, pieces, DType::F64, &make, &x, true), &whole, 1e-12);
    }
}

/// Two row products whose outputs are summed before the `all_reduce`, so
/// that neither's running sum is taken (the reduction of their sum is a
/// whole collective), then a row product whose sum is: the messages the
/// first two sent must not be taken for the third's.
#[derive(Module)]
struct UntakenSums {
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    a: Linear,
    #[shard(row)]
    b: Linear,
    #[shard(column)]
    up2: Linear,
    #[shard(row)]
    c: Linear,
}

#[forward]
impl UntakenSums {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = self.up(x);
        let s = all_reduce(self.a(h) + self.b(h));
        all_reduce(self.c(self.up2(s)))
    }
}

#[test]
fn sums_nothing_takes_leave_no_message_behind() {
    let make = || -> tessera::Result<UntakenSums> {
        Ok(UntakenSums {
            up: Linear::new(8, 16, true)?,
            a: Linear::new(16, 8, false)?,
            b: Linear::new(16, 8, true)?,
            up2: Linear::new(8, 16, false)?,
            c: Linear::new(16, 8, true)?,
        })
    };
    for tp in [2, 4] {
        let x = Tensor::rand(Init::Normal { mean: 0.0, std: 1.0 }, RngKey::new(9, 0), [2, 8, 8], DType::F64, &Device::cpu()).unwrap();
        let whole = run(tp, 1, DType::F64, &make, &x, true);
        let cut = run(tp, 2, DType::F64, &make, &x, true);
        assert_same(&format!("tp{tp}"), &cut, &whole, 1e-12);
        assert_eq!(cut[0].calls.get("send_async").copied(), Some(3 * (tp - 1)), "every row product sent its slices: {:?}", cut[0].calls);
    }
}

/// FP8 products cut into pieces: each piece is quantized at the scale of
/// the whole operand (the first step's, from the whole's amax over the
/// group), so the cut run gives the whole collectives' outputs, gradients
/// and the scales it leaves for the next step, while its collectives really
/// are cut (a fall-back to whole ones would pass the comparison unseen).
#[test]
fn fp8_products_cut_into_pieces_give_the_whole_products_results() {
    const VOCAB: usize = 16;
    let make = || Gpt::new(VOCAB, 16, 4, 2);
    let (tp, seq) = (2, 12);
    let ids = Tensor::from_vec((0..2 * seq as u32).map(|i| (i * 5 + 1) % VOCAB as u32).collect::<Vec<u32>>(), [2, seq], &Device::cpu()).unwrap();
    let whole = run_with(tp, 1, DType::F64, true, &make, &ids, false);
    let plain = run(tp, 1, DType::F64, &make, &ids, false);
    assert!(!whole[0].fp8_scales.is_empty(), "FP8 ran");
    assert!(whole[0].output != plain[0].output, "FP8 rounds the products");
    for pieces in [2, 3] {
        let name = format!("FP8 in {pieces} pieces");
        let cut = run_with(tp, pieces, DType::F64, true, &make, &ids, false);
        assert_same(&name, &cut, &whole, 1e-12);
        for (rank, (c, w)) in cut.iter().zip(&whole).enumerate() {
            assert_eq!(c.fp8_scales, w.fp8_scales, "{name}: rank {rank}'s scales for the next step");
            let gathers = |calls: &BTreeMap<String, usize>| calls.get("all_gather_async").copied().unwrap_or(0);
            assert!(gathers(&c.calls) > gathers(&w.calls), "{name}: the gathers overlap the products: {:?}", c.calls);
            assert!(c.calls.get("reduce_scatter_async piece").copied().unwrap_or(0) > 0, "{name}: the reduce-scatters are cut: {:?}", c.calls);
        }
    }
}
