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
        (&["--comm", "mpi"][..], "mpirun -np N tessera profile --comm mpi"),
        (&["--comm", "nccl"][..], "--comm"),
    ] {
        let run = tessera(args);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success() && stderr.contains(says) && !stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

fn launch(args: &[&str], profile: &[&str]) -> std::process::Child {
    let exe = env!("CARGO_BIN_EXE_tessera");
    Command::new(exe)
        .arg("launch")
        .args(args)
        .args(["--", exe, "profile", "--seconds-per-figure", "0.01"])
        .args(profile)
        .env("RUST_BACKTRACE", "0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn under_a_launcher_the_processes_are_the_ranks_and_their_communicators_are_measured() {
    let dir = Scratch::new("cli-profile-job");
    // One node of two processes: the link inside it, fitted for a pair.
    let out = dir.path().join("node.toml");
    let run = launch(&["--nproc-per-node", "2"], &["--out", out.to_str().unwrap()]).wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(stderr.contains("a job of 2 processes, 2 per node") && stderr.contains("all-reduce over 2 ranks"), "{stderr}");
    let p = ClusterProfile::load(out.to_str().unwrap()).unwrap();
    assert_eq!(p.gpus_per_node, 2);
    assert_eq!(p.intra_node.by_size.iter().map(|f| f.size).collect::<Vec<_>>(), [2]);
    assert!(p.inter_node.is_none());

    // Two nodes of one process each (two launchers meeting at one port):
    // the link between nodes, which lets the planner span them.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let out = dir.path().join("nodes.toml");
    let nodes: Vec<_> = (0..2)
        .map(|n| launch(&["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", &n.to_string(), "--master-port", &port], &["--out", out.to_str().unwrap()]))
        .collect();
    for node in nodes {
        let run = node.wait_with_output().unwrap();
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    }
    let p = ClusterProfile::load(out.to_str().unwrap()).unwrap();
    assert_eq!(p.gpus_per_node, 1);
    let inter = p.inter_node.as_ref().expect("a profile of two nodes has the link between them");
    assert_eq!(inter.by_size.iter().map(|f| f.size).collect::<Vec<_>>(), [2]);
    assert!(inter.bandwidth > 0.0 && p.link(2, 1, 2).unwrap().bandwidth == inter.bandwidth);

    // --ranks means threads; under a launcher it is refused.
    let run = launch(&["--nproc-per-node", "1"], &["--ranks", "2"]).wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success() && stderr.contains("drop --ranks"), "{stderr}");

    // A GPU per process needs the CUDA backend (and a GPU): without them,
    // the job ends naming what is missing, not waiting for its peers.
    let run = launch(&["--nproc-per-node", "2"], &["--device", "cuda"]).wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success() && stderr.to_lowercase().contains("cuda") && !stderr.contains("panicked"), "{stderr}");
    let run = launch(&["--nproc-per-node", "1"], &["--device", "cuda", "--comm", "mpi"]).wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success() && stderr.contains("drop --comm mpi"), "{stderr}");
}
