//! Bounded mutation fuzzing (see `tessera::testing::fuzz`) of the Hugging
//! Face loaders: `config.json` of each family and the `model.safetensors`
//! file itself. Each may refuse an input; none may panic, hang or try to
//! allocate what a damaged header claims.

mod common;
use common::*;
use std::time::Duration;
use tessera::module::Cx;
use tessera::testing::fuzz::{cases, fuzz};
use tessera::Device;
use tessera_models::gpt2::Gpt2;
use tessera_models::hf::{self, HfModel};
use tessera_models::llama::Llama;
use tessera_models::mixtral::Mixtral;

const LIMIT: Duration = Duration::from_secs(5);

/// Fuzzes `file` of fixture `name`, loading the whole checkpoint each time.
fn target<M: HfModel>(name: &str, file: &str, n: usize) {
    let dir = copy_fixture(name);
    let path = dir.path().join(file);
    let seed = std::fs::read(&path).unwrap();
    let cx = Cx::new(Device::cpu());
    fuzz(&format!("{name} {file}"), &[seed], cases(n), LIMIT, |bytes| {
        std::fs::write(&path, bytes).unwrap();
        hf::load_pretrained::<M>(dir.path(), &cx).is_ok()
    });
}

#[test]
fn config_json() {
    target::<Gpt2>("gpt2", "config.json", 1500);
    target::<Llama>("llama", "config.json", 1500);
    target::<Mixtral>("mixtral", "config.json", 1500);
}

#[test]
fn model_safetensors() {
    target::<Gpt2>("gpt2", "model.safetensors", 600);
    target::<Llama>("llama", "model.safetensors", 600);
    target::<Mixtral>("mixtral", "model.safetensors", 600);
}
