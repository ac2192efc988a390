use tessera::nn::{LayerNorm, Stack};
use tessera::prelude::*;

#[derive(Module)]
pub struct Staged {
    #[stage(split)]
    lower: Stack<LayerNorm>,
    #[stage(split)]
    upper: Stack<LayerNorm>,
}

#[forward]
impl Staged {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        self.upper(self.lower(x))
    }
}

fn main() {}
