use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
#[model(precision = fp8)]
pub struct Layer {
    up: Linear,
}

#[forward]
impl Layer {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.up(x)
    }
}

fn main() {}
