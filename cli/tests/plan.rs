//! `tessera plan`, run as a program: it ranks layouts of a model on a
//! shipped cluster profile, writes the best as a training configuration the
//! trainer reads, estimates a configuration's own layout with `--evaluate`
//! (the same figures as the table), and refuses what cannot work.

use std::process::Command;
use tessera::testing::Scratch;
use tessera::train::TrainConfig;

fn tessera(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).arg("plan").args(args).env("RUST_BACKTRACE", "0").output().unwrap()
}

/// GPT-2 small as a training configuration's model.
const GPT2_SMALL: &str = "[model]\nkind = \"gpt2\"\nn_layer = 12\nn_embd = 768\nn_head = 12\nvocab_size = 50257\nn_positions = 1024\n\n[batch]\nseq_len = 1024\n\n[precision]\ncompute = \"bf16\"\n\n[optim]\nlr = 6e-4\n";

#[test]
fn plan_ranks_layouts_writes_the_best_and_evaluates_it_the_same() {
    let dir = Scratch::new("cli-plan");
    let model = dir.path().join("gpt2.toml");
    std::fs::write(&model, GPT2_SMALL).unwrap();
    let out = dir.path().join("plan.toml");
    let run = tessera(&["--model", model.to_str().unwrap(), "--cluster", "h100-sxm5-80gb", "--global-batch", "64", "--out", out.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains("layouts considered") && stdout.contains("MFU") && stdout.contains("the runner-up"), "{stdout}");
    // The plan is a configuration the trainer takes, with the model and the optimizer kept.
    let text = std::fs::read_to_string(&out).unwrap();
    let cfg = TrainConfig::parse(&text, &[]).unwrap();
    assert_eq!(cfg.mesh.world_size(), 8, "one node of eight devices");
    assert_eq!(cfg.mesh.dp * cfg.mesh.ep * cfg.batch.grad_accum * cfg.batch.micro_batch, 64, "the global batch");
    assert_eq!(cfg.optim.lr, 6e-4);
    assert_eq!(cfg.model.get("n_embd").and_then(|v| v.as_integer()), Some(768));
    // Its header states the estimate; evaluating the written plan gives the same step.
    let header = text.lines().next().unwrap();
    let said: f64 = header.split("estimated ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    let eval = tessera(&["--model", out.to_str().unwrap(), "--cluster", "h100-sxm5-80gb", "--evaluate"]);
    assert!(eval.status.success(), "{}", String::from_utf8_lossy(&eval.stderr));
    let line: serde_json::Value = serde_json::from_slice(&eval.stdout).unwrap();
    let step = line["step_s"].as_f64().unwrap();
    assert!((step - said).abs() <= 1e-4 * said.max(1e-9) + 5e-5, "evaluated {step} s, the plan said {said} s");
    assert!(line["memory_bytes"].as_f64().unwrap() <= 0.9 * 80e9, "the plan fits in memory: {line}");
    assert!(line["mfu"].as_f64().unwrap() > 0.0 && line["mfu"].as_f64().unwrap() < 1.0, "{line}");
    // GPT-2 small, its vocabulary padded if the plan splits it over tensor-parallel ranks.
    let params = line["params"].as_u64().unwrap();
    assert!((124_439_808..124_439_808 + 64 * 768).contains(&params), "{params} parameters");
}

#[test]
fn fixed_parts_of_the_layout_are_kept_by_the_plan() {
    let dir = Scratch::new("cli-plan-fix");
    let model = dir.path().join("gpt2.toml");
    std::fs::write(&model, GPT2_SMALL).unwrap();
    let out = dir.path().join("plan.toml");
    let m = model.to_str().unwrap();
    let fixed = ["--fix", "tp=2", "--fix", "zero=0", "--fix", "recompute=full", "--fix", "sp=false"];
    let mut args = vec!["--model", m, "--cluster", "h100-sxm5-80gb", "--global-batch", "64", "--out", out.to_str().unwrap()];
    args.extend(fixed);
    let run = tessera(&args);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let stdout = String::from_utf8_lossy(&run.stdout);
    let cfg = TrainConfig::parse(&std::fs::read_to_string(&out).unwrap(), &[]).unwrap();
    assert_eq!((cfg.mesh.tp, cfg.mesh.sp, cfg.zero.stage, cfg.recompute.mode.as_str()), (2, false, 0, "full"), "{stdout}");
    // Every layout in the table keeps them.
    let rows: Vec<&str> = stdout.lines().filter(|l| l.split_whitespace().nth(1).is_some_and(|w| w.starts_with("dp"))).collect();
    assert!(!rows.is_empty(), "{stdout}");
    for row in rows {
        assert!(row.contains(" tp2 ") && row.contains("recompute full zero0") && !row.contains(" sp "), "{row}");
    }
}

#[test]
fn a_model_no_layout_fits_is_refused_with_the_smallest_need() {
    let dir = Scratch::new("cli-plan-big");
    let model = dir.path().join("gpt3.toml");
    std::fs::write(&model, "[model]\nkind = \"gpt2\"\nn_layer = 96\nn_embd = 12288\nn_head = 96\nvocab_size = 51200\nn_positions = 2048\n[batch]\nseq_len = 2048\n[precision]\ncompute = \"bf16\"\n").unwrap();
    let run = tessera(&[
        "--model",
        model.to_str().unwrap(),
        "--cluster",
        "a100-sxm4-80gb",
        "--global-batch",
        "8",
        "--out",
        dir.path().join("p.toml").to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(stderr.contains("no layout fits") && stderr.contains("GiB per device") && stderr.contains("add nodes"), "{stderr}");
}

#[test]
fn a_profile_of_one_machine_refuses_a_plan_over_several_nodes_naming_the_missing_link() {
    let dir = Scratch::new("cli-plan-one-node");
    let model = dir.path().join("gpt2.toml");
    std::fs::write(&model, GPT2_SMALL).unwrap();
    let profile = dir.path().join("box.toml");
    std::fs::write(
        &profile,
        "name = \"box\"\ngpus_per_node = 8\n[device]\nname = \"H100\"\nmemory_bytes = 85520809984\nmemory_bandwidth = 3.35e12\n[device.peak_flops]\nbf16 = 989e12\n[intra_node]\nbandwidth = 450e9\nlatency = 5e-6\n",
    )
    .unwrap();
    let (m, p) = (model.to_str().unwrap(), profile.to_str().unwrap());
    let run = tessera(&["--model", m, "--cluster", p, "--nodes", "2", "--global-batch", "64"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(stderr.contains("no link between nodes") && stderr.contains("[inter_node]"), "{stderr}");
    // One node of it plans.
    let out = dir.path().join("plan.toml");
    assert!(tessera(&["--model", m, "--cluster", p, "--global-batch", "64", "--out", out.to_str().unwrap()]).status.success());
}

#[test]
fn bad_arguments_are_refused_naming_them() {
    let dir = Scratch::new("cli-plan-bad");
    let model = dir.path().join("gpt2.toml");
    std::fs::write(&model, GPT2_SMALL).unwrap();
    let m = model.to_str().unwrap();
    for (args, says) in [
        (vec!["--model", m, "--cluster", "tpu-v9"], "tpu-v9"),
        (vec!["--model", "/nonexistent/model.toml", "--cluster", "h100-sxm5-80gb"], "/nonexistent/model.toml"),
        (vec!["--model", m, "--cluster", "h100-sxm5-80gb", "--memory-fraction", "0"], "--memory-fraction"),
        (vec!["--model", m, "--cluster", "h100-sxm5-80gb", "--set", "mesh.tp=5", "--evaluate"], "tp"),
        (vec!["--model", m, "--cluster", "h100-sxm5-80gb", "--global-batch", "0"], "positive"),
        (vec!["--model", m, "--cluster", "h100-sxm5-80gb", "--fix", "zero=5"], "zero=5"),
        (vec!["--model", m, "--cluster", "h100-sxm5-80gb", "--fix", "tp=3"], "keeping tp=3"),
    ] {
        let run = tessera(&args);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success(), "{args:?} should fail");
        assert!(stderr.contains(says), "{args:?}: the error should name {says}: {stderr}");
    }
}

/// A 64-billion-parameter model whose states no split of one node's eight
/// 80 GB devices can hold fits with ZeRO-Offload: the plan puts the
/// optimizer state in the node's host memory, writes `zero.offload`, and
/// states what the host holds; with offload ruled out it is refused.
#[test]
fn a_model_whose_states_fit_only_in_host_memory_is_planned_with_offload() {
    let dir = Scratch::new("cli-plan-offload");
    let model = dir.path().join("big.toml");
    std::fs::write(&model, "[model]\nkind = \"gpt2\"\nn_layer = 80\nn_embd = 8192\nn_head = 64\nvocab_size = 51200\nn_positions = 2048\n[batch]\nseq_len = 2048\n[precision]\ncompute = \"bf16\"\n").unwrap();
    let out = dir.path().join("plan.toml");
    let (m, o) = (model.to_str().unwrap(), out.to_str().unwrap());
    let run = tessera(&["--model", m, "--cluster", "a100-sxm4-80gb", "--global-batch", "8", "--out", o]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    let cfg = TrainConfig::parse(&std::fs::read_to_string(&out).unwrap(), &[]).unwrap();
    assert!(cfg.zero.offload && cfg.zero.stage >= 1, "{stdout}");
    let eval = tessera(&["--model", o, "--cluster", "a100-sxm4-80gb", "--evaluate"]);
    let line: serde_json::Value = serde_json::from_slice(&eval.stdout).unwrap();
    assert!(line["layout"].as_str().unwrap().ends_with("offload"), "{line}");
    assert!(line["memory_bytes"].as_f64().unwrap() <= 0.9 * 80e9, "{line}");
    // Host: the f32 master copy, both moments and a bf16 gradient shard,
    // 14 bytes per parameter over the node's ranks, within its 2 TB.
    let host = line["host_bytes"].as_f64().unwrap() * 8.0;
    let params = line["params"].as_f64().unwrap();
    assert!((host - 14.0 * params).abs() <= 0.01 * host && host <= 0.9 * 2e12, "{host} bytes of host memory for {params} parameters");
    let refused = tessera(&["--model", m, "--cluster", "a100-sxm4-80gb", "--global-batch", "8", "--fix", "offload=false"]);
    assert!(!refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains("no layout fits"));
}
