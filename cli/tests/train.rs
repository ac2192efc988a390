//! `tessera train` and `tessera export`, run as programs: fine-tuning a
//! Hugging Face directory on several meshes starts from exactly its loss;
//! a resumed run continues from its own checkpoint; the export loads back
//! as the model the checkpoint holds; every model kind trains from its
//! table; and a configuration that cannot work is refused before the run
//! directory exists, naming the setting and the fix.

mod common;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tessera::data::{AnswerTargets, Dataset, Sampler};
use tessera::module::{self, Act, Cx, Module, Replicated, SplitHidden};
use tessera::nn::vocab_parallel_cross_entropy;
use tessera::testing::Scratch;
use tessera::train::Batches;
use tessera::{Device, Tensor};
use tessera_models::gpt2::{Gpt2, Gpt2Config, MoeGpt2};
use tessera_models::hf::{self, HfModel};
use tessera_models::kinds::ModelSpec;
use tessera_models::mixtral::Mixtral;

fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("cli-train-{name}"))
}

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).env("RUST_BACKTRACE", "0").output().unwrap()
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

/// Runs `tessera args`, which must succeed; returns its stdout.
fn ok(args: &[&str]) -> String {
    let out = tessera(args);
    assert!(out.status.success(), "tessera {args:?} failed:\n{}\n{}", text(&out.stdout), text(&out.stderr));
    text(&out.stdout)
}

/// Runs `tessera args`, which must fail with every one of `needles` in its error.
fn fails(args: &[&str], needles: &[&str]) {
    let out = tessera(args);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "tessera {args:?} should fail; it printed:\n{}", text(&out.stdout));
    for n in needles {
        assert!(stderr.contains(n), "the error of tessera {args:?} should mention {n:?}:\n{stderr}");
    }
    assert!(!stderr.contains("panicked"), "a refusal is an error, not a panic:\n{stderr}");
}

/// A Hugging Face model directory in the models crate's test fixtures.
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures").join(name)
}

/// Micro-batch, sequence length and microbatches per step of every run here.
const MICRO: usize = 2;
const SEQ: usize = 26;
const ACCUM: usize = 2;
/// The bundled task's data seed (`data.seed`).
const DATA_SEED: u64 = 7;

/// A training configuration of `steps` steps into `out` on `mesh` (TOML
/// lines of `[mesh]`) with the `[model]` table `model`, on the bundled task.
fn config(dir: &Path, out: &Path, model: &str, mesh: &str, steps: u64) -> PathBuf {
    let text = format!(
        "[run]\nsteps = {steps}\nout = {out:?}\nprogress = false\ntrace_steps = 0\n\n[model]\n{model}\n\n[mesh]\n{mesh}\n\n[batch]\nmicro_batch = {MICRO}\nseq_len = {SEQ}\ngrad_accum = {ACCUM}\n\n[optim]\nlr = 1e-2\nwarmup = 1\n\n[checkpoint]\nevery = 1\nkeep = 3\n\n[data]\nsource = \"bundled\"\nseed = {DATA_SEED}\n",
        out = out.display().to_string(),
    );
    let path = dir.join(format!("{}.toml", out.file_name().unwrap().to_string_lossy()));
    std::fs::write(&path, text).unwrap();
    path
}

/// The `(step, loss)` of every line of a run's metrics.
fn losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}

/// A GPT-2 Hugging Face directory with a vocabulary of 61 ids (which two
/// tensor-parallel ranks cannot split: the run pads it to 64) and weights
/// far from any initialisation: a run that did not start from them would
/// not start at their loss.
fn tiny_gpt2(dir: &Path) -> Gpt2Config {
    let config = Gpt2Config::tiny(61, 32, 4, 2, 32);
    let cx = Cx::new(Device::cpu());
    let model = module::build(Gpt2::new(&config).unwrap(), &cx).unwrap();
    for (k, p) in module::distinct_params(&model).unwrap().iter().enumerate() {
        let n = p.param.global_shape().elem_count();
        let values: Vec<f32> = (0..n).map(|i| ((i * 7919 + k * 104_729) % 1000) as f32 / 1000.0 - 0.45).collect();
        p.param.set_value(Tensor::from_vec(values, p.param.global_shape().dims(), cx.device()).unwrap()).unwrap();
    }
    hf::save_pretrained(&model, &config, dir).unwrap();
    config
}

/// The loss of the first step of a run of `replicas` data replicas on the
/// bundled task (written to `data`), computed on one rank with the weights
/// of the Hugging Face directory `hf_dir`: the mean over replicas and
/// microbatches of the answer tokens' cross-entropy.
fn first_step_loss<M: HfModel + Module<In = Replicated, Out = SplitHidden>>(hf_dir: &Path, data: &Path, replicas: usize) -> f64 {
    let cx = &mut Cx::new(Device::cpu());
    let hf::Pretrained { model, .. } = hf::load_pretrained::<M>(hf_dir, cx).unwrap();
    let data = Dataset::open(data).unwrap();
    let mut total = 0.0;
    for replica in 0..replicas {
        let mut batches = AnswerTargets(Sampler::new(&data, MICRO * replicas, SEQ, replica, replicas, DATA_SEED).unwrap());
        for _ in 0..ACCUM {
            let (x, y) = batches.next_batch(cx.device()).unwrap();
            let (logits, _) = model.forward(cx, Act::new(x)).unwrap();
            let vocab = logits.tensor().dims()[2];
            let (loss, _) = vocab_parallel_cross_entropy(cx.tp(), &logits, &y, vocab, batches.ignore_index()).unwrap();
            total += loss.to_scalar().unwrap();
        }
    }
    total / (replicas * ACCUM) as f64
}

/// Fine-tuning starts from the Hugging Face weights on every layout: the
/// first step's loss is the loss those weights give on one rank, at dp2 and
/// at tp2 × pp2 (where the vocabulary is padded and every weight is
/// resharded on load).
#[test]
fn fine_tuning_starts_at_the_pretrained_loss_at_dp2_and_tp2_pp2() {
    let dir = scratch("from-gpt2");
    let hf_dir = dir.path().join("hf");
    tiny_gpt2(&hf_dir);
    let model = format!("from = {:?}", hf_dir.display().to_string());
    for (name, mesh, replicas) in [("dp2", "dp = 2", 2), ("tp2pp2", "tp = 2\npp = 2", 1)] {
        let run = dir.path().join(name);
        let cfg = config(dir.path(), &run, &model, mesh, 1);
        let stdout = ok(&["train", "--config", cfg.to_str().unwrap(), "--eval", "0"]);
        assert!(stdout.contains(&format!("fine-tuning gpt2 from {}", hf_dir.display())), "{stdout}");
        let got = losses(&run)[0];
        let want = first_step_loss::<Gpt2>(&hf_dir, &run.join("data"), replicas);
        assert_eq!(got.0, 1);
        assert!((got.1 - want).abs() < 2e-5, "{name}: the first step's loss is {}, the pretrained weights give {want}", got.1);
        // Far from what a fresh model gives (about ln 61 = 4.1): the weights came from the directory.
        assert!((want - 61f64.ln()).abs() > 0.5, "the fixture's loss {want} is too close to a fresh model's");
    }
}

/// Mixtral's experts are placed by the mesh's ep axis when the model is
/// built, and its pretrained weights land on the ranks that hold them: at
/// ep2 × tp2 the first step's loss is the one-rank loss.
#[test]
fn mixtral_fine_tunes_with_its_experts_split_over_ep2_tp2() {
    let dir = scratch("from-mixtral");
    let run = dir.path().join("run");
    let model = format!("kind = \"mixtral\"\nfrom = {:?}", fixture("mixtral").display().to_string());
    let cfg = config(dir.path(), &run, &model, "ep = 2\ntp = 2", 1);
    let stdout = ok(&["train", "--config", cfg.to_str().unwrap(), "--eval", "0"]);
    assert!(stdout.contains("4 experts of which each token uses 2"), "{stdout}");
    assert!(stdout.contains("dp1 × ep2 × pp1 × tp2"), "{stdout}");
    let got = losses(&run)[0].1;
    let want = first_step_loss::<Mixtral>(&fixture("mixtral"), &run.join("data"), 2);
    assert!((got - want).abs() < 2e-5, "the first step's loss is {got}, the pretrained weights give {want}");
}

/// A run that resumes from its own checkpoint continues from it, not from
/// the pretrained weights: stopped after step 1 and resumed, it computes
/// step 2 exactly as the run that never stopped.
#[test]
fn a_resumed_fine_tuning_run_continues_from_its_checkpoint() {
    let dir = scratch("from-resume");
    let hf_dir = dir.path().join("hf");
    tiny_gpt2(&hf_dir);
    let model = format!("from = {:?}", hf_dir.display().to_string());
    let whole = dir.path().join("whole");
    let cfg = config(dir.path(), &whole, &model, "tp = 2", 2);
    ok(&["train", "--config", cfg.to_str().unwrap(), "--eval", "0"]);

    // The same configuration, sent elsewhere with --out.
    let parts = dir.path().join("parts");
    let out = parts.to_str().unwrap();
    ok(&["train", "--config", cfg.to_str().unwrap(), "--out", out, "--eval", "0", "--set", "run.stop_after=1"]);
    let stdout = ok(&["train", "--config", cfg.to_str().unwrap(), "--out", out, "--eval", "0"]);
    assert!(stdout.contains("resumed from the checkpoint of step 1"), "{stdout}");
    let (a, b) = (losses(&whole), losses(&parts));
    assert_eq!(a.len(), 2);
    assert_eq!(a, b, "the resumed run's losses differ from the uninterrupted run's");
}

/// `tessera export` writes the final checkpoint of a tp2 × pp2 run (its
/// vocabulary padded from 61 to 64) as a Hugging Face directory that loads
/// back with the models crate's loader as exactly the model the checkpoint
/// holds, without the padding, and with the trained weights.
#[test]
fn export_round_trips_through_the_hugging_face_loader() {
    let dir = scratch("export-gpt2");
    let hf_dir = dir.path().join("hf");
    let gpt2 = tiny_gpt2(&hf_dir);
    // The pretrained directory's tokenizer goes with the export.
    std::fs::write(hf_dir.join("tokenizer.json"), "{\"model\": \"a tokenizer\"}").unwrap();
    let run = dir.path().join("run");
    let cfg = config(dir.path(), &run, &format!("from = {:?}", hf_dir.display().to_string()), "tp = 2\npp = 2", 2);
    ok(&["train", "--config", cfg.to_str().unwrap(), "--eval", "0"]);
    let out = dir.path().join("exported");
    let stdout = ok(&["export", "--run", run.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(stdout.contains("of step 2"), "{stdout}");
    assert_eq!(std::fs::read(out.join("tokenizer.json")).unwrap(), std::fs::read(hf_dir.join("tokenizer.json")).unwrap());

    let cx = &mut Cx::new(Device::cpu());
    let exported = hf::load_pretrained::<Gpt2>(&out, cx).unwrap();
    assert_eq!(exported.config.vocab_size, 61, "the export leaves the padding out");
    let step2 = run.join("checkpoints/step-2");
    let trained = ModelSpec::<Gpt2>::new(gpt2, None).load_checkpoint(&step2, cx).unwrap();
    assert_eq!(trained.padded_vocab(), 64, "the checkpoint holds the padded vocabulary");
    let ids = Tensor::from_vec((0..2 * 12).map(|i| (i * 5 % 61) as u32).collect::<Vec<_>>(), [2, 12], cx.device()).unwrap();
    let got = exported.model.forward(cx, Act::new(ids.clone())).unwrap().0.into_tensor().to_f32_vec().unwrap();
    let want = trained.forward(cx, Act::new(ids)).unwrap().0.into_tensor().to_f32_vec().unwrap();
    let want: Vec<f32> = want.chunks(64).flat_map(|row| row[..61].to_vec()).collect();
    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(err <= 1e-5, "the export's logits differ from the checkpoint's by {err}");

    // Training moved the weights: the export is not the directory it started from.
    let original = hf::load_pretrained::<Gpt2>(&hf_dir, cx).unwrap().model;
    let ids = Tensor::from_vec((0..12).map(|i| i as u32).collect::<Vec<_>>(), [1, 12], cx.device()).unwrap();
    let before = original.forward(cx, Act::new(ids.clone())).unwrap().0.into_tensor().to_f32_vec().unwrap();
    let after = exported.model.forward(cx, Act::new(ids)).unwrap().0.into_tensor().to_f32_vec().unwrap();
    assert_ne!(before, after);

    // A checkpoint names its run by the directory above it that holds model.json.
    let again = dir.path().join("again");
    ok(&["export", "--checkpoint", run.join("checkpoints/step-1").to_str().unwrap(), "--out", again.to_str().unwrap()]);
    assert!(again.join("model.safetensors").is_file() && again.join("config.json").is_file());

    // The run serves split over two ranks (its padded vocabulary divides)
    // the tokens one rank generates; over three, it is refused with the fix.
    std::fs::remove_file(hf_dir.join("tokenizer.json")).unwrap();
    let want: serde_json::Value =
        serde_json::from_str(&ok(&["generate", "--model", run.to_str().unwrap(), "--ids", "1,5,9", "--max-tokens", "6", "--json"])).unwrap();
    let want: Vec<String> = want["tokens"].as_array().unwrap().iter().map(|t| format!("token_id:{t}")).collect();
    assert!(!want.is_empty());
    let got = serve_tokens(&run, &["--tp", "2"], r#"{"model": "m", "prompt": [1, 5, 9], "max_tokens": 6, "temperature": 0, "logprobs": 1}"#);
    assert_eq!(got, want);
    fails(&["serve", "--model", run.to_str().unwrap(), "--port", "0", "--tp", "3"], &["vocabulary of 64 ids", "3 tensor-parallel ranks", "tessera export"]);
}

/// The tokens `tessera serve --model run args` answers a completion
/// `request` with (as its log probabilities name them).
fn serve_tokens(run: &Path, args: &[&str], request: &str) -> Vec<String> {
    let served = common::serve(run, &[args, &["--served-model-name", "m"]].concat());
    let (status, body) = common::http(&served.addr, "POST", "/v1/completions", request, None);
    assert_eq!(status, 200, "{body}");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    body["choices"][0]["logprobs"]["tokens"].as_array().unwrap_or_else(|| panic!("{body}")).iter().map(|t| t.as_str().unwrap().to_string()).collect()
}

/// A Mixtral trained at ep2 (each rank holding half the experts) exports
/// every expert, and the export reproduces the checkpoint's logits.
#[test]
fn a_mixtral_trained_at_ep2_exports_every_expert() {
    let dir = scratch("export-mixtral");
    let run = dir.path().join("run");
    let cfg = config(dir.path(), &run, &format!("from = {:?}", fixture("mixtral").display().to_string()), "ep = 2", 1);
    ok(&["train", "--config", cfg.to_str().unwrap(), "--eval", "0"]);
    let out = dir.path().join("exported");
    ok(&["export", "--run", run.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    let cx = &mut Cx::new(Device::cpu());
    let exported = hf::load_pretrained::<Mixtral>(&out, cx).unwrap();
    assert_eq!(exported.model.local_experts(), 0..4);
    let mixtral = hf::read_config(fixture("mixtral")).unwrap();
    let trained = ModelSpec::<Mixtral>::new(mixtral, None).load_checkpoint(&run.join("checkpoints/step-1"), cx).unwrap();
    let ids = Tensor::from_vec((0..10).map(|i| (i * 7 % 64) as u32).collect::<Vec<_>>(), [1, 10], cx.device()).unwrap();
    let got = exported.model.forward(cx, Act::new(ids.clone())).unwrap().0.into_tensor().to_f32_vec().unwrap();
    let want = trained.forward(cx, Act::new(ids)).unwrap().0.into_tensor().to_f32_vec().unwrap();
    assert_eq!(got, want);
}

/// The MoE GPT-2 has no Hugging Face class, but its export is a directory
/// in Hugging Face's layout that a new run starts from: a model trained at
/// ep2 × pp2, exported, fine-tuned at tp2 × ep2 starts at the loss the
/// export gives on one rank.
#[test]
fn an_exported_moe_gpt2_starts_a_new_run_on_another_mesh() {
    let dir = scratch("moe-gpt2");
    let first = dir.path().join("first");
    let model = "kind = \"gpt2_moe\"\nn_layer = 2\nn_embd = 32\nn_head = 4\nnum_local_experts = 4\nnum_experts_per_tok = 2";
    let cfg = config(dir.path(), &first, model, "ep = 2\npp = 2", 2);
    ok(&["train", "--config", cfg.to_str().unwrap(), "--eval", "0"]);
    let exported = dir.path().join("exported");
    ok(&["export", "--run", first.to_str().unwrap(), "--out", exported.to_str().unwrap()]);
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(exported.join("config.json")).unwrap()).unwrap();
    assert_eq!((written["model_type"].as_str(), written["num_local_experts"].as_u64()), (Some("gpt2_moe"), Some(4)));

    let second = dir.path().join("second");
    let cfg = config(dir.path(), &second, &format!("from = {:?}", exported.display().to_string()), "tp = 2\nep = 2", 1);
    ok(&["train", "--config", cfg.to_str().unwrap(), "--eval", "0"]);
    let got = losses(&second)[0].1;
    let want = first_step_loss::<MoeGpt2>(&exported, &second.join("data"), 2);
    assert!((got - want).abs() < 2e-5, "the first step's loss is {got}, the exported weights give {want}");
}

/// Every kind trains from its `[model]` table: Llama at tp2, Mixtral with
/// its experts split over ep2 and the MoE GPT-2 over ep2 × pp2, with a
/// finite loss and a checkpoint, and the banner says what was built.
#[test]
fn every_kind_trains_from_its_table() {
    let dir = scratch("kinds");
    let shape = "hidden_size = 32\nnum_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\nintermediate_size = 64";
    let llama = format!("kind = \"llama\"\n{shape}");
    let mixtral = format!("kind = \"mixtral\"\n{shape}\nnum_local_experts = 4\nnum_experts_per_tok = 2");
    let moe_gpt2 = "kind = \"gpt2_moe\"\nn_layer = 2\nn_embd = 32\nn_head = 4\nnum_local_experts = 4\nnum_experts_per_tok = 1".to_string();
    for (name, model, mesh, banner) in [
        ("llama", llama, "tp = 2", "training llama ("),
        ("mixtral", mixtral, "ep = 2", "4 experts of which each token uses 2"),
        ("gpt2_moe", moe_gpt2, "ep = 2\npp = 2", "4 experts of which each token uses 1"),
    ] {
        let run = dir.path().join(name);
        let cfg = config(dir.path(), &run, &model, mesh, 2);
        let stdout = ok(&["train", "--config", cfg.to_str().unwrap(), "--eval", "5"]);
        assert!(stdout.contains(banner), "{name}: {stdout}");
        assert!(stdout.contains("exact match on 5 held-out problems"), "{name}: {stdout}");
        let l = losses(&run);
        assert_eq!(l.len(), 2, "{name}");
        assert!(l.iter().all(|(_, v)| v.is_finite() && *v > 0.0), "{name}: {l:?}");
        assert!(run.join("checkpoints/step-2").is_dir(), "{name}");
        let record: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("model.json")).unwrap()).unwrap();
        assert_eq!(record["kind"], name);
        assert_eq!(record["config"]["model_type"], name, "the recorded config is a Hugging Face config of its class");
    }
}

/// What cannot work is refused before the run directory exists, naming
/// the setting and the fix.
#[test]
fn bad_configurations_are_refused_before_the_run_starts() {
    let dir = scratch("refusals");
    let run = dir.path().join("run");
    let gpt2 = "kind = \"gpt2\"\nn_layer = 2\nn_embd = 32\nn_head = 4";
    let cfg = config(dir.path(), &run, gpt2, "dp = 1", 1);
    let cfg = cfg.to_str().unwrap();
    let from = |d: &Path| format!("model.from={:?}", d.display().to_string());
    // A directory with a config and no weights.
    let config_only = dir.path().join("config-only");
    std::fs::create_dir_all(&config_only).unwrap();
    std::fs::copy(fixture("gpt2").join("config.json"), config_only.join("config.json")).unwrap();
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (vec!["--set".into(), "model.kind=\"gtp2\"".into()], vec!["model.kind", "did you mean \"gpt2\"", "\"gpt2\", \"llama\", \"mixtral\" or \"gpt2_moe\""]),
        (vec!["--set".into(), "model.kind=2".into()], vec!["model.kind", "write a string"]),
        (vec!["--set".into(), "model.n_layers=3".into()], vec!["model.n_layers", "did you mean `n_layer`"]),
        (vec!["--set".into(), "mesh.ep=2".into()], vec!["mesh.ep", "has no experts", "model.kind = \"mixtral\" or \"gpt2_moe\""]),
        (vec!["--set".into(), "mesh.dpp=2".into()], vec!["dpp", "did you mean `dp`"]),
        (vec!["--set".into(), "batch.seq_len=64".into(), "--set".into(), "model.n_positions=32".into()], vec!["batch.seq_len", "32 positions"]),
        (vec!["--set".into(), from(&fixture("mixtral")), "--set".into(), "mesh.ep=3".into()], vec!["model.kind", "conflicts", "mixtral"]),
        (
            vec!["--set".into(), from(&fixture("mixtral")), "--set".into(), "model.kind=\"mixtral\"".into(), "--set".into(), "mesh.ep=3".into()],
            vec!["a mixtral has no such setting", "`from`", "num_hidden_layers"],
        ),
        (
            vec!["--set".into(), from(&fixture("gpt2")), "--set".into(), "model.n_layer=3".into()],
            vec!["model.n_layer", "conflicts", "which gives 2", "remove model.n_layer"],
        ),
        (vec!["--set".into(), from(&dir.path().join("missing"))], vec!["missing/config.json", "cannot read it"]),
        (vec!["--set".into(), "data.source=\"no-such-shards\"".into()], vec!["data.source", "no-such-shards"]),
        (vec!["--set".into(), "mesh.tp=3".into()], vec!["mesh.tp", "3"]),
        (vec!["--set".into(), "mesh.pp=3".into(), "--set".into(), "batch.grad_accum=3".into()], vec!["mesh.pp", "2 layers", "too few"]),
        (vec!["--set".into(), from(&config_only)], vec!["model.from", "model.safetensors", "cannot read it"]),
        (vec!["--eval".into(), "100000".into()], vec!["--eval 100000", "at most"]),
    ];
    for (extra, needles) in &cases {
        let mut args = vec!["train", "--config", cfg];
        args.extend(extra.iter().map(String::as_str));
        fails(&args, needles);
        assert!(!run.exists(), "tessera {args:?} created the run directory before refusing");
    }
    // A Mixtral whose experts an ep degree does not divide: the fix lists the degrees that do.
    let mixtral = format!("from = {:?}", fixture("mixtral").display().to_string());
    let cfg = config(dir.path(), &run, &mixtral, "ep = 3", 1);
    fails(&["train", "--config", cfg.to_str().unwrap()], &["mesh.ep", "does not divide the 4 experts", "1, 2, 4"]);
    assert!(!run.exists());
    fails(&["train", "--config", dir.path().join("nope.toml").to_str().unwrap()], &["nope.toml", "cannot read the configuration"]);
    fails(&["export", "--run", dir.path().to_str().unwrap(), "--out", dir.path().join("x").to_str().unwrap()], &["config.toml", "--run takes the directory"]);
}
