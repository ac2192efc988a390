use tessera::nn::{Embedding, Linear};
use tessera::prelude::*;

/// The head would be split by rows of the vocabulary on each rank while the
/// embedding it shares its weight with is whole: one weight, two layouts.
#[derive(Module)]
pub struct Lm {
    tok: Embedding,
    #[shard(vocab)]
    #[tied(tok)]
    head: Linear,
}

#[forward]
impl Lm {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        self.head(self.tok(ids))
    }
}

fn main() {}
