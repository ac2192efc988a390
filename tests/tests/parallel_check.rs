//! `tessera::testing::check_parallel` on the models behind each root cause
//! the DSL once let through (they compile, so they must train exactly as on
//! one rank), and on a layer that breaks the contract, which it must reject.

use tessera::module::{Act, Cx, Module, Plain, Seq, Visitor};
use tessera::nn::{Dropout, Embedding, LayerNorm, Linear, PositionEmbedding, RmsNorm, Stack};
use tessera::prelude::*;
use tessera::testing::{check_parallel, check_parallel_staged, Check, Rank};
use tessera::Result;

fn input(seed: u64, dims: &[usize]) -> Tensor {
    Tensor::rand(Init::Normal { mean: 0.0, std: 1.0 }, RngKey::new(seed, 0), dims, DType::F32, &Device::cpu()).unwrap()
}

fn ids(dims: [usize; 2], vocab: u32) -> Tensor {
    let n = dims[0] * dims[1];
    Tensor::from_vec((0..n as u32).map(|i| (i * 7 + 3) % vocab).collect::<Vec<u32>>(), dims, &Device::cpu()).unwrap()
}

const TP_RUNS: [&str; 6] = ["tp2", "tp4", "tp2+sp", "tp4+sp", "tp2+sp+overlap=2", "dp2,tp2+bucket=64"];

/// An unsharded linear map on the residual stream: under sequence
/// parallelism it sees a slice of the tokens, so its weight's gradient is
/// partial over the group and must be summed (replicas once drifted apart).
#[derive(Module)]
pub struct PlainLinearMlp {
    ln: RmsNorm,
    mix: Linear,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl PlainLinearMlp {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + self.mix(self.ln(x));
        h + all_reduce(self.down(silu(self.up(h))))
    }
}

#[test]
fn an_unsharded_linear_on_the_residual_stream_trains_as_on_one_rank() {
    let make = |_: &Rank| -> Result<PlainLinearMlp> {
        Ok(PlainLinearMlp { ln: RmsNorm::new(8, 1e-6)?, mix: Linear::new(8, 8, true)?, up: Linear::new(8, 16, true)?, down: Linear::new(16, 8, true)? })
    };
    check_parallel(make, &input(1, &[4, 4, 8]), &Check::new(TP_RUNS).with_finite_differences(3)).unwrap();
}

/// A reduction split over the sequence and gathered back, added to the
/// residual: `all_gather`'s backward once reduce-scattered an already
/// complete gradient, multiplying it by the degree.
#[derive(Module)]
pub struct GatheredMlp {
    ln: LayerNorm,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl GatheredMlp {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let partial = self.down(silu(self.up(self.ln(x))) * self.up(x));
        x + all_gather(reduce_scatter(partial))
    }
}

#[test]
fn all_gather_of_reduce_scatter_trains_as_on_one_rank() {
    let make = |_: &Rank| -> Result<GatheredMlp> {
        Ok(GatheredMlp { ln: LayerNorm::new(8, 1e-5, true)?, up: Linear::new(8, 16, true)?, down: Linear::new(16, 8, true)? })
    };
    check_parallel(make, &input(2, &[2, 4, 8]), &Check::new(TP_RUNS).with_finite_differences(3)).unwrap();
}

/// Dropout on a batch of several sequences: its masks must be drawn at
/// global positions whatever slice of the batch and sequence a rank holds.
#[derive(Module)]
pub struct DropoutBlock {
    ln: LayerNorm,
    drop: Dropout,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl DropoutBlock {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + self.drop(self.ln(x));
        h + self.drop(all_reduce(self.down(gelu(self.up(h)))))
    }
}

#[test]
fn dropout_masks_do_not_depend_on_the_parallel_layout() {
    let make = |_: &Rank| -> Result<DropoutBlock> {
        Ok(DropoutBlock { ln: LayerNorm::new(8, 1e-5, true)?, drop: Dropout::new(0.3)?, up: Linear::new(8, 16, true)?, down: Linear::new(16, 8, true)? })
    };
    check_parallel(make, &input(3, &[4, 4, 8]), &Check::new(TP_RUNS).with_finite_differences(2)).unwrap();
}

#[derive(Module)]
pub struct Block {
    ln: LayerNorm,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl Block {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + all_reduce(self.down(gelu(self.up(self.ln(x)))))
    }
}

/// A language model computing in bf16 whose blocks are the pipeline's split
/// field, with a plain (unsharded) embedding and position table.
#[derive(Module)]
#[model(precision = bf16)]
pub struct HalfLm {
    #[stage(first)]
    tok: Embedding,
    #[stage(first)]
    pos: PositionEmbedding,
    #[stage(split)]
    #[precision(bf16)]
    blocks: Stack<Block>,
    #[stage(last)]
    #[precision(f32)]
    norm: LayerNorm,
    #[stage(last)]
    #[shard(vocab)]
    head: Linear,
}

#[forward]
impl HalfLm {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        self.head(self.norm(self.blocks(self.pos(self.tok(ids)))))
    }
}

fn half_lm(_: &Rank) -> Result<HalfLm> {
    let block = |_| -> Result<Block> { Ok(Block { ln: LayerNorm::new(8, 1e-5, true)?, up: Linear::new(8, 16, true)?, down: Linear::new(16, 8, true)? }) };
    Ok(HalfLm {
        tok: Embedding::new(16, 8)?,
        pos: PositionEmbedding::new(8, 8)?,
        blocks: Stack::from_fn(4, block)?,
        norm: LayerNorm::new(8, 1e-5, true)?,
        head: Linear::new(8, 16, false)?,
    })
}

/// The pipeline ran the split field's blocks in f32 while one rank ran
/// them in bf16; stages compare tightly against one rank running the same
/// microbatches.
#[test]
fn a_pipeline_keeps_the_split_fields_precision() {
    check_parallel_staged(half_lm, &ids([4, 4], 16), &Check::new(["pp2+mb=2", "pp2+mb=4", "pp4+mb=2"])).unwrap();
}

/// In f64 the precision regions are no-ops: every tensor-parallel layout,
/// with a plain embedding feeding sequence-parallel blocks, equals one rank.
#[test]
fn a_plain_embedding_feeds_sequence_parallel_blocks() {
    check_parallel_staged(half_lm, &ids([4, 4], 16), &Check::new(TP_RUNS).with_dtype(DType::F64).with_tolerance(1e-10).with_finite_differences(2)).unwrap();
}

/// A hand-written layer that declares it takes a slice of the sequence but
/// mixes positions (a running sum over the sequence): under sequence
/// parallelism it computes something else, and the check must say so.
pub struct Cumsum;

impl Module for Cumsum {
    type In = Replicated;
    type Out = Replicated;
    type Saved = ();
    // The lie: a running sum needs every earlier token.
    const SEQ_IN: Seq = Seq::Split;
    const SEQ_OUT: Seq = Seq::Split;

    fn forward(&self, _cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<Replicated>, ())> {
        Ok((Act::new(cumsum(x.tensor(), false)?), ()))
    }

    fn backward(&self, _cx: &mut Cx, _saved: (), dy: Act<Replicated>) -> Result<Act<Replicated>> {
        Ok(Act::new(cumsum(dy.tensor(), true)?))
    }

    fn visit_params(&self, _v: &mut Visitor<'_>) -> Result<()> {
        Ok(())
    }
}

/// The running sum over dimension 1 of `[b, t, d]` (from the end when `reverse`).
fn cumsum(x: &Tensor, reverse: bool) -> Result<Tensor> {
    let (b, t, d) = (x.dims()[0], x.dims()[1], x.dims()[2]);
    let mut v = x.to_f64_vec()?;
    for i in 0..b {
        for j in 0..d {
            let mut acc = 0.0;
            for k in 0..t {
                let k = if reverse { t - 1 - k } else { k };
                acc += v[(i * t + k) * d + j];
                v[(i * t + k) * d + j] = acc;
            }
        }
    }
    Tensor::from_vec(v, x.dims(), x.device())?.to_dtype(x.dtype())
}

#[derive(Module)]
pub struct Mixer {
    ln: LayerNorm,
    mix: Cumsum,
}

#[forward]
impl Mixer {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + self.mix(self.ln(x))
    }
}

#[test]
fn a_layer_that_breaks_its_sequence_contract_is_caught() {
    let make = |_: &Rank| -> Result<Mixer> { Ok(Mixer { ln: LayerNorm::new(8, 1e-5, true)?, mix: Cumsum }) };
    let x = input(5, &[2, 4, 8]);
    // Without sequence parallelism the layer is fine (and its backward right).
    check_parallel(make, &x, &Check::new(["tp2", "dp2,tp2+bucket=64"]).with_finite_differences(3)).unwrap();
    let err = check_parallel(make, &x, &Check::new(["tp2+sp"])).unwrap_err().to_string();
    assert!(err.contains("tp2+sp") && err.contains("differs from one rank's"), "{err}");
}

/// Declaring the layer whole (the default) makes it correct again: the
/// generated code gathers the sequence before it.
pub struct HonestCumsum;

impl Module for HonestCumsum {
    type In = Replicated;
    type Out = Replicated;
    type Saved = ();

    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<Replicated>, ())> {
        Cumsum.forward(cx, x)
    }

    fn backward(&self, cx: &mut Cx, saved: (), dy: Act<Replicated>) -> Result<Act<Replicated>> {
        Cumsum.backward(cx, saved, dy)
    }

    fn visit_params(&self, _v: &mut Visitor<'_>) -> Result<()> {
        Ok(())
    }
}

#[derive(Module)]
pub struct HonestMixer {
    ln: LayerNorm,
    mix: HonestCumsum,
}

#[forward]
impl HonestMixer {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + self.mix(self.ln(x))
    }
}

#[test]
fn a_layer_taking_the_whole_sequence_is_gathered_for() {
    let make = |_: &Rank| -> Result<HonestMixer> { Ok(HonestMixer { ln: LayerNorm::new(8, 1e-5, true)?, mix: HonestCumsum }) };
    check_parallel(make, &input(6, &[2, 4, 8]), &Check::new(TP_RUNS)).unwrap();
    assert_eq!(<HonestMixer as Module<Plain>>::SEQ_IN, Seq::Split, "the norm reads the slice; the gather comes after it");
}

/// A backward a thousandth off: the single-rank gradients' check against
/// finite differences must catch it, at every step it tries (the parallel
/// runs agree with the single rank's, wrong alike).
pub struct SlightlyWrongCumsum;

impl Module for SlightlyWrongCumsum {
    type In = Replicated;
    type Out = Replicated;
    type Saved = ();

    fn forward(&self, cx: &mut Cx, x: Act<Replicated>) -> Result<(Act<Replicated>, ())> {
        Cumsum.forward(cx, x)
    }

    fn backward(&self, _cx: &mut Cx, _saved: (), dy: Act<Replicated>) -> Result<Act<Replicated>> {
        Ok(Act::new(tessera::ops::scale(&cumsum(dy.tensor(), true)?, 1.001)?))
    }

    fn visit_params(&self, _v: &mut Visitor<'_>) -> Result<()> {
        Ok(())
    }
}

#[derive(Module)]
pub struct WrongMixer {
    ln: LayerNorm,
    mix: SlightlyWrongCumsum,
}

#[forward]
impl WrongMixer {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + self.mix(self.ln(x))
    }
}

#[test]
fn a_backward_off_by_a_thousandth_is_caught_by_finite_differences() {
    let make = |_: &Rank| -> Result<WrongMixer> { Ok(WrongMixer { ln: LayerNorm::new(8, 1e-5, true)?, mix: SlightlyWrongCumsum }) };
    let err = check_parallel(make, &input(8, &[2, 4, 8]), &Check::new(["tp2"]).with_finite_differences(3)).unwrap_err().to_string();
    assert!(err.contains("finite differences: d loss / d `ln."), "{err}");
}

#[test]
fn bad_run_specs_are_refused_with_the_fix() {
    let make = |_: &Rank| -> Result<Block> { Ok(Block { ln: LayerNorm::new(8, 1e-5, true)?, up: Linear::new(8, 16, true)?, down: Linear::new(16, 8, true)? }) };
    let x = input(7, &[2, 4, 8]);
    for (spec, says) in [
        ("tp2+spp", "unknown option"),
        ("xp2", "unknown axis"),
        ("pp2", "check_parallel_staged"),
        ("tp2+mb=2", "without a pipeline"),
        ("ep2", "expert"),
        ("tp2+overlap=2", "add `tp2` (or more) and `+sp`"),
        ("tp2+sp+overlap=0", "needs a positive number"),
    ] {
        let err = check_parallel(make, &x, &Check::new([spec])).unwrap_err().to_string();
        assert!(err.contains(says), "{spec}: {err}");
    }
    let err = check_parallel(make, &input(7, &[3, 4, 8]), &Check::new(["dp2,tp2"])).unwrap_err().to_string();
    assert!(err.contains("does not split"), "{err}");
}
