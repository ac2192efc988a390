use tessera::nn::{LayerNorm, Linear};
use tessera::prelude::*;

/// An MLP whose reduction is split over the sequence and gathered back.
#[derive(Module)]
pub struct SeqParallelMlp {
    ln: LayerNorm,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl SeqParallelMlp {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let partial = self.down(silu(self.up(self.ln(x))) * self.up(x));
        x + all_gather(reduce_scatter(partial))
    }
}

fn assert_module<M: Module<In = Replicated, Out = Replicated>>() {}

fn main() {
    assert_module::<SeqParallelMlp>();
}
