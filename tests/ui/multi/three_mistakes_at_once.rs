use tessera::nn::{Embedding, LayerNorm, Linear};
use tessera::prelude::*;

#[derive(Module)]
pub struct Lm {
    #[shard(vocab)]
    tok: Embedding,
    #[shard(colum)]
    up: Linear,
    #[stage(middle)]
    norm: LayerNorm,
    #[shard(vocab)]
    #[tied(embed)]
    head: Linear,
}

#[forward]
impl Lm {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        self.head(self.norm(all_reduce(self.tok(ids))))
    }
}

fn main() {}
