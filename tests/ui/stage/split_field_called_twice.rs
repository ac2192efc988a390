use tessera::nn::{LayerNorm, Stack};
use tessera::prelude::*;

#[derive(Module)]
pub struct Staged {
    #[stage(split)]
    blocks: Stack<LayerNorm>,
    #[stage(last)]
    norm: LayerNorm,
}

#[forward]
impl Staged {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.norm(self.blocks(self.blocks(x)))
    }
}

fn main() {}
