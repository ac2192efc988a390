//! Models chosen by name from a training configuration (`kinds`), and
//! Hugging Face weights read when each rank materialises its model
//! (`hf::load_when_materialized`): every rank of a tp2, ep2 or pp2 mesh holds
//! exactly its shard of what `load_pretrained` gives on one rank, and the
//! configuration's mistakes are errors naming the setting.

mod common;
use common::*;
use std::collections::BTreeMap;
use tessera::dist::inproc::{mesh_groups, InProcess};
use tessera::dist::mesh::Mesh;
use tessera::module::{self, Cx, Shard};
use tessera::train::TrainConfig;
use tessera::Device;
use tessera_models::gpt2::{Gpt2, Gpt2Config, MoeGpt2, MoeGpt2Config};
use tessera_models::hf;
use tessera_models::kinds::{self, KindModel, ModelJob, ModelKind, ModelSpec};
use tessera_models::mixtral::Mixtral;

/// Every parameter of `model` whole, by name, as f32 values.
fn whole_params<M: tessera::module::Module>(model: &M) -> BTreeMap<String, Vec<f32>> {
    module::distinct_params(model).unwrap().into_iter().map(|p| (p.name().to_string(), p.param.value().unwrap().to_f32_vec().unwrap())).collect()
}

/// Builds fixture `name` with `ModelSpec::build` on every rank of `spec`
/// (chunks per pipeline stage: 1) and checks that each rank holds, for each
/// parameter it materialised, its slice of the one-rank `load_pretrained`
/// values; returns how many parameters each rank left to other stages.
fn deferred_matches_one_rank<M: KindModel>(name: &str, spec: &str, world: usize) -> Vec<usize> {
    deferred_matches_one_rank_from::<M>(&fixture(name), spec, world)
}

/// [`deferred_matches_one_rank`] for the Hugging Face directory `dir`.
fn deferred_matches_one_rank_from<M: KindModel>(dir: &std::path::Path, spec: &str, world: usize) -> Vec<usize> {
    let name = dir.display().to_string();
    let name = name.as_str();
    let full = whole_params(&hf::load_pretrained::<M>(dir, &Cx::new(Device::cpu())).unwrap().model);
    let model_spec = ModelSpec::<M>::new(hf::read_config(dir).unwrap(), Some(dir.to_path_buf()));
    let mesh = Mesh::parse(spec, world, world).unwrap();
    let net = InProcess::new(world).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (mesh, net, full, model_spec) = (&mesh, &net, &full, &model_spec);
                s.spawn(move || {
                    let dev = Device::cpu();
                    let cx = Cx::new(dev.clone()).with_groups(mesh_groups(net, mesh, rank, &dev).unwrap()).with_pipeline_chunks(1);
                    let ep = &cx.groups().ep;
                    let model = module::build(model_spec.build(&cx, ep.rank(), ep.size()).unwrap(), &cx).unwrap();
                    let mut remote = 0;
                    for p in module::distinct_params(&model).unwrap() {
                        if p.param.is_remote() {
                            remote += 1;
                            continue;
                        }
                        let want = &full[p.name()];
                        let global = p.param.global_shape().dims().to_vec();
                        let got = p.param.value().unwrap().to_f32_vec().unwrap();
                        let expect: Vec<f32> = match p.param.shard() {
                            Shard::Full => want.clone(),
                            Shard::Split { dim, rank, degree } => {
                                // Rows (dim 0) or columns (dim 1) of a matrix, or a slice of a vector.
                                let cols = if global.len() == 2 { global[1] } else { 1 };
                                let rows = global[0];
                                let (r0, r1, c0, c1) = match dim {
                                    0 => (rank * rows / degree, (rank + 1) * rows / degree, 0, cols),
                                    _ => (0, rows, rank * cols / degree, (rank + 1) * cols / degree),
                                };
                                (r0..r1).flat_map(|r| want[r * cols + c0..r * cols + c1].to_vec()).collect()
                            }
                        };
                        assert_eq!(got, expect, "{name} on {spec}, rank {rank}: `{}`", p.name());
                    }
                    remote
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn deferred_weights_are_each_ranks_shard_on_tp2() {
    deferred_matches_one_rank::<Gpt2>("gpt2", "tp2", 2);
}

#[test]
fn deferred_weights_place_mixtral_experts_over_ep2_and_stages_over_pp2() {
    deferred_matches_one_rank::<Mixtral>("mixtral", "ep2", 2);
    let remote = deferred_matches_one_rank::<Mixtral>("mixtral", "pp2", 2);
    assert!(remote.iter().all(|&r| r > 0), "each stage leaves the other's layers unread: {remote:?}");
}

/// A checkpoint that does not fit the model is refused when the model is
/// built, before any rank materialises (or reads) anything.
#[test]
fn a_mismatched_checkpoint_is_refused_at_build_time() {
    let mut config: tessera_models::gpt2::Gpt2Config = hf::read_config(fixture("gpt2")).unwrap();
    config.n_layer = 3;
    let spec = ModelSpec::<Gpt2>::new(config, Some(fixture("gpt2")));
    let Err(e) = spec.build(&Cx::new(Device::cpu()), 0, 1) else { panic!("a checkpoint of two layers built a model of three") };
    let e = e.to_string();
    assert!(e.contains("model.from") && e.contains("h.2"), "{e}");
}

struct Kind;

impl ModelJob for Kind {
    type Output = (ModelKind, usize, usize);
    fn run<M: KindModel>(self, spec: ModelSpec<M>) -> tessera_models::Result<(ModelKind, usize, usize)> {
        Ok((spec.kind(), M::vocab_size(spec.config()), spec.padded_vocab(4)))
    }
}

fn kind_of(toml: &str, overrides: &[&str], data_vocab: usize) -> Result<(ModelKind, usize, usize), String> {
    let cfg = TrainConfig::parse(toml, overrides).map_err(|e| e.to_string())?;
    kinds::with_configured_model(&cfg, data_vocab, Kind).map_err(|e| e.to_string())
}

#[test]
fn the_kind_and_vocabulary_come_from_the_table_or_the_directory() {
    let gpt2 = "[model]\nn_layer = 2\nn_embd = 32\nn_head = 4\n";
    // No kind: GPT-2; the vocabulary is the data's, rounded up to 8 per tensor-parallel rank.
    assert_eq!(kind_of(gpt2, &["mesh.tp=2"], 13), Ok((ModelKind::Gpt2, 16, 16)));
    // A vocabulary given is kept, padded (and masked) only where a degree does not divide it.
    assert_eq!(kind_of(gpt2, &["model.vocab_size=61"], 13), Ok((ModelKind::Gpt2, 61, 64)));
    // From a directory: its model_type and vocabulary.
    let from = format!("model.from={:?}", fixture("mixtral").display().to_string());
    assert_eq!(kind_of("", &[&from], 13), Ok((ModelKind::Mixtral, 64, 64)));
    assert_eq!(kind_of("", &[&from, "model.num_local_experts=4"], 13), Ok((ModelKind::Mixtral, 64, 64)), "a field repeated with the file's value is fine");
}

#[test]
fn configuration_mistakes_name_the_setting_and_the_fix() {
    let err = |toml: &str, overrides: &[&str], data_vocab: usize| kind_of(toml, overrides, data_vocab).unwrap_err();
    let gpt2 = "[model]\nn_layer = 2\nn_embd = 32\nn_head = 4\n";
    let e = err(gpt2, &["model.kind=\"lama\""], 13);
    assert!(e.contains("model.kind") && e.contains("did you mean \"llama\"") && e.contains("\"gpt2\", \"llama\", \"mixtral\" or \"gpt2_moe\""), "{e}");
    let e = err(gpt2, &["mesh.ep=2"], 13);
    assert!(e.contains("mesh.ep") && e.contains("a gpt2 has no experts"), "{e}");
    let e = err(gpt2, &["model.vocab_size=10"], 13);
    assert!(e.contains("model.vocab_size") && e.contains("13 token ids"), "{e}");
    let from = format!("model.from={:?}", fixture("mixtral").display().to_string());
    let e = err("", &[&from, "mesh.ep=3"], 13);
    assert!(e.contains("mesh.ep") && e.contains("choose mesh.ep among 1, 2, 4"), "{e}");
    let e = err("", &[&from, "model.hidden_size=64"], 13);
    assert!(e.contains("model.hidden_size") && e.contains("conflicts") && e.contains("which gives 32"), "{e}");
    let e = err("", &[&from], 100);
    assert!(e.contains("model.from") && e.contains("100 token ids") && e.contains("vocabulary of 64"), "{e}");
    let e = err("", &[&from, "batch.seq_len=128"], 13);
    assert!(e.contains("batch.seq_len") && e.contains("64 positions"), "{e}");
    let gpt2_dir = format!("model.from={:?}", fixture("gpt2").display().to_string());
    let e = err("", &[&gpt2_dir, "model.kind=\"llama\""], 13);
    assert!(e.contains("model.kind") && e.contains("holds a gpt2"), "{e}");
}

/// The record a run directory keeps rebuilds the same model.
#[test]
fn a_recorded_model_is_the_model_recorded() {
    let from = format!("model.from={:?}", fixture("llama").display().to_string());
    struct Record;
    impl ModelJob for Record {
        type Output = serde_json::Value;
        fn run<M: KindModel>(self, spec: ModelSpec<M>) -> tessera_models::Result<serde_json::Value> {
            Ok(spec.record())
        }
    }
    let cfg = TrainConfig::parse("", &[&from]).unwrap();
    let record = kinds::with_configured_model(&cfg, 13, Record).unwrap();
    assert_eq!(record["kind"], "llama");
    assert_eq!(kinds::with_recorded_model(&record, Record).unwrap(), record);
    let llama = hf::load_pretrained::<tessera_models::llama::Llama>(fixture("llama"), &Cx::new(Device::cpu())).unwrap();
    assert_eq!(record["config"], hf::HfConfig::to_json(&llama.config));
}

/// The MoE GPT-2 writes and reads its checkpoint in Hugging Face's layout
/// bit for bit, and each of two expert-parallel ranks reads only its experts.
#[test]
fn moe_gpt2_round_trips_and_splits_its_experts_over_ep2() {
    let dir = TempDir::new("moe-gpt2");
    let config = MoeGpt2Config::new(Gpt2Config::tiny(40, 32, 4, 2, 16), 4, 2);
    let cx = Cx::new(Device::cpu()).with_seed(5);
    let model = module::build(MoeGpt2::new(&config).unwrap(), &cx).unwrap();
    hf::save_pretrained(&model, &config, dir.path()).unwrap();
    let loaded = hf::load_pretrained::<MoeGpt2>(dir.path(), &Cx::new(Device::cpu())).unwrap();
    assert_eq!(loaded.config, config);
    assert_eq!(param_bits(&loaded.model), param_bits(&model));
    let names: Vec<String> = read_tensors(&dir.path().join("model.safetensors")).into_keys().collect();
    assert!(
        names.contains(&"transformer.h.1.moe.experts.3.down.weight".to_string()) && names.contains(&"transformer.h.0.moe.router.weight".to_string()),
        "{names:?}"
    );
    deferred_matches_one_rank_from::<MoeGpt2>(dir.path(), "ep2", 2);
    // An ep rank's share cannot be exported: it lacks the other experts.
    let half = MoeGpt2::with_expert_parallel(&config, 1, 2).unwrap();
    let half = module::build(half, &Cx::new(Device::cpu())).unwrap();
    let e = hf::save_pretrained(&half, &config, dir.path().join("half")).unwrap_err().to_string();
    assert!(e.contains("expert-parallel rank 1 of 2"), "{e}");
}
