use tessera::nn::{Embedding, LayerNorm, Linear, Stack};
use tessera::prelude::*;

#[derive(Module)]
pub struct Mlp {
    ln: LayerNorm,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl Mlp {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + all_reduce(self.down(gelu(self.up(self.ln(x)))))
    }
}

#[derive(Module)]
pub struct Lm {
    #[stage(first)]
    #[shard(vocab)]
    tok: Embedding,
    #[stage(split)]
    blocks: Stack<Mlp>,
    #[stage(last)]
    norm: LayerNorm,
    #[stage(last)]
    #[shard(vocab)]
    #[tied(tok)]
    head: Linear,
}

#[forward]
impl Lm {
    fn forward(&self, ids: Act<Replicated>) -> Act<SplitHidden> {
        let h = all_reduce(self.tok(ids));
        self.head(self.norm(self.blocks(h)))
    }
}

fn main() {
    let lm = Lm {
        tok: Embedding::new(16, 4).unwrap(),
        blocks: Stack::from_fn(2, |_| {
            Ok(Mlp { ln: LayerNorm::new(4, 1e-5, true)?, up: Linear::new(4, 8, true)?, down: Linear::new(8, 4, true)? })
        })
        .unwrap(),
        norm: LayerNorm::new(4, 1e-5, true).unwrap(),
        head: Linear::new(4, 16, false).unwrap(),
    };
    let lm = tessera::module::build(lm, &Cx::new(Device::cpu())).unwrap();
    assert!(lm.head.weight().same(lm.tok.weight()), "the head shares the embedding's weight");
}
