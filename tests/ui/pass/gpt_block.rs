use tessera::nn::{CausalAttention, LayerNorm, Linear};
use tessera::prelude::*;

#[derive(Module)]
pub struct GptBlock {
    ln1: LayerNorm,
    #[shard(column)]
    qkv: Linear,
    attn: CausalAttention,
    #[shard(row)]
    proj: Linear,
    ln2: LayerNorm,
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl GptBlock {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = x + all_reduce(self.proj(self.attn(self.qkv(self.ln1(x)))));
        h + all_reduce(self.down(gelu(self.up(self.ln2(h)))))
    }
}

fn assert_module<M: Module<In = Replicated, Out = Replicated>>() {}

fn main() {
    assert_module::<GptBlock>();
}
