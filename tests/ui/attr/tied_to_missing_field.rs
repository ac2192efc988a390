use tessera::nn::{Embedding, Linear};
use tessera::prelude::*;

#[derive(Module)]
pub struct Lm {
    #[shard(vocab)]
    tok: Embedding,
    #[shard(vocab)]
    #[tied(embed)]
    head: Linear,
}

#[forward]
impl Lm {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        self.head(all_reduce(self.tok(ids)))
    }
}

fn main() {}
