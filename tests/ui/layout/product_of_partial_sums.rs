use tessera::nn::Linear;
use tessera::prelude::*;

/// (a₁ + a₂)·(b₁ + b₂) is not a₁·b₁ + a₂·b₂.
#[derive(Module)]
pub struct Gate {
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
    #[shard(row)]
    gate: Linear,
}

#[forward]
impl Gate {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = self.up(x);
        x + all_reduce(self.down(h) * self.gate(h))
    }
}

fn main() {}
