use tessera::prelude::*;

#[derive(Module)]
pub struct Nothing;

fn main() {}
