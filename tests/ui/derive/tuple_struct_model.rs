use tessera::nn::{LayerNorm, Linear};
use tessera::prelude::*;

#[derive(Module)]
pub struct Block(LayerNorm, Linear);

fn main() {}
