use tessera::nn::LayerNorm;
use tessera::prelude::*;

#[derive(Module)]
pub struct Block {
    ln: LayerNorm,
    ln2: LayerNorm,
}

#[forward]
impl Block {
    fn forward(&self, x: Act<Replicated>, y: Act<Replicated>) -> Act<Replicated> {
        self.ln(x) + self.ln2(y)
    }
}

fn main() {}
