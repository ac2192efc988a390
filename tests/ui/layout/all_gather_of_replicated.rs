use tessera::nn::LayerNorm;
use tessera::prelude::*;

#[derive(Module)]
pub struct Norm {
    ln: LayerNorm,
}

#[forward]
impl Norm {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        all_gather(self.ln(x))
    }
}

fn main() {}
