use tessera::nn::LayerNorm;
use tessera::prelude::*;

#[derive(Module)]
pub struct Staged {
    #[stage(first)]
    a: LayerNorm,
    #[stage(split)]
    b: LayerNorm,
}

#[forward]
impl Staged {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.b(self.a(x))
    }
}

fn main() {}
