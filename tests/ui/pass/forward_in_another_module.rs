//! The struct in one module, its `#[forward]` in another that imports it
//! (and the layer types its fields name), and a second model whose
//! `#[forward]` names its struct by path.

mod layers {
    use tessera::nn::{LayerNorm, Linear};
    use tessera::prelude::*;

    #[derive(Module)]
    pub struct Mlp {
        pub(crate) ln: LayerNorm,
        #[shard(column)]
        pub(crate) up: Linear,
        #[shard(row)]
        pub(crate) down: Linear,
    }

    #[derive(Module)]
    pub struct Norm {
        pub(crate) ln: LayerNorm,
    }
}

mod forwards {
    use super::layers::Mlp;
    use tessera::nn::{LayerNorm, Linear};
    use tessera::prelude::*;

    #[forward]
    impl Mlp {
        fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
            x + all_reduce(self.down(gelu(self.up(self.ln(x)))))
        }
    }

    #[forward]
    impl crate::layers::Norm {
        fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
            self.ln(x)
        }
    }
}

fn assert_module<M: tessera::module::Module<In = tessera::module::Replicated>>() {}

fn main() {
    assert_module::<layers::Mlp>();
    assert_module::<layers::Norm>();
}
