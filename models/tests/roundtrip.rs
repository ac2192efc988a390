//! Export and import: a model exported and loaded again is bit-identical,
//! its export holds exactly the tensors of the checkpoint it came from, and
//! configs survive both ways.

mod common;
use common::*;
use tessera::module::{self, Cx};
use tessera::Device;
use tessera_models::gpt2::{Gpt2, Gpt2Config};
use tessera_models::hf::{self, HfConfig, HfModel};
use tessera_models::llama::{Llama, LlamaConfig};
use tessera_models::mixtral::Mixtral;

/// Loads fixture `name`, exports it, and checks the export tensor by
/// tensor against the fixture, then loads the export and checks every
/// parameter bit for bit.
fn round_trip<M: HfModel>(name: &str)
where
    M::Config: PartialEq + std::fmt::Debug,
{
    let cx = Cx::new(Device::cpu());
    let loaded = hf::load_pretrained::<M>(fixture(name), &cx).unwrap();
    let out = TempDir::new(&format!("{name}-export"));
    hf::save_pretrained(&loaded.model, &loaded.config, out.path()).unwrap();

    let original = read_tensors(&fixture(name).join("model.safetensors"));
    let exported = read_tensors(&out.path().join("model.safetensors"));
    assert_eq!(exported.keys().collect::<Vec<_>>(), original.keys().collect::<Vec<_>>(), "{name}: the same tensor names");
    for (tensor, t) in &original {
        assert!(exported[tensor] == *t, "{name}: `{tensor}` differs from the original");
    }

    let again = hf::load_pretrained::<M>(out.path(), &cx).unwrap();
    assert_eq!(again.config, loaded.config, "{name}: config");
    assert_eq!(param_bits(&again.model), param_bits(&loaded.model), "{name}: parameters");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(out.path().join("config.json")).unwrap()).unwrap();
    assert!(json.get("model_type").is_some() && json.get("architectures").is_some(), "{name}: Hugging Face's class fields are kept");
}

#[test]
fn gpt2_round_trips() {
    round_trip::<Gpt2>("gpt2");
}

#[test]
fn llama_round_trips() {
    round_trip::<Llama>("llama");
}

#[test]
fn mixtral_round_trips() {
    round_trip::<Mixtral>("mixtral");
}

/// A tied head is the embedding under a second name: exported once (no
/// `lm_head.weight`, as Hugging Face writes it) and tied again on import.
#[test]
fn a_tied_llama_exports_its_embedding_once() {
    let cx = Cx::new(Device::cpu());
    let config = LlamaConfig { tie_word_embeddings: true, ..LlamaConfig::tiny(32, 16, 4, 2, 24, 1, 8) };
    let model = module::build(Llama::new(&config).unwrap(), &cx).unwrap();
    let out = TempDir::new("tied-llama");
    hf::save_pretrained(&model, &config, out.path()).unwrap();
    let names: Vec<String> = read_tensors(&out.path().join("model.safetensors")).into_keys().collect();
    assert!(names.contains(&"model.embed_tokens.weight".to_string()) && !names.contains(&"lm_head.weight".to_string()), "{names:?}");

    let again = hf::load_pretrained::<Llama>(out.path(), &cx).unwrap();
    let tied: Vec<Vec<String>> = module::distinct_params(&again.model).unwrap().into_iter().filter(|p| p.is_tied()).map(|p| p.names).collect();
    assert_eq!(tied, vec![vec!["embed_tokens.weight".to_string(), "lm_head.weight".to_string()]]);
    assert_eq!(param_bits(&again.model), param_bits(&model));
}

/// A checkpoint split over files by `model.safetensors.index.json` loads
/// as the single file does.
#[test]
fn a_sharded_checkpoint_loads() {
    let dir = TempDir::new("sharded");
    std::fs::copy(fixture("llama").join("config.json"), dir.path().join("config.json")).unwrap();
    let tensors = read_tensors(&fixture("llama").join("model.safetensors"));
    let mut weight_map = serde_json::Map::new();
    let (mut first, mut second) = (Tensors::new(), Tensors::new());
    for (i, (name, t)) in tensors.into_iter().enumerate() {
        let file = if i % 2 == 0 { "model-00001-of-00002.safetensors" } else { "model-00002-of-00002.safetensors" };
        weight_map.insert(name.clone(), file.into());
        if i % 2 == 0 { &mut first } else { &mut second }.insert(name, t);
    }
    write_tensors(&dir.path().join("model-00001-of-00002.safetensors"), &first);
    write_tensors(&dir.path().join("model-00002-of-00002.safetensors"), &second);
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();

    let cx = Cx::new(Device::cpu());
    let sharded = hf::load_pretrained::<Llama>(dir.path(), &cx).unwrap();
    let single = hf::load_pretrained::<Llama>(fixture("llama"), &cx).unwrap();
    assert_eq!(param_bits(&sharded.model), param_bits(&single.model));
}

/// A config built in code writes Hugging Face's class fields and reads back equal.
#[test]
fn configs_built_in_code_round_trip_through_json() {
    let config = Gpt2Config::tiny(64, 32, 4, 2, 16);
    let json = HfConfig::to_json(&config);
    assert_eq!(json["model_type"], "gpt2");
    assert_eq!(json["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(Gpt2Config::from_json(&json).unwrap(), config);
    let text = serde_json::to_string(&config).unwrap();
    assert_eq!(serde_json::from_str::<Gpt2Config>(&text).unwrap(), config);

    // Unused fields and the file's form of the RoPE base are kept.
    let llama = LlamaConfig::from_json(&serde_json::from_slice(&std::fs::read(fixture("llama").join("config.json")).unwrap()).unwrap()).unwrap();
    assert_eq!(llama.rope_theta, 10_000.0);
    let json = llama.to_json();
    assert_eq!(json["rope_parameters"]["rope_theta"], 10_000.0);
    assert!(json.get("rope_theta").is_none());
    assert_eq!(json["bos_token_id"], 0);
    assert_eq!(LlamaConfig::from_json(&json).unwrap(), llama);
}
