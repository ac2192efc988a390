use tessera::nn::LayerNorm;
use tessera::prelude::*;

pub struct Block {
    ln: LayerNorm,
}

#[forward]
impl Block {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.ln(x)
    }
}

fn main() {}
