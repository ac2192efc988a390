//! Bounded mutation fuzzing (see `tessera::testing::fuzz`) of every loader of
//! outside input in the runtime: the training configuration and its
//! `--set` overrides, checkpoints (manifest, rank files and their
//! safetensors headers), `tokenizer.json`, and token shards with their
//! index. Each may refuse an input; none may panic or hang.

mod common;
use common::models::Gpt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tessera::ckpt::{self, serde_json, Checkpointer};
use tessera::data::{arith, Dataset, Tokenizer};
use tessera::module::{self, Cx};
use tessera::optim::{AdamW, AdamWConfig};
use tessera::prelude::*;
use tessera::testing::fuzz::{cases, fuzz};
use tessera::testing::Scratch;
use tessera::train::TrainConfig;

const LIMIT: Duration = Duration::from_secs(5);

fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("fuzz-{name}"))
}

#[test]
fn the_training_configuration() {
    let seeds: Vec<Vec<u8>> = [
        include_str!("../../examples/configs/arith.toml"),
        "[mesh]\ndp = 2\ntp = 2\npp = 2\nschedule = \"interleaved\"\nchunks = 2\n[batch]\ngrad_accum = 4\n",
        "[precision]\ncompute = \"fp16\"\ninitial_scale = 1024.0\n[optim]\nclip = 0.0\n",
        "[precision]\ncompute = \"bf16\"\n[optim]\nclip = 0.0\n[zero]\nstage = 2\n[checkpoint]\nevery = 3\nkeep = 2\n",
        "[run]\nsteps = 10\nstop_after = 5\n[model]\nkind = \"llama\"\nnum_hidden_layers = 2\n[stability]\nspike_factor = 2.0\n",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    fuzz("config", &seeds, cases(3000), LIMIT, |bytes| TrainConfig::parse(&String::from_utf8_lossy(bytes), &[]).is_ok());
    // Overrides: `key=value` strings against the default file.
    let overrides: Vec<Vec<u8>> = ["mesh.dp=2", "optim.lr=1e-3", "run.out=\"runs/x\"", "mesh.schedule=gpipe", "model.n_layer=3", "precision.compute=bf16"]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect();
    fuzz("config overrides", &overrides, cases(3000), LIMIT, |bytes| {
        let o = String::from_utf8_lossy(bytes);
        TrainConfig::parse(include_str!("../../examples/configs/arith.toml"), &[o.as_ref()]).is_ok()
    });
}

/// A checkpoint of a small GPT with its AdamW state.
fn checkpoint(root: &Path) -> PathBuf {
    let cx = Cx::new(Device::cpu());
    let model = module::build(Gpt::with_qkv_bias(12, 8, 2, 1, false).unwrap(), &cx).unwrap();
    let opt = AdamW::new(&model, AdamWConfig::default()).unwrap();
    Checkpointer::new(root, 1).unwrap().save(3, &model, Some(&opt), &cx, serde_json::json!({ "cursor": 17 })).unwrap()
}

#[test]
fn checkpoints() {
    let root = scratch("ckpt");
    let dir = checkpoint(&root);
    let manifest_path = dir.join(ckpt::MANIFEST);
    let rank_file = dir.join("pp0-tp0.safetensors");
    let (manifest, rank) = (std::fs::read(&manifest_path).unwrap(), std::fs::read(&rank_file).unwrap());

    fuzz("manifest", std::slice::from_ref(&manifest), cases(2000), LIMIT, |bytes| {
        std::fs::write(&manifest_path, bytes).unwrap();
        ckpt::verify(&dir).is_ok()
    });
    std::fs::write(&manifest_path, &manifest).unwrap();

    // The rank file: its safetensors header first, then its data.
    fuzz("rank file", std::slice::from_ref(&rank), cases(2000), LIMIT, |bytes| {
        std::fs::write(&rank_file, bytes).unwrap();
        ckpt::verify(&dir).is_ok()
    });
    // And loading it into a model and its optimizer, which reads the
    // tensors themselves. (Every mutation accepted here was found, by
    // hand, to leave the values read unchanged: whitespace in a header.)
    let cx = Cx::new(Device::cpu());
    let model = module::build(Gpt::with_qkv_bias(12, 8, 2, 1, false).unwrap(), &cx).unwrap();
    let mut opt = AdamW::new(&model, AdamWConfig::default()).unwrap();
    let ckpt = Checkpointer::new(&root, 1).unwrap();
    fuzz("rank file, loaded", std::slice::from_ref(&rank), cases(500), LIMIT, |bytes| {
        std::fs::write(&rank_file, bytes).unwrap();
        ckpt.load(&dir, &model, Some(&mut opt), &cx).is_ok()
    });
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn tokenizers() {
    let dir = scratch("tokenizer");
    let path = dir.join("tokenizer.json");
    let chars = Tokenizer::chars("abc+=0123456789").unwrap().to_json().unwrap().into_bytes();
    let text = dir.join("text.txt");
    std::fs::write(&text, "the quick brown fox jumps over the lazy dog; 12 + 30 = 42\n".repeat(20)).unwrap();
    let bpe = Tokenizer::train_bpe(&[&text], 280).unwrap().to_json().unwrap().into_bytes();
    fuzz("tokenizer.json", &[chars, bpe], cases(1000), LIMIT, |bytes| {
        std::fs::write(&path, bytes).unwrap();
        let Ok(t) = Tokenizer::load(&path) else { return false };
        // A loaded tokenizer must also survive use.
        let ids = t.encode("12 + 30 = 42").unwrap_or_default();
        let _ = t.decode(&ids);
        let _ = t.decode(&[0, 1, u32::MAX]);
        true
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn token_shards_and_their_index() {
    let dir = scratch("shards");
    let data = dir.join("data");
    arith::Task::new(3).with_train_size(200).write_shards(&data, 1024).unwrap();
    let index_path = data.join(tessera::data::shards::INDEX_FILE);
    let index = std::fs::read(&index_path).unwrap();
    let first = std::fs::read_dir(&data).unwrap().map(|e| e.unwrap().path()).find(|p| p.extension().is_some_and(|e| e == "bin")).expect("a shard");
    let shard = std::fs::read(&first).unwrap();
    let read_all = |d: &Path| {
        let Ok(ds) = Dataset::open(d) else { return false };
        let mut whole = true;
        for s in 0..ds.shard_count() {
            let n = ds.shard_tokens(s);
            whole &= ds.tokens(s, 0, n.min(4096) as usize).is_ok();
            let _ = ds.tokens(s, n.saturating_sub(3), 8);
        }
        whole && ds.tokenizer().is_ok()
    };
    fuzz("shard index", std::slice::from_ref(&index), cases(2000), LIMIT, |bytes| {
        std::fs::write(&index_path, bytes).unwrap();
        read_all(&data)
    });
    std::fs::write(&index_path, &index).unwrap();
    fuzz("token shard", std::slice::from_ref(&shard), cases(2000), LIMIT, |bytes| {
        std::fs::write(&first, bytes).unwrap();
        read_all(&data)
    });
    let _ = std::fs::remove_dir_all(&dir);
}
