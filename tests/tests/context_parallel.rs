//! Context parallelism: every sequence split over the ranks of the cp axis,
//! attention passing key/value blocks around their ring. A model run with
//! its sequences split must compute the loss and every gradient a single
//! rank computes, alone and combined with the other axes.

use tessera::module::{ContextSplit, Groups};
use tessera::nn::{CausalAttention, Dropout, Embedding, Linear, PositionEmbedding, RmsNorm, Stack};
use tessera::prelude::*;
use tessera::testing::{check_parallel_staged, Check, Rank};
use tessera::Result;

/// A decoder block with grouped-query attention and RoPE.
#[derive(Module)]
pub struct Block {
    n1: RmsNorm,
    #[shard(column)]
    qkv: Linear,
    attn: CausalAttention,
    #[shard(row)]
    o: Linear,
    n2: RmsNorm,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
    drop: Dropout,
}

#[forward]
impl Block {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + all_reduce(self.o(self.attn(self.qkv(self.n1(x)))));
        h + self.drop(all_reduce(self.down(gelu(self.up(self.n2(h))))))
    }
}

/// A language model with every layer that looks at positions: learned
/// position rows, RoPE in attention, dropout drawn at global positions.
#[derive(Module)]
pub struct Lm {
    #[stage(first)]
    #[shard(vocab)]
    tok: Embedding,
    #[stage(first)]
    wpe: PositionEmbedding,
    #[stage(split)]
    blocks: Stack<Block>,
    #[stage(last)]
    norm: RmsNorm,
    #[stage(last)]
    #[shard(vocab)]
    head: Linear,
}

#[forward]
impl Lm {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        let x = self.wpe(all_reduce(self.tok(ids)));
        self.head(self.norm(self.blocks(x)))
    }
}

/// [`Lm`] whose blocks recompute their attention core in the backward
/// (selective recompute): the ring runs again there.
#[derive(Module)]
pub struct RecomputeLm {
    #[stage(first)]
    #[shard(vocab)]
    tok: Embedding,
    #[stage(first)]
    wpe: PositionEmbedding,
    #[stage(split)]
    #[recompute(selective)]
    blocks: Stack<Block>,
    #[stage(last)]
    norm: RmsNorm,
    #[stage(last)]
    #[shard(vocab)]
    head: Linear,
}

#[forward]
impl RecomputeLm {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        let x = self.wpe(all_reduce(self.tok(ids)));
        self.head(self.norm(self.blocks(x)))
    }
}

const VOCAB: usize = 16;

/// 4 query heads over 2 key/value heads of 4 values; `drop` dropout after the MLP.
fn lm(layers: usize, drop: f64) -> Result<Lm> {
    let (d, hd) = (16, 4);
    let block = || -> Result<Block> {
        Ok(Block {
            n1: RmsNorm::new(d, 1e-6)?,
            qkv: Linear::new(d, 8 * hd, false)?,
            attn: CausalAttention::new(4, 2, hd)?.with_rope(10_000.0, 64)?,
            o: Linear::new(4 * hd, d, false)?,
            n2: RmsNorm::new(d, 1e-6)?,
            up: Linear::new(d, 2 * d, true)?,
            down: Linear::new(2 * d, d, true)?,
            drop: Dropout::new(drop)?,
        })
    };
    Ok(Lm {
        tok: Embedding::new(VOCAB, d)?,
        wpe: PositionEmbedding::new(64, d)?,
        blocks: Stack::from_fn(layers, |_| block())?,
        norm: RmsNorm::new(d, 1e-6)?,
        head: Linear::new(d, VOCAB, false)?,
    })
}

/// `[batch, seq]` token ids, reproducible.
fn ids(batch: usize, seq: usize, seed: u64) -> Tensor {
    let key = tessera::RngKey::new(seed, 3);
    let v: Vec<u32> = (0..(batch * seq) as u64).map(|i| (key.uniform_at(i) * VOCAB as f32) as u32 % VOCAB as u32).collect();
    Tensor::from_vec(v, [batch, seq], &Device::cpu()).unwrap()
}

#[test]
fn a_split_sequence_computes_what_one_rank_computes() {
    // f64: the ring's merges and the single kernel's online softmax round
    // differently, and f64 makes that difference far below the tolerance.
    let runs = ["cp2", "cp4", "cp3"];
    let make = |_: &Rank| lm(2, 0.0);
    check_parallel_staged(make, &ids(2, 24, 1), &Check::new(runs).with_dtype(DType::F64).with_tolerance(1e-10)).unwrap();
}

#[test]
fn context_parallelism_combines_with_every_other_axis() {
    let runs = ["cp2,tp2+sp", "cp2,dp2", "cp2,pp2+mb=2", "cp2,tp2+sp+overlap=2", "cp2,dp2,tp2"];
    let make = |_: &Rank| lm(2, 0.1);
    check_parallel_staged(make, &ids(4, 16, 2), &Check::new(runs).with_dtype(DType::F64).with_tolerance(1e-10)).unwrap();
}

#[test]
fn f32_with_dropout_and_selective_recompute_agrees_with_one_rank() {
    let make = |_: &Rank| {
        let Lm { tok, wpe, blocks, norm, head } = lm(1, 0.2)?;
        Ok(RecomputeLm { tok, wpe, blocks, norm, head })
    };
    check_parallel_staged(make, &ids(2, 32, 3), &Check::new(["cp2", "cp4", "cp2,tp2+sp"]).with_rounding_allowance(8.0)).unwrap();
}

#[test]
fn sequences_that_do_not_cut_into_two_chunks_per_rank_are_refused() {
    let make = |_: &Rank| lm(1, 0.0);
    let err = check_parallel_staged(make, &ids(2, 12, 4), &Check::new(["cp4"])).unwrap_err().to_string();
    assert!(err.contains("2 · cp = 8"), "{err}");
}

#[test]
fn the_split_is_balanced_and_covers_the_sequence() {
    let dev = Device::cpu();
    let x = Tensor::from_vec((0..32u32).collect::<Vec<_>>(), [1, 32], &dev).unwrap();
    let shares: Vec<Tensor> = (0..4).map(|r| ContextSplit::new(r, 4).unwrap().local_of(&x, 1).unwrap()).collect();
    assert_eq!(shares[0].to_vec::<u32>().unwrap(), [0, 1, 2, 3, 28, 29, 30, 31]);
    assert_eq!(shares[3].to_vec::<u32>().unwrap(), [12, 13, 14, 15, 16, 17, 18, 19]);
    assert_eq!(ContextSplit::global_of(&shares, 1).unwrap().to_vec::<u32>().unwrap(), (0..32).collect::<Vec<u32>>());
    assert_eq!(Groups::single().cp.size(), 1);
}
