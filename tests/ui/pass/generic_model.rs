use tessera::nn::{Embedding, LayerNorm, Linear, RmsNorm, Stack};
use tessera::prelude::*;

/// A block of the residual stream: what a generic language model stacks.
pub trait Block: Module<In = Replicated, Out = Replicated> {}
impl<B: Module<In = Replicated, Out = Replicated>> Block for B {}

#[derive(Module)]
pub struct Mlp<N> {
    norm: N,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl<N: Module<In = Replicated, Out = Replicated>> Mlp<N> {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + all_reduce(self.down(gelu(self.up(self.norm(x)))))
    }
}

/// One definition, any block.
#[derive(Module)]
pub struct Lm<B: Block> {
    #[stage(first)]
    #[shard(vocab)]
    tok: Embedding,
    #[stage(split)]
    #[recompute]
    blocks: Stack<B>,
    #[stage(last)]
    norm: RmsNorm,
    #[stage(last)]
    #[shard(vocab)]
    #[tied(tok)]
    head: Linear,
}

#[forward]
impl<B: Block> Lm<B> {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        self.head(self.norm(self.blocks(all_reduce(self.tok(ids)))))
    }
}

fn staged<M: Staged<In = Replicated, Out = SplitHidden>>() {}

fn main() {
    staged::<Lm<Mlp<LayerNorm>>>();
    staged::<Lm<Mlp<RmsNorm>>>();
}
