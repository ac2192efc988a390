use tessera::nn::LayerNorm;
use tessera::prelude::*;

#[derive(Module)]
pub struct Block {
    ln: LayerNorm,
    ln2: LayerNorm,
}

#[forward]
impl Block {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.ln(self.ln2(x));
    }
}

fn main() {}
