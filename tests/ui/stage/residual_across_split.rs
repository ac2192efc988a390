use tessera::nn::{LayerNorm, Stack};
use tessera::prelude::*;

#[derive(Module)]
pub struct Staged {
    #[stage(first)]
    norm: LayerNorm,
    #[stage(split)]
    blocks: Stack<LayerNorm>,
}

#[forward]
impl Staged {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = self.norm(x);
        h + self.blocks(h)
    }
}

fn main() {}
