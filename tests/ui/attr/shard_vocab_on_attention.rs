use tessera::nn::CausalAttention;
use tessera::prelude::*;

#[derive(Module)]
pub struct Attn {
    #[shard(vocab)]
    attn: CausalAttention,
}

#[forward]
impl Attn {
    fn forward(&self, x: Act<SplitHidden>) -> Act<SplitHidden> {
        self.attn(x)
    }
}

fn main() {}
