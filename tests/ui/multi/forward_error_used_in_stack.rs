use tessera::nn::{LayerNorm, Stack};
use tessera::prelude::*;

#[derive(Module)]
pub struct Block {
    ln: LayerNorm,
}

#[forward]
impl Block {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        relu(self.ln(x))
    }
}

#[derive(Module)]
pub struct Model {
    blocks: Stack<Block>,
}

#[forward]
impl Model {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.blocks(x)
    }
}

fn main() {}
