use tessera::nn::{LayerNorm, Stack};
use tessera::prelude::*;

#[derive(Module)]
pub struct Staged {
    #[stage(first)]
    a: LayerNorm,
    #[stage(split)]
    blocks: Stack<LayerNorm>,
    #[stage(last)]
    c: LayerNorm,
}

#[forward]
impl Staged {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        let h = self.a(x);
        let late = self.c(h) + h;
        self.blocks(late)
    }
}

fn main() {}
