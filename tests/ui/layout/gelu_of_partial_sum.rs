use tessera::nn::Linear;
use tessera::prelude::*;

/// gelu(a) + gelu(b) is not gelu(a + b): the reduction must come first.
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
        x + all_reduce(gelu(self.down(self.up(x))))
    }
}

fn main() {}
