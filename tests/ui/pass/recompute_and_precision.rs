use tessera::nn::{CausalAttention, LayerNorm, Linear, Stack};
use tessera::prelude::*;

#[derive(Module)]
pub struct Attn {
    ln: LayerNorm,
    #[shard(column)]
    qkv: Linear,
    #[recompute(selective)]
    attn: CausalAttention,
    #[shard(row)]
    proj: Linear,
}

#[forward]
impl Attn {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + all_reduce(self.proj(self.attn(self.qkv(self.ln(x)))))
    }
}

#[derive(Module)]
#[model(precision = bf16, loss_scaling = dynamic)]
pub struct Model {
    #[recompute]
    blocks: Stack<Attn>,
    #[recompute(selective)]
    last: Attn,
    #[precision(f32)]
    norm: LayerNorm,
    #[precision(f16)]
    #[recompute]
    out: Linear,
}

#[forward]
impl Model {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.out(self.norm(self.last(self.blocks(x))))
    }
}

fn assert_module<M: Module<In = Replicated, Out = Replicated>>() {}

fn main() {
    assert_module::<Model>();
}
