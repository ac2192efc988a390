//! A layer given a role it does not have, inside a block that a parent
//! stacks, recomputes and ties around: one error, at the attribute, and
//! nothing in the parent (the block's `Module` impl does not depend on it).

use tessera::nn::{Embedding, LayerNorm, Linear, Stack};
use tessera::prelude::*;

#[derive(Module)]
pub struct Block {
    #[shard(column)]
    ln: LayerNorm,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl Block {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + all_reduce(self.down(self.ln(x)))
    }
}

#[derive(Module)]
pub struct Lm {
    #[stage(first)]
    #[shard(vocab)]
    tok: Embedding,
    #[stage(split)]
    #[recompute(selective)]
    blocks: Stack<Block>,
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
        self.head(self.norm(self.blocks(all_reduce(self.tok(ids)))))
    }
}

fn main() {
    let block = || Block {
        ln: LayerNorm::new(8, 1e-5, true).unwrap(),
        down: Linear::new(8, 8, true).unwrap(),
    };
    let lm = Lm {
        tok: Embedding::new(16, 8).unwrap(),
        blocks: Stack::from_fn(2, |_| Ok(block())).unwrap(),
        norm: LayerNorm::new(8, 1e-5, true).unwrap(),
        head: Linear::new(8, 16, false).unwrap(),
    };
    let _ = tessera::module::build(lm, &Cx::new(Device::cpu()));
}
