use tessera::nn::{Embedding, LayerNorm};
use tessera::prelude::*;

#[derive(Module)]
pub struct Lm {
    #[shard(vocab)]
    tok: Embedding,
    #[tied(tok)]
    norm: LayerNorm,
}

#[forward]
impl Lm {
    fn forward(&self, ids: Act<Replicated>) -> Act<Replicated> {
        self.norm(all_reduce(self.tok(ids)))
    }
}

fn main() {}
