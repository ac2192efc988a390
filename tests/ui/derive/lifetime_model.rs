use tessera::nn::LayerNorm;
use tessera::prelude::*;

#[derive(Module)]
pub struct Block<'a> {
    norm: &'a LayerNorm,
    ln: LayerNorm,
}

fn main() {}
