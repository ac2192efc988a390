use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
#[model(loss_scaling = none)]
pub struct Layer {
    #[precision(f16)]
    up: Linear,
}

#[forward]
impl Layer {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.up(x)
    }
}

fn main() {}
