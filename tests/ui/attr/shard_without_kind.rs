use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
pub struct Layer {
    #[shard]
    up: Linear,
}

#[forward]
impl Layer {
    fn forward(&self, x: Act<Replicated>) -> Act<SplitHidden> {
        self.up(x)
    }
}

fn main() {}
