use tessera::nn::{CausalAttention, Linear, RmsNorm};
use tessera::prelude::*;

#[derive(Module)]
pub struct LlamaBlock {
    n1: RmsNorm,
    #[shard(column)]
    qkv: Linear,
    attn: CausalAttention,
    #[shard(row)]
    o: Linear,
    n2: RmsNorm,
    #[shard(column)]
    gate: Linear,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl LlamaBlock {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + all_reduce(self.o(self.attn(self.qkv(self.n1(x)))));
        let n = self.n2(h);
        h + all_reduce(self.down(swiglu(self.gate(n), self.up(n))))
    }
}

fn assert_module<M: Module<In = Replicated, Out = Replicated>>() {}

fn main() {
    assert_module::<LlamaBlock>();
}
