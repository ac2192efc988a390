use tessera::nn::LayerNorm;
use tessera::prelude::*;

#[derive(Module)]
pub struct Norm {
    #[shard(column)]
    ln: LayerNorm,
}

#[forward]
impl Norm {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.ln(x)
    }
}

fn main() {}
