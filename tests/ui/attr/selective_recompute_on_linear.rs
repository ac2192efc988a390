use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
pub struct Mlp {
    #[recompute(selective)]
    up: Linear,
}

#[forward]
impl Mlp {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.up(x)
    }
}

fn main() {}
