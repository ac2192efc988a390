use tessera::nn::LayerNorm;
use tessera::prelude::*;

#[derive(Module)]
pub struct Norm {
    ln: LayerNorm,
}

#[forward]
impl Norm {
    fn forward(&self, x: Act<Replicated>) -> Act<SplitSeq> {
        reduce_scatter(self.ln(x))
    }
}

fn main() {}
