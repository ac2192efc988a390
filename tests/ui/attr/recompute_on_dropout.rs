use tessera::nn::Dropout;
use tessera::prelude::*;

#[derive(Module)]
pub struct Layer {
    #[recompute]
    up: Dropout,
}

#[forward]
impl Layer {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.up(x)
    }
}

fn main() {}
