use tessera::nn::{Moe, RmsNorm};
use tessera::prelude::*;

#[derive(Module)]
pub struct MoeBlock {
    norm: RmsNorm,
    #[recompute]
    moe: Moe,
}

#[forward]
impl MoeBlock {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + self.moe(self.norm(x))
    }
}

fn assert_module<M: Module<In = Replicated, Out = Replicated>>() {}

fn main() {
    assert_module::<MoeBlock>();
}
