use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
pub struct Proj {
    #[shard(row)]
    down: Linear,
}

#[forward]
impl Proj {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        all_reduce(self.down(x))
    }
}

fn main() {}
