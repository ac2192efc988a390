//! `tessera ckpt inspect` and `tessera ckpt reshard` on a checkpoint saved
//! at tp2×pp2: the report describes it, and the offline-resharded copies
//! load at tp4 and at pp2 with two chunks per stage with every parameter
//! and optimizer moment bit for bit as saved.

#[allow(dead_code)]
#[path = "../../tests/tests/common/models.rs"]
mod models;

use models::Gpt;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};
use tessera::ckpt::{self, Checkpointer};
use tessera::dist::inproc::{mesh_groups, InProcess};
use tessera::dist::mesh::Mesh;
use tessera::module::{self, Cx, Shard};
use tessera::optim::{AdamW, AdamWConfig};
use tessera::prelude::*;
use tessera::testing::Scratch;

const ADAMW: AdamWConfig = AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-6, weight_decay: 0.01 };

fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("cli-{name}"))
}

fn tessera(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).args(args).output().unwrap()
}

fn text(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

fn gpt() -> Gpt {
    Gpt::with_qkv_bias(12, 8, 4, 4, false).unwrap()
}

/// Every parameter and moment this rank holds, whole (gathered over tensor
/// parallelism), as bits: `name`, `name.m`, `name.v`.
fn state(model: &Gpt, opt: &AdamW, cx: &Cx) -> BTreeMap<String, Vec<u32>> {
    let tp = &cx.groups().tp;
    let whole = |t: &Tensor, shard: Shard| -> Vec<u32> {
        let t = match shard {
            Shard::Split { dim, .. } => tp.all_gather(t, dim).unwrap(),
            Shard::Full => t.clone(),
        };
        t.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    };
    let mut out = BTreeMap::new();
    for n in module::distinct_params(model).unwrap().into_iter().filter(|n| !n.param.is_remote()) {
        out.insert(n.name().to_string(), whole(&n.param.value().unwrap(), n.param.shard()));
    }
    for s in opt.moments() {
        out.insert(format!("{}.m", s.name), whole(s.m, s.param.shard()));
        out.insert(format!("{}.v", s.name), whole(s.v, s.param.shard()));
    }
    out
}

/// Runs `body` on every rank of `mesh` (with `chunks` per pipeline stage)
/// with a freshly built model and AdamW; merges what the ranks return.
fn on_mesh(mesh: &str, chunks: usize, body: impl Fn(&Gpt, &mut AdamW, &Cx) -> BTreeMap<String, Vec<u32>> + Sync) -> BTreeMap<String, Vec<u32>> {
    let world_size: usize = mesh.split(',').map(|a| a.trim_start_matches(char::is_alphabetic).parse::<usize>().unwrap()).product();
    let mesh = Mesh::parse(mesh, world_size, world_size).unwrap();
    let world = InProcess::new(world_size).unwrap();
    let parts: Vec<BTreeMap<String, Vec<u32>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (world, mesh, body) = (&world, &mesh, &body);
                s.spawn(move || {
                    let dev = Device::cpu();
                    let cx = Cx::new(dev.clone()).with_seed(3).with_groups(mesh_groups(world, mesh, rank, &dev).unwrap()).with_pipeline_chunks(chunks);
                    let model = module::build(gpt(), &cx).unwrap();
                    let mut opt = AdamW::new(&model, ADAMW).unwrap();
                    body(&model, &mut opt, &cx)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut out = BTreeMap::new();
    for p in parts {
        for (k, v) in p {
            out.entry(k).or_insert(v);
        }
    }
    out
}

/// Saves a checkpoint of step 1 under `root` at tp2×pp2 after one AdamW
/// update (from made-up gradients, so every moment is non-zero); the state saved.
fn save_tp2_pp2(root: &Path) -> BTreeMap<String, Vec<u32>> {
    on_mesh("tp2,pp2", 1, |model, opt, cx| {
        for n in module::distinct_params(model).unwrap().into_iter().filter(|n| !n.param.is_remote()) {
            let v = n.param.value().unwrap();
            let g = Tensor::full(0.01 * (n.name().len() % 7) as f64 - 0.03, v.shape().clone(), v.dtype(), v.device()).unwrap();
            n.param.set_grad(g).unwrap();
        }
        opt.step(1e-2).unwrap();
        Checkpointer::new(root, 2).unwrap().save(1, model, Some(&*opt), cx, ckpt::serde_json::json!({ "cursor": 7 })).unwrap();
        state(model, opt, cx)
    })
}

/// Loads the checkpoint under `root` on `mesh`; the state restored.
fn load(root: &Path, mesh: &str, chunks: usize) -> BTreeMap<String, Vec<u32>> {
    on_mesh(mesh, chunks, |model, opt, cx| {
        let restored = Checkpointer::new(root, 2).unwrap().load_latest_valid(model, Some(opt), cx).unwrap().expect("a checkpoint");
        assert_eq!(restored.manifest.extra["cursor"], 7);
        state(model, opt, cx)
    })
}

#[test]
fn inspect_reports_and_reshard_rewrites_for_another_mesh() {
    let base = scratch("reshard");
    let root = base.join("tp2pp2");
    let saved = save_tp2_pp2(&root);

    // Inspect, as JSON: the step, the mesh, each parameter's global shape and pieces, the verification.
    let out = tessera(&["ckpt", "inspect", root.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["step"], 1);
    assert_eq!((report["mesh"]["tp"].as_u64(), report["mesh"]["pp"].as_u64()), (Some(2), Some(2)));
    assert_eq!(report["verified"], true);
    assert_eq!(report["extra"]["cursor"], 7);
    assert_eq!(report["optimizer"]["kind"], "adamw");
    let params = report["params"].as_array().unwrap();
    let tok = params.iter().find(|p| p["name"] == "tok.weight").unwrap();
    assert_eq!(tok["global_shape"], serde_json::json!([12, 8]));
    assert_eq!(tok["aliases"], serde_json::json!(["head.weight"]));
    assert_eq!(tok["stages"], serde_json::json!(["first", "last"]));
    let tok_files: Vec<&str> = tok["pieces"].as_array().unwrap().iter().filter(|p| p["kind"] == "param").map(|p| p["file"].as_str().unwrap()).collect();
    assert_eq!(tok_files, ["pp0-tp0.safetensors", "pp0-tp1.safetensors"], "the tied weight is written by the first stage, one slice per tp rank");
    let pieces_bytes: u64 = params.iter().flat_map(|p| p["pieces"].as_array().unwrap()).map(|p| p["bytes"].as_u64().unwrap()).sum();
    assert_eq!(report["tensor_bytes"].as_u64(), Some(pieces_bytes));
    assert!(report["file_bytes"].as_u64().unwrap() > pieces_bytes, "files add their headers");

    let out = tessera(&["ckpt", "inspect", root.join("step-1").to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let shown = text(&out.stdout);
    assert!(shown.contains("step 1") && shown.contains("checksums: ok") && shown.contains("tok.weight (also head.weight)"), "{shown}");

    // Offline to tp4 on one stage, and to two stages of two chunks without tensor parallelism.
    let tp4 = base.join("tp4");
    let out = tessera(&["ckpt", "reshard", root.to_str().unwrap(), "--out", tp4.join("step-1").to_str().unwrap(), "--tp", "4", "--dp", "1", "--pp", "1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let m = ckpt::verify(&tp4.join("step-1")).unwrap();
    assert_eq!(m.files(), ["pp0-tp0.safetensors", "pp0-tp1.safetensors", "pp0-tp2.safetensors", "pp0-tp3.safetensors"]);
    assert_eq!(load(&tp4, "tp4", 1), saved, "the tp4 copy restores every parameter and moment as saved");

    let pp2 = base.join("pp2v2");
    let out = tessera(&[
        "ckpt",
        "reshard",
        tp4.to_str().unwrap(),
        "--out",
        pp2.join("step-1").to_str().unwrap(),
        "--tp",
        "1",
        "--dp",
        "1",
        "--pp",
        "2",
        "--chunks",
        "2",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let m = ckpt::verify(&pp2.join("step-1")).unwrap();
    // Two chunks per stage over 4 layers: layer 2 is on stage 0.
    assert_eq!(m.pieces("blocks.2.qkv.weight", ckpt::TensorKind::Param).map(|r| r.file.as_str()).collect::<Vec<_>>(), ["pp0-tp0.safetensors"]);
    assert_eq!(m.pieces("norm.weight", ckpt::TensorKind::Param).map(|r| r.file.as_str()).collect::<Vec<_>>(), ["pp1-tp0.safetensors"]);
    assert_eq!(load(&pp2, "pp2", 2), saved, "the pp2 copy restores every parameter and moment as saved");

    // A mesh the parameters do not divide onto is refused, naming the reason.
    let out = tessera(&["ckpt", "reshard", root.to_str().unwrap(), "--out", base.join("tp3").to_str().unwrap(), "--tp", "3", "--dp", "1", "--pp", "1"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("tp 3 does not divide"), "{}", text(&out.stderr));
    assert!(!base.join("tp3").exists());
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn inspect_fails_on_a_damaged_or_foreign_checkpoint() {
    let base = scratch("damaged");
    save_tp2_pp2(&base);
    let dir = base.join("step-1");
    let file = dir.join("pp1-tp1.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&file, bytes).unwrap();
    let out = tessera(&["ckpt", "inspect", dir.to_str().unwrap(), "--json"]);
    assert!(!out.status.success(), "a checksum mismatch fails the command");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["verified"], false);
    assert!(report["error"].as_str().unwrap().contains("pp1-tp1.safetensors"), "{}", report["error"]);

    // A manifest of format 1 is named as such.
    let manifest = dir.join(ckpt::MANIFEST);
    let mut json: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    json["format"] = 1.into();
    std::fs::write(&manifest, serde_json::to_vec(&json).unwrap()).unwrap();
    let out = tessera(&["ckpt", "inspect", dir.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("format 1 was written by an older Tessera"), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn inspect_of_a_missing_directory_fails_without_creating_it() {
    let base = scratch("missing");
    let missing = base.join("runs").join("nowhere");
    for cmd in ["inspect", "reshard"] {
        let out_dir = base.join("out");
        let mut args = vec!["ckpt", cmd, missing.to_str().unwrap()];
        if cmd == "reshard" {
            args.extend(["--tp", "1", "--dp", "1", "--pp", "1", "--out", out_dir.to_str().unwrap()]);
        }
        let out = tessera(&args);
        assert!(!out.status.success(), "`ckpt {cmd}` of a missing directory fails");
        assert!(text(&out.stderr).contains("no such checkpoint directory"), "{}", text(&out.stderr));
        assert!(!missing.exists() && !base.join("runs").exists(), "`ckpt {cmd}` created the directory it was asked to read");
    }
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn an_edited_manifest_is_detected() {
    let base = scratch("edited");
    save_tp2_pp2(&base);
    let dir = base.join("step-1");
    let manifest = dir.join(ckpt::MANIFEST);
    let original = std::fs::read(&manifest).unwrap();
    type Edit = fn(&mut serde_json::Value);
    let edits: [(&str, Edit); 3] = [
        ("step", |m| m["step"] = 7.into()),
        ("data cursor", |m| m["extra"] = serde_json::json!({ "cursor": 123 })),
        ("optimizer step count", |m| {
            let record = m["tensors"].as_array_mut().unwrap().iter_mut().find(|r| r["steps"].is_u64()).expect("a moment with its step count");
            let steps = record["steps"].as_u64().unwrap();
            record["steps"] = (steps + 5).into();
        }),
    ];
    for (what, edit) in edits {
        let mut json: serde_json::Value = serde_json::from_slice(&original).unwrap();
        edit(&mut json);
        std::fs::write(&manifest, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
        let out = tessera(&["ckpt", "inspect", dir.to_str().unwrap()]);
        assert!(!out.status.success(), "an edited {what} fails inspect");
        assert!(text(&out.stderr).contains("the manifest was changed after it was written"), "{what}: {}", text(&out.stderr));
    }
    // A manifest of format 2 (before manifests had a checksum) still reads.
    let mut json: serde_json::Value = serde_json::from_slice(&original).unwrap();
    json["format"] = 2.into();
    json.as_object_mut().unwrap().remove("checksum");
    std::fs::write(&manifest, serde_json::to_vec_pretty(&json).unwrap()).unwrap();
    let out = tessera(&["ckpt", "inspect", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn a_reader_that_goes_away_ends_the_command_quietly() {
    let base = scratch("pipe");
    save_tp2_pp2(&base);
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(["ckpt", "inspect", base.join("step-1").to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Close the read end before the report is written: `tessera … | head -0`.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert!(out.status.success() && !stderr.contains("panicked") && !stderr.contains("Broken pipe"), "{:?}: {stderr}", out.status);
    let _ = std::fs::remove_dir_all(&base);
}
