use tessera::nn::Linear;
use tessera::prelude::*;

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
        x + all_reduce(swiglu(self.gate(h), self.down(h)))
    }
}

fn main() {}
