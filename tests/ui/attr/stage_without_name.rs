use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
pub struct Layer {
    #[stage]
    up: Linear,
}

#[forward]
impl Layer {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.up(x)
    }
}

fn main() {}
