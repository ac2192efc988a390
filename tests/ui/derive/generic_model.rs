use tessera::nn::LayerNorm;
use tessera::prelude::*;

#[derive(Module)]
pub struct Block<N> {
    norm: N,
    ln: LayerNorm,
}

fn main() {}
