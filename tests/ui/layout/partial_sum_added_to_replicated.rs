use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
pub struct Mlp {
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl Mlp {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + self.down(self.up(x))
    }
}

fn main() {}
