use tessera::nn::LayerNorm;
use tessera::prelude::*;

#[derive(Module)]
pub struct Staged {
    #[stage(first)]
    a: LayerNorm,
    #[stage(last)]
    b: LayerNorm,
}

#[forward]
impl Staged {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.a(self.b(x))
    }
}

fn main() {}
