use tessera::nn::{Embedding, LayerNorm};
use tessera::prelude::*;

#[derive(Module)]
pub struct Lm {
    tok: Embedding,
    #[tied(tok)]
    norm: LayerNorm,
}

#[forward]
impl Lm {
    fn forward(&self, ids: Act<Replicated>) -> Act<Replicated> {
        self.norm(self.tok(ids))
    }
}

fn main() {}
