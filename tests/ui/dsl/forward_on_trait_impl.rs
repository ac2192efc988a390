use tessera::nn::LayerNorm;
use tessera::prelude::*;

#[derive(Module)]
pub struct Block {
    ln: LayerNorm,
}

pub trait Layer {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated>;
}

#[forward]
impl Layer for Block {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.ln(x)
    }
}

fn main() {}
