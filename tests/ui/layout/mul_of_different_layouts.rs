use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
pub struct Gate {
    #[shard(column)]
    up: Linear,
}

#[forward]
impl Gate {
    fn forward(&self, x: Act<Replicated>) -> Act<SplitHidden> {
        self.up(x) * x
    }
}

fn main() {}
