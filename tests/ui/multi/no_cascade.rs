use tessera::nn::Linear;
use tessera::prelude::*;

#[derive(Module)]
pub struct Mlp {
    #[shard(column)]
    up: Linear,
    #[shard(row)]
    down: Linear,
}

#[forward]
impl Mlp {
    fn forward(&self, x: Act<Replicated>) -> Act<Replicated> {
        x + self.down(self.up(x))
    }
}

fn main() {
    let cx = Cx::new(Device::cpu());
    let mlp = Mlp { up: Linear::new(8, 32, true).unwrap(), down: Linear::new(32, 8, true).unwrap() };
    let _ = tessera::module::build(mlp, &cx);
}
