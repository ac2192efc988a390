//! The derive and `#[forward]` inside a nested module, the model used from outside.

mod blocks {
    use tessera::nn::{LayerNorm, Linear};
    use tessera::prelude::*;

    #[derive(Module)]
    pub struct Mlp {
        ln: LayerNorm,
        #[shard(column)]
        up: Linear,
        #[shard(row)]
        down: Linear,
    }

    #[forward]
    impl Mlp {
        fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
            x + all_reduce(self.down(gelu(self.up(self.ln(x)))))
        }
    }
}

fn assert_module<M: tessera::module::Module<In = tessera::module::Replicated>>() {}

fn main() {
    assert_module::<blocks::Mlp>();
}
