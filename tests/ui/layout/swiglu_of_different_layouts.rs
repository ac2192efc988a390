use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
pub struct Gate {
    #[shard(column)]
    gate: Linear,
    up: Linear,
}

#[forward]
impl Gate {
    fn forward(&self, x: Act<Replicated>) -> Act<SplitHidden> {
        swiglu(self.gate(x), self.up(x))
    }
}

fn main() {}
