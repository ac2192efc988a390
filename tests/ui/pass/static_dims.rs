use tessera::nn::{Embedding, Linear};
use tessera::prelude::*;

#[derive(Module)]
#[model(tp = 4, dims(vocab = 50304, hidden = 768, heads = 12))]
pub struct Lm {
    #[shard(vocab)]
    tok: Embedding,
    #[shard(vocab)]
    #[tied(tok)]
    head: Linear,
}

#[forward]
impl Lm {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        self.head(all_reduce(self.tok(ids)))
    }
}

const _: () = assert!(Lm::TP == 4 && Lm::VOCAB == 50304 && Lm::HIDDEN == 768 && Lm::HEADS == 12);

fn main() {
    let lm = Lm { tok: Embedding::new(Lm::VOCAB, Lm::HIDDEN).unwrap(), head: Linear::new(Lm::HIDDEN, Lm::VOCAB, false).unwrap() };
    let _ = lm;
}
