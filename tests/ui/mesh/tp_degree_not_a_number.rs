use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
#[model(tp = two)]
pub struct Layer {
    #[shard(column)]
    up: Linear,
}

#[forward]
impl Layer {
    fn forward(&self, x: Act<Replicated>) -> Act<SplitHidden> {
        self.up(x)
    }
}

fn main() {}
