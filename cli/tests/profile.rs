//! `tessera profile`, run as a program: the file it writes is a valid
//! profile of one node of the asked ranks, and bad arguments are refused.

use std::process::Command;
use tessera::testing::Scratch;
use tessera_plan::profile::ClusterProfile;

fn tessera(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tessera")).arg("profile").args(args).env("RUST_BACKTRACE", "0").output().unwrap()
}

#[test]
fn profile_writes_a_profile_the_planner_reads() {
    let dir = Scratch::new("cli-profile");
    let out = dir.path().join("machine.toml");
    let run = tessera(&["--ranks", "2", "--seconds-per-figure", "0.01", "--name", "ci", "--out", out.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(stderr.contains("all-reduce over 2 ranks"), "{stderr}");
    let p = ClusterProfile::load(out.to_str().unwrap()).unwrap();
    assert_eq!((p.name.as_str(), p.gpus_per_node), ("ci", 2));
    assert!(p.inter_node.is_none() && !p.device.matmul.is_empty());
    assert!(p.peak_flops("f32").unwrap() > 0.0 && p.peak_flops("bf16").unwrap() > 0.0);
    // Without --out the profile goes to stdout, as the same TOML.
    let run = tessera(&["--ranks", "1", "--seconds-per-figure", "0.01"]);
    assert!(run.status.success());
    let p = ClusterProfile::parse(&String::from_utf8_lossy(&run.stdout), "stdout").unwrap();
    assert_eq!(p.gpus_per_node, 1);
    assert!(p.intra_node.by_size.is_empty(), "one rank has no group to measure");
}

#[test]
fn bad_arguments_are_refused_naming_them() {
    for (args, says) in [
        (&["--ranks", "0"][..], "--ranks"),
        (&["--seconds-per-figure", "0"][..], "--seconds-per-figure"),
        (&["--seconds-per-figure", "nan"][..], "--seconds-per-figure"),
        (&["--ranks", "1", "--seconds-per-figure", "0.01", "--out", "/nonexistent/dir/p.toml"][..], "/nonexistent/dir/p.toml"),
    ] {
        let run = tessera(args);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success() && stderr.contains(says) && !stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
