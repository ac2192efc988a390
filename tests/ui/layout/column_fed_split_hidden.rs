use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
pub struct Block {
    #[shard(column)]
    a: Linear,
    #[shard(column)]
    b: Linear,
}

#[forward]
impl Block {
    fn forward(&self, x: Act<Replicated>) -> Act<SplitHidden> {
        self.b(self.a(x))
    }
}

fn main() {}
