use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
#[model(tp = 4, dims(vocab = 50257, hidden = 768))]
pub struct Layer {
    #[shard(vocab)]
    up: Linear,
}

#[forward]
impl Layer {
    fn forward(&self, x: Act<Replicated>) -> Act<SplitHidden> {
        self.up(x)
    }
}

fn main() {}
