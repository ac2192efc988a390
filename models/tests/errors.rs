//! Bad checkpoints and configs give typed errors that name the tensor or
//! field, and a failed load changes nothing.

mod common;
use common::*;
use safetensors::Dtype;
use serde_json::{json, Value};
use std::sync::Arc;
use tessera::dist::inproc::InProcess;
use tessera::module::{self, Cx, Groups};
use tessera::Device;
use tessera_models::gpt2::{Gpt2, Gpt2Config};
use tessera_models::hf::{self, HfModel};
use tessera_models::llama::{Llama, LlamaConfig};
use tessera_models::mixtral::{Mixtral, MixtralConfig};
use tessera_models::Error;

fn load<M: HfModel>(dir: &std::path::Path) -> Error {
    match hf::load_pretrained::<M>(dir, &Cx::new(Device::cpu())) {
        Ok(_) => panic!("loading `{}` should fail", dir.display()),
        Err(e) => e,
    }
}

/// A copy of fixture `name` with its weights edited by `edit`.
fn with_tensors(name: &str, edit: impl FnOnce(&mut Tensors)) -> TempDir {
    let dir = copy_fixture(name);
    let path = dir.path().join("model.safetensors");
    let mut tensors = read_tensors(&path);
    edit(&mut tensors);
    write_tensors(&path, &tensors);
    dir
}

/// A copy of fixture `name` with `config.json` edited by `edit`.
fn with_config(name: &str, edit: impl FnOnce(&mut Value)) -> TempDir {
    let dir = copy_fixture(name);
    let path = dir.path().join("config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    dir
}

#[test]
fn a_missing_tensor_is_named_with_its_parameter() {
    let dir = with_tensors("llama", |t| {
        t.remove("model.layers.1.self_attn.k_proj.weight");
    });
    let e = load::<Llama>(dir.path());
    assert!(e.to_string().contains("model.layers.1.self_attn.k_proj.weight"), "{e}");
    match e {
        Error::MissingTensor { tensor, param, .. } => {
            assert_eq!(tensor, "model.layers.1.self_attn.k_proj.weight");
            assert_eq!(param, "layers.1.self_attn.qkv_proj.weight");
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }
}

#[test]
fn a_wrong_shape_is_named_with_both_shapes() {
    // The MLP's Conv1D weight stored as [out, in] instead of [in, out].
    let dir = with_tensors("gpt2", |t| t.get_mut("transformer.h.0.mlp.c_fc.weight").unwrap().1 = vec![128, 32]);
    match load::<Gpt2>(dir.path()) {
        Error::TensorShape { tensor, expected, got, .. } => {
            assert_eq!(tensor, "transformer.h.0.mlp.c_fc.weight");
            assert_eq!((expected, got), (vec![32, 128], vec![128, 32]));
        }
        other => panic!("expected TensorShape, got {other:?}"),
    }
}

#[test]
fn a_config_larger_than_its_weights_fails_before_allocating() {
    // A config claiming a model of some 10^13 parameters: its weights would
    // not fit any machine, so the old order (materialise, then read) died
    // in the allocator. The shapes are checked against the file first.
    let dir = with_config("llama", |c| {
        c["hidden_size"] = json!(1 << 20);
        c["head_dim"] = json!(1 << 18);
        c["intermediate_size"] = json!(1 << 22);
        c["num_hidden_layers"] = json!(1 << 10);
    });
    let started = std::time::Instant::now();
    let e = load::<Llama>(dir.path());
    assert!(matches!(e, Error::TensorShape { .. }), "{e:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "took {:?}", started.elapsed());
}

#[test]
fn unexpected_tensors_are_listed() {
    let dir = with_tensors("llama", |t| {
        let extra = t["model.layers.1.mlp.up_proj.weight"].clone();
        t.insert("model.layers.2.mlp.up_proj.weight".into(), extra);
    });
    match load::<Llama>(dir.path()) {
        Error::UnexpectedTensors { tensors, .. } => assert_eq!(tensors, vec!["model.layers.2.mlp.up_proj.weight".to_string()]),
        other => panic!("expected UnexpectedTensors, got {other:?}"),
    }
}

#[test]
fn an_integer_weight_is_refused() {
    let dir = with_tensors("gpt2", |t| t.get_mut("transformer.ln_f.weight").unwrap().0 = Dtype::I32);
    match load::<Gpt2>(dir.path()) {
        Error::TensorDtype { tensor, dtype, .. } => assert_eq!((tensor.as_str(), dtype.as_str()), ("transformer.ln_f.weight", "I32")),
        other => panic!("expected TensorDtype, got {other:?}"),
    }
}

#[test]
fn a_failed_load_changes_no_parameter() {
    let cx = Cx::new(Device::cpu());
    let config: LlamaConfig = hf::read_config(fixture("llama")).unwrap();
    let model = module::build(Llama::new(&config).unwrap(), &cx).unwrap();
    let before = param_bits(&model);
    // The final norm comes after every block, whose tensors are read first.
    let dir = with_tensors("llama", |t| {
        t.remove("model.norm.weight");
    });
    assert!(matches!(hf::load_weights(&model, &config, dir.path()), Err(Error::MissingTensor { .. })));
    assert_eq!(param_bits(&model), before);
}

/// The config field a bad `config.json` is reported under.
fn bad_field<M: HfModel>(name: &str, edit: impl FnOnce(&mut Value)) -> String {
    match load::<M>(with_config(name, edit).path()) {
        Error::Config { field, .. } => field,
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn bad_config_fields_are_named() {
    assert_eq!(bad_field::<Gpt2>("gpt2", |c| c["n_head"] = json!(5)), "n_head");
    assert_eq!(bad_field::<Gpt2>("gpt2", |c| c["n_head"] = json!("four")), "n_head");
    assert_eq!(bad_field::<Gpt2>("gpt2", |c| c["activation_function"] = json!("relu")), "activation_function");
    assert_eq!(bad_field::<Gpt2>("gpt2", |c| c["layer_norm_epsilon"] = json!(-1.0)), "layer_norm_epsilon");
    assert_eq!(bad_field::<Gpt2>("gpt2", |c| c["scale_attn_by_inverse_layer_idx"] = json!(true)), "scale_attn_by_inverse_layer_idx");
    assert_eq!(bad_field::<Llama>("llama", |c| c["num_key_value_heads"] = json!(3)), "num_key_value_heads");
    assert_eq!(bad_field::<Llama>("llama", |c| c["hidden_act"] = json!("gelu")), "hidden_act");
    assert_eq!(bad_field::<Llama>("llama", |c| c["attention_bias"] = json!(true)), "attention_bias");
    assert_eq!(bad_field::<Llama>("llama", |c| c["rope_scaling"] = json!({"rope_type": "linear", "factor": 2.0})), "rope_scaling");
    assert_eq!(bad_field::<Llama>("llama", |c| c["rope_parameters"]["rope_type"] = json!("yarn")), "rope_parameters.rope_type");
    assert_eq!(bad_field::<Mixtral>("mixtral", |c| c["num_experts_per_tok"] = json!(5)), "num_experts_per_tok");
    assert_eq!(bad_field::<Mixtral>("mixtral", |c| c["sliding_window"] = json!(16)), "sliding_window");
    // A checkpoint of another model.
    assert_eq!(bad_field::<Gpt2>("llama", |_| {}), "model_type");

    let e = Gpt2Config::from_json(&json!([1, 2])).unwrap_err();
    assert!(matches!(&e, Error::Config { field, .. } if field == "(top level)"), "{e:?}");
    let e = Gpt2::new(&Gpt2Config { n_embd: 30, ..Gpt2Config::tiny(64, 32, 4, 1, 8) }).err().expect("30 is not a multiple of 4 heads");
    assert!(e.to_string().contains("n_head") && e.to_string().contains("30"), "{e}");
    let e = Mixtral::new(&MixtralConfig { num_local_experts: 0, ..MixtralConfig::tiny(64, 32, 4, 2, 48, 4, 2, 1, 8) }).err().expect("no experts");
    assert!(matches!(&e, Error::Config { field, .. } if field == "num_local_experts"), "{e:?}");
}

#[test]
fn missing_and_malformed_files_are_named() {
    let empty = TempDir::new("empty");
    let e = load::<Gpt2>(empty.path());
    assert!(matches!(&e, Error::Io { path, source, .. } if path.ends_with("config.json") && source.kind() == std::io::ErrorKind::NotFound), "{e:?}");

    let dir = copy_fixture("gpt2");
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let e = load::<Gpt2>(dir.path());
    assert!(matches!(&e, Error::Io { path, source, .. } if path.ends_with("model.safetensors") && source.kind() == std::io::ErrorKind::NotFound), "{e:?}");

    std::fs::write(dir.path().join("model.safetensors"), b"not a safetensors file").unwrap();
    let e = load::<Gpt2>(dir.path());
    assert!(matches!(&e, Error::File { detail, .. } if detail.contains("safetensors")), "{e:?}");

    std::fs::write(dir.path().join("config.json"), b"{ n_embd: ").unwrap();
    let e = load::<Gpt2>(dir.path());
    assert!(matches!(&e, Error::File { detail, .. } if detail.contains("JSON")), "{e:?}");
}

/// Export needs every parameter whole: not a tensor-parallel rank's
/// shards, not an expert-parallel rank's experts.
#[test]
fn export_refuses_a_sharded_model() {
    let world = InProcess::new(2).unwrap();
    std::thread::scope(|s| {
        for rank in 0..2 {
            let world = &world;
            s.spawn(move || {
                let dev = Device::cpu();
                let mut groups = Groups::single();
                groups.tp = Arc::new(world.communicator(rank, &dev).unwrap());
                let cx = Cx::new(dev).with_groups(groups);
                let config = Gpt2Config::tiny(64, 32, 4, 1, 8);
                let model = module::build(Gpt2::new(&config).unwrap(), &cx).unwrap();
                let out = TempDir::new("sharded-export");
                match hf::save_pretrained(&model, &config, out.path()) {
                    Err(Error::Export(detail)) => assert!(detail.contains("wte.weight") && detail.contains("single rank"), "{detail}"),
                    other => panic!("expected an export error, got {other:?}"),
                }
            });
        }
    });

    let config = MixtralConfig::tiny(64, 32, 4, 2, 48, 4, 2, 1, 8);
    let model = module::build(Mixtral::with_expert_parallel(&config, 1, 2).unwrap(), &Cx::new(Device::cpu())).unwrap();
    let out = TempDir::new("ep-export");
    match hf::save_pretrained(&model, &config, out.path()) {
        Err(Error::Export(detail)) => assert!(detail.contains("expert-parallel rank 1 of 2"), "{detail}"),
        other => panic!("expected an export error, got {other:?}"),
    }
}
