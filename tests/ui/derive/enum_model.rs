use tessera::nn::{LayerNorm, RmsNorm};
use tessera::prelude::*;

#[derive(Module)]
pub enum Norm {
    Layer(LayerNorm),
    Rms(RmsNorm),
}

fn main() {}
