use tessera::nn::CausalAttention;
use tessera::prelude::*;

#[derive(Module)]
pub struct Attn {
    attn: CausalAttention,
}

#[forward]
impl Attn {
    fn forward(&self, x: Act<Replicated>) -> Act<SplitHidden> {
        self.attn(x)
    }
}

fn main() {}
