//! Tests of launcher detection over generated environments, and of the
//! Slurm list parsers over generated lists.

use super::hostlist;
use super::*;
use std::collections::HashMap;

/// SplitMix64: a small deterministic generator, so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
}

type Vars = HashMap<String, String>;

fn vars(pairs: &[(&str, &str)]) -> Vars {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn detect(v: &Vars) -> Result<Option<ProcessEnv>> {
    ProcessEnv::from_vars(|k| v.get(k).cloned())
}

/// The variable an `Error::Environment` names, and its message.
fn env_err(v: &Vars) -> (String, String) {
    match detect(v) {
        Err(e @ Error::Environment { .. }) => {
            let Error::Environment { var, .. } = &e else { unreachable!() };
            (var.clone(), e.to_string())
        }
        other => panic!("expected an environment error for {v:?}, got {other:?}"),
    }
}

/// Where every rank of a job runs: ranks numbered node by node.
struct Layout {
    per_node: Vec<usize>,
}

impl Layout {
    fn world(&self) -> usize {
        self.per_node.iter().sum()
    }

    /// (node, local rank, local size) of `rank`.
    fn place(&self, rank: usize) -> (usize, usize, usize) {
        let mut first = 0;
        for (node, &n) in self.per_node.iter().enumerate() {
            if rank < first + n {
                return (node, rank - first, n);
            }
            first += n;
        }
        unreachable!("rank {rank} outside the layout")
    }

    fn random(rng: &mut Rng) -> Layout {
        let nodes = 1 + rng.below(5) as usize;
        let uniform = rng.chance(60);
        let n0 = 1 + rng.below(8) as usize;
        Layout { per_node: (0..nodes).map(|_| if uniform { n0 } else { 1 + rng.below(8) as usize }).collect() }
    }

    /// Slurm's compressed task counts: `4(x2),3`.
    fn tasks_per_node(&self) -> String {
        let mut out: Vec<String> = Vec::new();
        let mut i = 0;
        while i < self.per_node.len() {
            let c = self.per_node[i];
            let run = self.per_node[i..].iter().take_while(|&&x| x == c).count();
            out.push(if run > 1 { format!("{c}(x{run})") } else { c.to_string() });
            i += run;
        }
        out.join(",")
    }
}

/// The variables `launcher` sets for `rank` of `layout`, and what
/// detection must make of them.
fn launch(rng: &mut Rng, launcher: Launcher, layout: &Layout, rank: usize) -> (Vars, ProcessEnv) {
    let world = layout.world();
    let (node, local, local_size) = layout.place(rank);
    let mut v = Vars::new();
    let mut set = |k: &str, val: String| {
        v.insert(k.to_string(), val);
    };
    let multi = layout.per_node.len() > 1;
    let master_addr = if (multi && launcher != Launcher::Slurm) || rng.chance(30) { Some(format!("host{}", rng.below(100))) } else { None };
    let master_port = if rng.chance(30) { Some(1 + rng.below(65535) as u16) } else { None };
    let mut expect = ProcessEnv {
        rank,
        world_size: world,
        local_rank: local,
        local_world_size: local_size,
        node_rank: rank / local_size,
        master_addr: master_addr.clone().unwrap_or_else(|| "127.0.0.1".into()),
        master_port: master_port.unwrap_or(DEFAULT_MASTER_PORT),
        restart: 0,
        launcher,
    };
    match launcher {
        Launcher::Torchrun => {
            set("RANK", rank.to_string());
            set("WORLD_SIZE", world.to_string());
            set("LOCAL_RANK", local.to_string());
            set("LOCAL_WORLD_SIZE", local_size.to_string());
            if rng.chance(50) {
                set("GROUP_RANK", node.to_string());
                expect.node_rank = node;
            }
        }
        Launcher::OpenMpi => {
            set("OMPI_COMM_WORLD_RANK", rank.to_string());
            set("OMPI_COMM_WORLD_SIZE", world.to_string());
            set("OMPI_COMM_WORLD_LOCAL_RANK", local.to_string());
            set("OMPI_COMM_WORLD_LOCAL_SIZE", local_size.to_string());
            // Not the node index: must not be taken for it.
            set("OMPI_COMM_WORLD_NODE_RANK", local.to_string());
        }
        Launcher::Mpich => {
            set("PMI_RANK", rank.to_string());
            set("PMI_SIZE", world.to_string());
            set("MPI_LOCALRANKID", local.to_string());
            set("MPI_LOCALNRANKS", local_size.to_string());
        }
        Launcher::Slurm => {
            let job = rng.below(10_000_000);
            let step = rng.below(40);
            let pad = 1 + rng.below(3) as usize;
            let first = rng.below(50) as usize;
            let nodes = layout.per_node.len();
            let list = if nodes == 1 { format!("cn{first:0pad$}") } else { format!("cn[{first:0pad$}-{:0pad$}],login", first + nodes - 1) };
            set("SLURM_JOB_ID", job.to_string());
            set("SLURM_JOBID", job.to_string());
            set("SLURM_STEP_ID", step.to_string());
            set("SLURM_STEPID", step.to_string());
            set("SLURM_PROCID", rank.to_string());
            set("SLURM_LOCALID", local.to_string());
            set("SLURM_NODEID", node.to_string());
            set("SLURM_NTASKS", world.to_string());
            set("SLURM_STEP_NUM_TASKS", world.to_string());
            set("SLURM_TASKS_PER_NODE", layout.tasks_per_node());
            set("SLURM_STEP_TASKS_PER_NODE", layout.tasks_per_node());
            set("SLURM_JOB_NODELIST", format!("{list},spare[1-2]"));
            set("SLURM_STEP_NODELIST", list);
            expect.node_rank = node;
            if master_addr.is_none() {
                expect.master_addr = format!("cn{first:0pad$}");
            }
            if master_port.is_none() {
                expect.master_port = (20000 + 10 * (job % 1000) + step % 10) as u16;
            }
        }
    }
    if let Some(a) = master_addr {
        set("MASTER_ADDR", a);
    }
    if let Some(p) = master_port {
        set("MASTER_PORT", p.to_string());
    }
    match rng.below(4) {
        0 => {
            set("TESSERA_RESTART_COUNT", "3".into());
            set("TORCHELASTIC_RESTART_COUNT", "7".into());
            expect.restart = 3;
        }
        1 => {
            set("TORCHELASTIC_RESTART_COUNT", "7".into());
            expect.restart = 7;
        }
        2 => {
            set("SLURM_RESTART_COUNT", "2".into());
            if launcher == Launcher::Slurm {
                expect.restart = 2;
            }
        }
        _ => {}
    }
    (v, expect)
}

const LAUNCHERS: [Launcher; 4] = [Launcher::Torchrun, Launcher::OpenMpi, Launcher::Mpich, Launcher::Slurm];

#[test]
fn every_launcher_over_generated_layouts() {
    let mut rng = Rng(1);
    let mut cases = 0;
    for _ in 0..300 {
        let layout = Layout::random(&mut rng);
        let launcher = *rng.pick(&LAUNCHERS);
        for rank in 0..layout.world() {
            let (v, expect) = launch(&mut rng, launcher, &layout, rank);
            assert_eq!(detect(&v).unwrap(), Some(expect), "{v:?}");
            cases += 1;
        }
    }
    assert!(cases > 1000);
}

#[test]
fn the_innermost_launcher_wins() {
    // Variables of several launchers at once, with different values: the
    // first present in the order torchrun, Open MPI, MPICH, Slurm is used,
    // alone.
    let mut rng = Rng(2);
    for _ in 0..500 {
        let present: Vec<Launcher> = LAUNCHERS.iter().copied().filter(|_| rng.chance(50)).collect();
        let mut all = Vars::new();
        let mut expected = None;
        // Insert from the lowest priority up, so that shared variables
        // (MASTER_ADDR, restart counts) end up as the winner's.
        for &l in present.iter().rev() {
            let layout = Layout::random(&mut rng);
            let rank = rng.below(layout.world() as u64) as usize;
            let (v, e) = launch(&mut rng, l, &layout, rank);
            for k in ["MASTER_ADDR", "MASTER_PORT", "TESSERA_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"] {
                all.remove(k);
            }
            all.extend(v);
            expected = Some(e);
        }
        let got = detect(&all).unwrap();
        match (got, expected) {
            (Some(g), Some(e)) => assert_eq!(g, e, "{all:?}"),
            (None, None) => {}
            (g, e) => panic!("{all:?}: got {g:?}, expected {e:?}"),
        }
    }
}

#[test]
fn no_launcher_is_a_single_process_run() {
    assert_eq!(detect(&Vars::new()).unwrap(), None);
    // Unrelated variables, and a master address alone, are no launcher.
    assert_eq!(detect(&vars(&[("MASTER_ADDR", "node1"), ("MASTER_PORT", "1234"), ("TESSERA_RESTART_COUNT", "2")])).unwrap(), None);
}

#[test]
fn an_sbatch_script_is_not_rank_0_of_its_tasks() {
    // What the batch script of `sbatch -N2 --ntasks-per-node=4` sees.
    let batch = vars(&[
        ("SLURM_JOB_ID", "4242"),
        ("SLURM_JOBID", "4242"),
        ("SLURM_PROCID", "0"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NODEID", "0"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_TASKS_PER_NODE", "4(x2)"),
        ("SLURM_JOB_NODELIST", "gpu[01-02]"),
        ("ENVIRONMENT", "BATCH"),
    ]);
    assert_eq!(detect(&batch).unwrap(), None);
    // Slurm's reserved step ids: batch, interactive, external, pending.
    for reserved in [0xFFFF_FFFBu64, 0xFFFF_FFFA, 0xFFFF_FFFC, 0xFFFF_FFFD, 0xFFFF_FFF0] {
        for var in ["SLURM_STEP_ID", "SLURM_STEPID"] {
            let mut v = batch.clone();
            v.insert(var.into(), reserved.to_string());
            assert_eq!(detect(&v).unwrap(), None, "{var}={reserved}");
        }
    }
    // A task of step 0 of the same job is rank 0 of 8.
    let mut task = batch.clone();
    task.insert("SLURM_STEP_ID".into(), "0".into());
    let env = detect(&task).unwrap().unwrap();
    assert_eq!((env.rank, env.world_size, env.local_world_size, env.launcher), (0, 8, 4, Launcher::Slurm));
    assert_eq!((env.master_addr.as_str(), env.master_port), ("gpu01", 20000 + 10 * 242));
    // The older spelling alone is enough.
    let mut old = batch.clone();
    old.insert("SLURM_STEPID".into(), "3".into());
    assert_eq!(detect(&old).unwrap().unwrap().master_port, 20000 + 10 * 242 + 3);
    // mpirun inside the batch script: MPI's variables describe the process.
    let mut mpi = batch;
    mpi.extend(vars(&[
        ("OMPI_COMM_WORLD_RANK", "5"),
        ("OMPI_COMM_WORLD_SIZE", "8"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ("MASTER_ADDR", "gpu01"),
    ]));
    let env = detect(&mpi).unwrap().unwrap();
    assert_eq!((env.rank, env.node_rank, env.launcher), (5, 1, Launcher::OpenMpi));
}

#[test]
fn srun_with_slurms_pmi_uses_the_slurm_step() {
    // `srun --mpi=pmi2` sets PMI_RANK and PMI_SIZE but not Hydra's local
    // variables: the step's own variables give the local rank.
    let v = vars(&[
        ("PMI_RANK", "6"),
        ("PMI_SIZE", "8"),
        ("SLURM_STEP_ID", "1"),
        ("SLURM_PROCID", "6"),
        ("SLURM_LOCALID", "2"),
        ("SLURM_NODEID", "1"),
        ("SLURM_STEP_NUM_TASKS", "8"),
        ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
        ("SLURM_STEP_NODELIST", "a[7-8]"),
    ]);
    let env = detect(&v).unwrap().unwrap();
    assert_eq!((env.launcher, env.rank, env.local_rank, env.node_rank, env.master_addr.as_str()), (Launcher::Slurm, 6, 2, 1, "a7"));
    // Without a step, the missing Hydra variable is named.
    let (var, msg) = env_err(&vars(&[("PMI_RANK", "6"), ("PMI_SIZE", "8")]));
    assert_eq!(var, "MPI_LOCALRANKID", "{msg}");
}

#[test]
fn master_address_rules() {
    let one_node =
        vars(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_LOCAL_RANK", "1"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "4")]);
    assert_eq!(detect(&one_node).unwrap().unwrap().master_addr, "127.0.0.1");
    let mut two_nodes = one_node.clone();
    two_nodes.insert("OMPI_COMM_WORLD_LOCAL_SIZE".into(), "2".into());
    let (var, msg) = env_err(&two_nodes);
    assert_eq!(var, "MASTER_ADDR");
    assert!(msg.contains("mpirun -x MASTER_ADDR="), "{msg}");
    two_nodes.insert("MASTER_ADDR".into(), " [fe80::1] ".into());
    assert_eq!(detect(&two_nodes).unwrap().unwrap().master_addr, "fe80::1");
    for good in ["node-01.cluster", "node-01.cluster.", "10.1.2.3", "::1", "LOCALHOST", "a_b"] {
        two_nodes.insert("MASTER_ADDR".into(), good.into());
        assert_eq!(detect(&two_nodes).unwrap().unwrap().master_addr, good);
    }
    for bad in ["", ".", "tcp://node1", "node1:29500", "node 1", "a..b", ".a", "ünï"] {
        two_nodes.insert("MASTER_ADDR".into(), bad.into());
        let (var, msg) = env_err(&two_nodes);
        assert_eq!(var, "MASTER_ADDR");
        assert!(msg.contains(&format!("`{bad}`")), "{msg}");
    }
}

/// Every required variable of every launcher: missing, malformed and
/// out-of-range values are errors that name the variable and the value.
#[test]
fn malformed_and_partial_sets_name_the_variable() {
    let mut rng = Rng(3);
    let layout = Layout { per_node: vec![4, 4] };
    for launcher in LAUNCHERS {
        let (good, _) = launch(&mut rng, launcher, &layout, 5);
        let required: &[&str] = match launcher {
            Launcher::Torchrun => &["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            Launcher::OpenMpi => &["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"],
            Launcher::Mpich => &["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
            Launcher::Slurm => &["SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"],
        };
        for &var in required {
            let mut v = good.clone();
            v.remove(var);
            assert_eq!(env_err(&v).0, var, "{launcher}: {var} missing");
            for junk in ["", "x", "-1", "1.5", "0x3", "99999999999999999999999", "3 4"] {
                let mut v = good.clone();
                v.insert(var.into(), junk.into());
                let (name, msg) = env_err(&v);
                assert_eq!(name, var, "{launcher}: {var}={junk}: {msg}");
                assert!(msg.contains(&format!("`{junk}`")), "{msg}");
            }
        }
        // A rank not below the world size.
        let mut v = good.clone();
        v.insert(required[0].into(), "8".into());
        let (name, msg) = env_err(&v);
        assert_eq!(name, required[0]);
        assert!(msg.contains("=8 is not below") && msg.contains("=8"), "{msg}");
        // A world of zero.
        let world_var = if launcher == Launcher::Slurm { "SLURM_STEP_NUM_TASKS" } else { required[1] };
        let mut v = good.clone();
        v.insert(world_var.into(), "0".into());
        v.remove("SLURM_STEP_TASKS_PER_NODE");
        assert_eq!(env_err(&v).0, world_var);
        // A local rank not below the local size.
        let mut v = good.clone();
        v.insert(required[if launcher == Launcher::Slurm { 1 } else { 2 }].into(), "4".into());
        let (name, msg) = env_err(&v);
        assert!(msg.contains("is not below"), "{name}: {msg}");
        // Ports.
        for port in ["0", "65536", "-1", "http", "29500x", ""] {
            let mut v = good.clone();
            v.insert("MASTER_PORT".into(), port.into());
            let (name, msg) = env_err(&v);
            assert_eq!(name, "MASTER_PORT");
            assert!(msg.contains(&format!("`{port}`")), "{msg}");
        }
        for (var, value) in [("TESSERA_RESTART_COUNT", "x"), ("TORCHELASTIC_RESTART_COUNT", "-2"), ("TESSERA_RESTART_COUNT", "4294967296")] {
            let mut v = good.clone();
            for k in ["TESSERA_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"] {
                v.remove(k);
            }
            v.insert(var.into(), value.into());
            assert_eq!(env_err(&v).0, var);
        }
    }
}

#[test]
fn torchrun_partial_sets() {
    let (var, msg) = env_err(&vars(&[("RANK", "0")]));
    assert_eq!(var, "WORLD_SIZE");
    assert!(msg.contains("RANK is"), "{msg}");
    let (var, _) = env_err(&vars(&[("RANK", "0"), ("WORLD_SIZE", "2")]));
    assert_eq!(var, "LOCAL_RANK");
    let (var, _) = env_err(&vars(&[("LOCAL_RANK", "0")]));
    assert_eq!(var, "RANK");
    let (var, msg) = env_err(&vars(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "8")]));
    assert_eq!(var, "LOCAL_WORLD_SIZE");
    assert!(msg.contains("more than WORLD_SIZE=4"), "{msg}");
    let (var, _) =
        env_err(&vars(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2"), ("GROUP_RANK", "4"), ("MASTER_ADDR", "a")]));
    assert_eq!(var, "GROUP_RANK");
    // Whitespace around numbers is tolerated, as shells leave it.
    let env = detect(&vars(&[("RANK", " 1"), ("WORLD_SIZE", "2 "), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")])).unwrap().unwrap();
    assert_eq!((env.rank, env.master_addr.as_str(), env.master_port), (1, "127.0.0.1", 29500));
}

#[test]
fn slurm_inconsistencies() {
    let mut rng = Rng(4);
    let layout = Layout { per_node: vec![4, 4, 3] };
    let (good, _) = launch(&mut rng, Launcher::Slurm, &layout, 9);
    let case = |changes: &[(&str, Option<&str>)]| {
        let mut v = good.clone();
        for (k, val) in changes {
            match val {
                Some(x) => v.insert(k.to_string(), x.to_string()),
                None => v.remove(*k),
            };
        }
        env_err(&v)
    };
    assert_eq!(case(&[("SLURM_STEP_TASKS_PER_NODE", Some("4(x2"))]).0, "SLURM_STEP_TASKS_PER_NODE");
    assert_eq!(case(&[("SLURM_STEP_TASKS_PER_NODE", Some("4(x2)"))]).0, "SLURM_STEP_TASKS_PER_NODE");
    let (var, msg) = case(&[("SLURM_STEP_TASKS_PER_NODE", Some("4(x2),2"))]);
    assert!(var == "SLURM_STEP_TASKS_PER_NODE" && msg.contains("adds up to 10"), "{msg}");
    assert_eq!(case(&[("SLURM_STEP_NODELIST", Some("cn[1-"))]).0, "SLURM_STEP_NODELIST");
    assert_eq!(case(&[("SLURM_STEP_NODELIST", Some("cn[3-1]"))]).0, "SLURM_STEP_NODELIST");
    assert_eq!(case(&[("SLURM_STEP_NODELIST", None), ("SLURM_JOB_NODELIST", Some(",x"))]).0, "SLURM_JOB_NODELIST");
    let (var, msg) = case(&[("SLURM_STEP_NODELIST", None), ("SLURM_JOB_NODELIST", None), ("MASTER_ADDR", None)]);
    assert!(var == "SLURM_JOB_NODELIST" && msg.contains("MASTER_ADDR"), "{msg}");
    assert_eq!(case(&[("SLURM_STEP_NUM_TASKS", None), ("SLURM_NTASKS", None)]).0, "SLURM_NTASKS");
    assert_eq!(case(&[("SLURM_STEP_TASKS_PER_NODE", None), ("SLURM_TASKS_PER_NODE", None)]).0, "SLURM_TASKS_PER_NODE", "no local size at all");
    assert_eq!(case(&[("SLURM_STEP_ID", Some("batch"))]).0, "SLURM_STEP_ID");
    assert_eq!(case(&[("SLURM_JOB_ID", Some("12x")), ("MASTER_PORT", None)]).0, "SLURM_JOB_ID");
    // The older and the per-job variables stand in for the step's own.
    let mut v = good.clone();
    for k in ["SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST"] {
        v.remove(k);
    }
    v.insert("SLURM_JOB_NODELIST".into(), "z[5-7]".into());
    v.remove("MASTER_ADDR");
    let env = detect(&v).unwrap().unwrap();
    assert_eq!((env.rank, env.world_size, env.local_world_size, env.node_rank, env.master_addr.as_str()), (9, 11, 3, 2, "z5"));
    v.remove("SLURM_TASKS_PER_NODE");
    v.insert("SLURM_NTASKS_PER_NODE".into(), "4".into());
    assert_eq!(detect(&v).unwrap().unwrap().local_world_size, 4);
    // A malformed job id does not matter when MASTER_PORT is given.
    v.insert("SLURM_JOB_ID".into(), "junk".into());
    v.insert("MASTER_PORT".into(), "4000".into());
    assert_eq!(detect(&v).unwrap().unwrap().master_port, 4000);
}

#[test]
fn a_stray_outer_variable_does_not_fail_an_inner_launch() {
    // torchrun inside a Slurm step whose variables are odd: torchrun's win,
    // and Slurm's are not even parsed.
    let v = vars(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"), ("SLURM_STEP_ID", "garbage"), ("PMI_RANK", "x")]);
    assert_eq!(detect(&v).unwrap().unwrap().launcher, Launcher::Torchrun);
}

/// Random environments drawn from valid and invalid values: detection
/// never panics, and whatever it accepts is consistent.
#[test]
fn random_environments_never_panic() {
    const NAMES: &[&str] = &[
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TESSERA_RESTART_COUNT",
        "TORCHELASTIC_RESTART_COUNT",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
        "SLURM_STEP_ID",
        "SLURM_STEPID",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_NTASKS",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_TASKS_PER_NODE",
        "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_JOB_NODELIST",
        "SLURM_STEP_NODELIST",
        "SLURM_NODELIST",
        "SLURM_JOB_ID",
        "SLURM_RESTART_COUNT",
    ];
    const VALUES: &[&str] = &[
        "0",
        "1",
        "2",
        "3",
        "4",
        "7",
        "8",
        "16",
        " 2 ",
        "",
        "x",
        "-1",
        "1.0",
        "4(x2),3",
        "2(x4)",
        "4(x0)",
        "(x2)",
        "node[01-04,07],gpu-a[1-2]",
        "n[",
        "n]",
        "n[2-1]",
        "n[1-99999999999999]",
        "[]",
        ",",
        "localhost",
        "10.0.0.1",
        "::1",
        "[::1]",
        "65535",
        "65536",
        "4294967295",
        "4294967291",
        "18446744073709551616",
        "üñí",
        "a\u{0}b",
    ];
    let mut rng = Rng(5);
    let mut accepted = 0;
    for _ in 0..20_000 {
        // Start from nothing, or from a launcher's valid set, and change a
        // few variables at random.
        let mut v = if rng.chance(25) {
            Vars::new()
        } else {
            let layout = Layout::random(&mut rng);
            let rank = rng.below(layout.world() as u64) as usize;
            let launcher = *rng.pick(&LAUNCHERS);
            launch(&mut rng, launcher, &layout, rank).0
        };
        for _ in 0..rng.below(5) {
            let name = rng.pick(NAMES).to_string();
            if rng.chance(30) {
                v.remove(&name);
            } else {
                v.insert(name, rng.pick(VALUES).to_string());
            }
        }
        match detect(&v) {
            Ok(Some(e)) => {
                accepted += 1;
                assert!(e.rank < e.world_size && e.local_rank < e.local_world_size && e.local_world_size <= e.world_size, "{v:?} -> {e:?}");
                assert!(e.node_rank < e.world_size && e.master_port > 0 && !e.master_addr.is_empty(), "{v:?} -> {e:?}");
            }
            Ok(None) => {}
            Err(Error::Environment { var, detail }) => {
                assert!(!var.is_empty() && !detail.is_empty());
            }
            Err(e) => panic!("{v:?}: an error of the wrong kind: {e:?}"),
        }
    }
    assert!(accepted > 2000, "the generator produced only {accepted} valid environments");
}

// ---- hostlist ----

#[test]
fn hostlist_examples() {
    let ok: &[(&str, &[&str])] = &[
        ("node1", &["node1"]),
        ("a,b,c", &["a", "b", "c"]),
        ("node[01-04,07]", &["node01", "node02", "node03", "node04", "node07"]),
        ("gpu-a[1-2],node[8-10]", &["gpu-a1", "gpu-a2", "node8", "node9", "node10"]),
        ("n[08-10]", &["n08", "n09", "n10"]),
        ("n[098-101]", &["n098", "n099", "n100", "n101"]),
        ("r[1-2]n[1-2]", &["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("[1-2]x", &["1x", "2x"]),
        ("n[5]", &["n5"]),
        ("a[1-2].dom,b", &["a1.dom", "a2.dom", "b"]),
        ("n[0-0]", &["n0"]),
        ("n[007]", &["n007"]),
    ];
    for (list, hosts) in ok {
        assert_eq!(hostlist::expand(list).unwrap(), *hosts, "{list}");
        assert_eq!(hostlist::first(list).unwrap(), hosts[0], "{list}");
    }
    for bad in [
        "",
        ",",
        "a,",
        ",a",
        "a,,b",
        "n[",
        "n]",
        "n[1-",
        "n[-2]",
        "n[2-1]",
        "n[1,]",
        "n[]",
        "n[a-b]",
        "n[1-2-3]",
        "a b",
        "n[1-2]]",
        "n[[1]]",
        "n[1234567890123456789]",
    ] {
        assert!(hostlist::expand(bad).is_err(), "{bad:?} expanded");
        assert!(hostlist::first(bad).is_err(), "{bad:?} gave a first host");
    }
    // Bounded: a list naming too many hosts is an error, not an allocation;
    // its first host is still known.
    assert!(hostlist::expand("n[0-99999999999]").is_err());
    assert!(hostlist::expand("a[0-9999]b[0-9999]").is_err());
    assert_eq!(hostlist::first("n[0-99999999999]").unwrap(), "n0");
}

/// Host lists written in Slurm's syntax from a generated model of the
/// hosts, expanded back: the result is the model.
#[test]
fn hostlist_round_trips_generated_lists() {
    let mut rng = Rng(6);
    for _ in 0..2000 {
        let mut text = Vec::new();
        let mut want = Vec::new();
        for _ in 0..1 + rng.below(4) {
            let prefix = rng.pick(&["node", "gpu-a", "c", "rack1-n", "x.y", ""]).to_string();
            let suffix = rng.pick(&["", "", ".ib", "-eth0"]).to_string();
            if prefix.is_empty() && suffix.is_empty() || rng.chance(20) {
                let name = format!("{prefix}h{}{suffix}", rng.below(100));
                want.push(name.clone());
                text.push(name);
                continue;
            }
            let mut parts = Vec::new();
            let mut nums = Vec::new();
            for _ in 0..1 + rng.below(3) {
                let width = if rng.chance(50) { 1 } else { 2 + rng.below(3) as usize };
                let lo = rng.below(120);
                let hi = if rng.chance(30) { lo } else { lo + rng.below(15) };
                parts.push(if lo == hi { format!("{lo:0width$}") } else { format!("{lo:0width$}-{hi:0width$}") });
                nums.extend((lo..=hi).map(|k| format!("{k:0width$}")));
            }
            text.push(format!("{prefix}[{}]{suffix}", parts.join(",")));
            want.extend(nums.into_iter().map(|n| format!("{prefix}{n}{suffix}")));
        }
        let list = text.join(",");
        assert_eq!(hostlist::expand(&list).unwrap(), want, "{list}");
        assert_eq!(hostlist::first(&list).unwrap(), want[0], "{list}");
    }
}

/// Random bytes and mutations of valid lists: the parsers never panic,
/// and `first` agrees with `expand` whenever both succeed.
#[test]
fn hostlist_parsers_survive_garbage() {
    let mut rng = Rng(7);
    let alphabet = b"n0123456789[],-()x.a \x00";
    let seeds = ["node[01-04,07],gpu-a[1-2]", "r[1-2]n[1-2]", "4(x2),3", "a,b"];
    for i in 0..50_000 {
        let s: String = if i % 2 == 0 {
            (0..rng.below(24)).map(|_| *rng.pick(alphabet) as char).collect()
        } else {
            let mut b = rng.pick(&seeds).as_bytes().to_vec();
            for _ in 0..1 + rng.below(3) {
                let at = rng.below(b.len() as u64 + 1) as usize;
                match rng.below(3) {
                    0 if at < b.len() => {
                        b.remove(at);
                    }
                    1 => b.insert(at, *rng.pick(alphabet)),
                    _ if at < b.len() => b[at] = *rng.pick(alphabet),
                    _ => {}
                }
            }
            String::from_utf8_lossy(&b).into_owned()
        };
        let expanded = hostlist::expand(&s);
        let first = hostlist::first(&s);
        // `first` checks what `expand` checks, less the size bound.
        assert!(expanded.is_err() || first.is_ok(), "{s:?}");
        assert!(first.is_ok() || expanded.is_err(), "{s:?}");
        if let (Ok(e), Ok(f)) = (&expanded, &first) {
            assert_eq!(&e[0], f, "{s:?}");
        }
        if let Ok(counts) = hostlist::tasks_per_node(&s) {
            assert!(!counts.is_empty(), "{s:?}");
        }
    }
}

#[test]
fn tasks_per_node_round_trips() {
    let mut rng = Rng(8);
    for _ in 0..2000 {
        let layout = Layout { per_node: (0..1 + rng.below(20)).map(|_| 1 + rng.below(3) as usize).collect() };
        let text = layout.tasks_per_node();
        assert_eq!(hostlist::tasks_per_node(&text).unwrap(), layout.per_node, "{text}");
    }
    assert_eq!(hostlist::tasks_per_node("8").unwrap(), [8]);
    for bad in ["", "4(x)", "4(2)", "4(x2", "4x2", "(x2)", "4(x0)", "a", "4,,2", "4(x2)3", "1(x2000000)"] {
        assert!(hostlist::tasks_per_node(bad).is_err(), "{bad:?}");
    }
}
