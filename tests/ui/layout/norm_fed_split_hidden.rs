use tessera::nn::{LayerNorm, Linear};
use tessera::prelude::*;

#[derive(Module)]
pub struct Block {
    #[shard(column)]
    up: Linear,
    ln: LayerNorm,
}

#[forward]
impl Block {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.ln(self.up(x))
    }
}

fn main() {}
