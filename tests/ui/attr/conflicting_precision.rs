use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
pub struct Layer {
    #[precision(f32)]
    #[precision(bf16)]
    up: Linear,
}

#[forward]
impl Layer {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.up(x)
    }
}

fn main() {}
