//! `tessera launch`, run as a program over small shell-script ranks: the
//! environment of every rank on one and several nodes, the prefixed output,
//! a failure that stops the other ranks and leaves no process behind,
//! restarts, the launcher's own signals, and the refusal of bad arguments.
//!
//! Waits are bounded but generous (a loaded two-core machine starts a shell
//! slowly); ranks that must be alive when something happens write their pids
//! to files the test waits for instead of sleeping a guessed time.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};
use tessera::backend::cuda::report_skip;
use tessera::testing::Scratch;

/// The longest any launcher here may run before the test kills it and fails.
const LIMIT: Duration = Duration::from_secs(30);

fn launcher(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tessera"));
    cmd.arg("launch").args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

/// A launcher whose ranks run the shell script `script`.
fn sh(args: &[&str], script: &str) -> Command {
    let mut all = args.to_vec();
    all.extend(["--", "sh", "-c", script]);
    launcher(&all)
}

struct Running {
    child: Child,
    stdout: JoinHandle<String>,
    stderr: JoinHandle<String>,
    started: Instant,
}

struct Finished {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

fn read_all(mut pipe: impl Read + Send + 'static) -> JoinHandle<String> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        pipe.read_to_end(&mut bytes).unwrap();
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

fn start(mut cmd: Command) -> Running {
    let started = Instant::now();
    let mut child = cmd.spawn().unwrap();
    let stdout = read_all(child.stdout.take().unwrap());
    let stderr = read_all(child.stderr.take().unwrap());
    Running { child, stdout, stderr, started }
}

impl Running {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the launcher to exit; kills it and fails past [`LIMIT`].
    fn finish(mut self) -> Finished {
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if self.started.elapsed() > LIMIT {
                self.child.kill().unwrap();
                self.child.wait().unwrap();
                panic!("the launcher ran for more than {LIMIT:?}; its stderr: {}", self.stderr.join().unwrap());
            }
            thread::sleep(Duration::from_millis(10));
        };
        let elapsed = self.started.elapsed();
        Finished { code: status.code(), stdout: self.stdout.join().unwrap(), stderr: self.stderr.join().unwrap(), elapsed }
    }
}

fn run(cmd: Command) -> Finished {
    start(cmd).finish()
}

impl Finished {
    fn success(&self) -> &Self {
        assert_eq!(self.code, Some(0), "the launcher failed; stderr:\n{}", self.stderr);
        self
    }

    fn fails_with(&self, code: i32) -> &Self {
        assert_eq!(self.code, Some(code), "the launcher should exit with {code}; stderr:\n{}", self.stderr);
        self
    }

    fn says(&self, needle: &str) -> &Self {
        assert!(self.stderr.contains(needle), "stderr should contain {needle:?}:\n{}", self.stderr);
        self
    }

    /// The ranks' stdout, by rank: `[rank R] line` lines, prefix removed.
    fn by_rank(&self) -> BTreeMap<usize, Vec<String>> {
        by_rank(&self.stdout)
    }
}

fn by_rank(text: &str) -> BTreeMap<usize, Vec<String>> {
    let mut out: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for line in text.lines() {
        let rest = line.strip_prefix("[rank ").unwrap_or_else(|| panic!("{line:?} has no rank prefix"));
        let (rank, content) = rest.split_once("] ").unwrap_or_else(|| panic!("{line:?} has no rank prefix"));
        out.entry(rank.parse().unwrap()).or_default().push(content.to_string());
    }
    out
}

/// The ranks' stderr lines, the launcher's own lines left out.
fn rank_stderr(text: &str) -> String {
    text.lines().filter(|l| !l.starts_with("tessera launch:")).map(|l| format!("{l}\n")).collect()
}

/// Whether `pid` is a live process (a zombie has finished running).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses, which may hold spaces.
        Ok(stat) => !matches!(stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()), Some('Z' | 'X')),
        Err(_) => false,
    }
}

fn wait_dead(pids: &[u32], limit: Duration) {
    let deadline = Instant::now() + limit;
    while pids.iter().any(|&p| alive(p)) {
        assert!(Instant::now() < deadline, "processes still alive after {limit:?}: {:?}", pids.iter().filter(|&&p| alive(p)).collect::<Vec<_>>());
        thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for each file (written whole by a rank through a rename) and
/// returns the pids it lists.
fn pids_in(files: &[PathBuf]) -> Vec<u32> {
    let deadline = Instant::now() + LIMIT;
    let mut pids = Vec::new();
    for f in files {
        while !f.exists() {
            assert!(Instant::now() < deadline, "{} was never written", f.display());
            thread::sleep(Duration::from_millis(20));
        }
        pids.extend(std::fs::read_to_string(f).unwrap().split_whitespace().map(|p| p.parse::<u32>().unwrap()));
    }
    pids
}

fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("cli-launch-{name}"))
}

const ENV: &str = r#"echo "$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $TESSERA_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT $TESSERA_MAX_RESTARTS""#;

/// The `ENV` line of each rank, split into fields.
fn env_lines(f: &Finished) -> BTreeMap<usize, Vec<String>> {
    f.by_rank()
        .into_iter()
        .map(|(rank, lines)| {
            assert_eq!(lines.len(), 1, "rank {rank} printed {lines:?}");
            (rank, lines[0].split(' ').map(str::to_string).collect())
        })
        .collect()
}

#[test]
fn every_rank_gets_its_place_in_the_job() {
    let f = run(sh(&["--nproc-per-node", "3"], ENV));
    f.success();
    let env = env_lines(&f);
    assert_eq!(env.keys().copied().collect::<Vec<_>>(), [0, 1, 2]);
    let port = &env[&0][7];
    for (rank, v) in &env {
        let expected = [rank.to_string(), "3".into(), rank.to_string(), "3".into(), "0".into(), "1".into(), "127.0.0.1".into(), port.clone()];
        assert_eq!(v[..8], expected, "rank {rank}");
        assert_eq!(v[8..], ["0", "0", "0"], "rank {rank}: restart counts");
    }
    // With one node and no port given, the launcher picked one that was free:
    // it can be bound now that the job is over.
    let port: u16 = port.parse().unwrap();
    std::net::TcpListener::bind(("0.0.0.0", port)).unwrap_or_else(|e| panic!("MASTER_PORT {port} should have been a free port: {e}"));
}

#[test]
fn nodes_hold_contiguous_blocks_of_ranks() {
    // Two launchers on one machine form one job of 4 ranks; nothing binds the
    // port here, so any number will do.
    for node in 0..2 {
        let f = run(sh(&["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", &node.to_string(), "--master-port", "41234"], ENV));
        f.success();
        let env = env_lines(&f);
        assert_eq!(env.keys().copied().collect::<Vec<_>>(), [2 * node, 2 * node + 1]);
        for local in 0..2 {
            let v = &env[&(2 * node + local)];
            let expected = [2 * node + local, 4, local, 2, node, 2].map(|n| n.to_string());
            assert_eq!(v[..6], expected, "node {node}, local rank {local}");
            assert_eq!(v[6..8], ["127.0.0.1", "41234"]);
        }
    }
    // The last of three nodes; with several nodes and no port given, every
    // launcher uses torchrun's default port.
    let f = run(sh(&["--nproc-per-node", "4", "--nnodes", "3", "--node-rank", "2", "--master-addr", "10.1.2.3"], ENV));
    f.success();
    let env = env_lines(&f);
    assert_eq!(env.keys().copied().collect::<Vec<_>>(), [8, 9, 10, 11]);
    for (rank, v) in &env {
        assert_eq!(v[..8], [rank.to_string(), "12".into(), (rank - 8).to_string(), "4".into(), "2".into(), "3".into(), "10.1.2.3".into(), "29500".into()]);
    }
}

#[test]
fn ranks_start_with_no_signal_blocked() {
    // The launcher blocks its own stop signals; a rank that inherited that
    // mask would never die of SIGTERM.
    let f = run(launcher(&["--", "grep", "SigBlk", "/proc/self/status"]));
    f.success();
    assert_eq!(f.by_rank()[&0], ["SigBlk:\t0000000000000000"]);
}

#[test]
fn rayon_threads_divide_the_cores_unless_set() {
    let script = r#"echo "${RAYON_NUM_THREADS:-unset} ${OMP_NUM_THREADS:-unset}""#;
    let cores = thread::available_parallelism().unwrap().get();
    let mut cmd = sh(&["--nproc-per-node", "2"], script);
    cmd.env_remove("RAYON_NUM_THREADS").env_remove("OMP_NUM_THREADS");
    let f = run(cmd);
    f.success();
    let expected = format!("{} unset", (cores / 2).max(1));
    assert_eq!(f.by_rank().into_values().collect::<Vec<_>>(), [[expected.clone()], [expected]]);

    let mut cmd = sh(&["--nproc-per-node", "2"], script);
    cmd.env("RAYON_NUM_THREADS", "7").env("OMP_NUM_THREADS", "3");
    let f = run(cmd);
    f.success();
    assert_eq!(f.by_rank().into_values().collect::<Vec<_>>(), [["7 3"], ["7 3"]]);
}

#[test]
fn output_is_forwarded_whole_lines_with_the_rank() {
    // Three ranks write 300 long lines each to stdout and stderr at once, then
    // a last line without a newline, and exit at once.
    let script = r#"
        L=$(printf '%120s' '' | tr ' ' "$RANK")
        i=0
        while [ $i -lt 300 ]; do echo "$L"; echo "e$L" >&2; i=$((i + 1)); done
        printf "end $RANK"
        printf "tail $RANK" >&2
    "#;
    let f = run(sh(&["--nproc-per-node", "3"], script));
    f.success();
    let out = f.by_rank();
    let err = by_rank(&rank_stderr(&f.stderr));
    for rank in 0..3 {
        let long = rank.to_string().repeat(120);
        let mut expected = vec![long.clone(); 300];
        expected.push(format!("end {rank}"));
        assert_eq!(out[&rank], expected, "rank {rank}'s stdout");
        let mut expected = vec![format!("e{long}"); 300];
        expected.push(format!("tail {rank}"));
        assert_eq!(err[&rank], expected, "rank {rank}'s stderr");
    }

    // Without the prefix: the same lines, as the ranks wrote them.
    let f = run(sh(&["--nproc-per-node", "2", "--no-prefix"], r#"echo "hello $RANK"; printf "x$RANK""#));
    f.success();
    let mut lines: Vec<&str> = f.stdout.lines().collect();
    lines.sort();
    assert_eq!(lines, ["hello 0", "hello 1", "x0", "x1"]);
}

#[test]
fn all_ranks_succeeding_is_success() {
    let f = run(sh(&["--nproc-per-node", "4"], "exit 0"));
    f.success();
    assert!(!f.stderr.contains("ended"), "no summary after success:\n{}", f.stderr);
}

#[test]
fn a_failed_rank_stops_the_others_and_leaves_no_process() {
    // Rank 1 becomes `sleep` itself; rank 2 is a shell waiting for a `sleep`
    // it started (a grandchild of the launcher). Rank 0 fails once both are
    // running.
    let dir = scratch("failure");
    let script = r#"
        case $LOCAL_RANK in
        0)  while [ ! -e "$D/1" ] || [ ! -e "$D/2" ]; do sleep 0.02; done
            echo "rank 0 gives up" >&2
            exit 3 ;;
        1)  echo $$ > "$D/1.tmp"; mv "$D/1.tmp" "$D/1"; exec sleep 60 ;;
        2)  sleep 60 & echo "$$ $!" > "$D/2.tmp"; mv "$D/2.tmp" "$D/2"; wait ;;
        esac
    "#;
    // A long grace period: the stop must not need it, since the sleeps die of
    // SIGTERM and the launcher reaps what is left of rank 2's group.
    let mut cmd = sh(&["--nproc-per-node", "3", "--grace-period", "30"], script);
    cmd.env("D", dir.path());
    let running = start(cmd);
    let pids = pids_in(&[dir.join("1"), dir.join("2")]);
    let f = running.finish();
    f.fails_with(3)
        .says("rank 0 failed (exit code 3); stopping the other local ranks")
        .says("rank 0: exit code 3 (the first failure)")
        .says("rank 1: killed by SIGTERM (stopped by the launcher)")
        .says("rank 2: killed by SIGTERM (stopped by the launcher)");
    assert!(rank_stderr(&f.stderr).contains("[rank 0] rank 0 gives up"));
    assert!(f.elapsed < Duration::from_secs(10), "the launcher took {:?}", f.elapsed);
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "processes of the job outlived the launcher: {left:?}");
}

#[test]
fn processes_a_rank_leaves_behind_are_adopted_and_stopped() {
    // Both ranks succeed at once. Rank 0 leaves a process that ignores
    // SIGTERM and reports, once orphaned, who its parent is: the launcher,
    // which reaps it (init may reap nothing, and a zombie would keep the
    // group alive through the grace period). Rank 1 leaves one that would run
    // for a minute: the end of the job stops it. Rank 0 exits only once its
    // leftover ignores SIGTERM: on a loaded machine the launcher's SIGTERM
    // could otherwise reach the shell before its `trap` ran.
    let dir = scratch("leftovers");
    let script = r#"
        if [ "$LOCAL_RANK" = 0 ]; then
            sh -c 'trap "" TERM; : > "$D/0"; sleep 0.5; read -r _ _ _ ppid _ < /proc/$$/stat; echo "orphan of $ppid"' &
            while [ ! -e "$D/0" ]; do sleep 0.01; done
        else
            sleep 60 & echo $! > "$D/1.tmp"; mv "$D/1.tmp" "$D/1"
        fi
    "#;
    let mut cmd = sh(&["--nproc-per-node", "2", "--grace-period", "30"], script);
    cmd.env("D", dir.path());
    let running = start(cmd);
    let launcher = running.pid();
    let f = running.finish();
    f.success();
    assert_eq!(f.by_rank()[&0], [format!("orphan of {launcher}")]);
    assert!(f.elapsed < Duration::from_secs(10), "the launcher took {:?}", f.elapsed);
    let pids = pids_in(&[dir.join("1")]);
    assert!(!alive(pids[0]), "rank 1's leftover outlived the launcher");
}

#[test]
fn a_rank_killed_by_a_signal_is_reported_by_name() {
    let f = run(sh(&["--nproc-per-node", "2"], r#"if [ "$RANK" = 1 ]; then kill -KILL $$; fi; exec sleep 60"#));
    f.fails_with(128 + 9).says("rank 1 failed (killed by SIGKILL)").says("rank 0: killed by SIGTERM (stopped by the launcher)");
}

#[test]
fn restarts_start_every_rank_again_until_success() {
    // Rank 1 fails on the first two attempts; rank 0 always succeeds.
    let script = r#"
        echo "attempt $TESSERA_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT"
        if [ "$LOCAL_RANK" = 1 ] && [ "$TESSERA_RESTART_COUNT" -lt 2 ]; then exit 4; fi
    "#;
    let f = run(sh(&["--nproc-per-node", "2", "--max-restarts", "3"], script));
    f.success().says("rank 1 failed (exit code 4); restarting all local ranks: restart 1 of 3").says("restart 2 of 3");
    assert!(!f.stderr.contains("restart 3 of 3"), "{}", f.stderr);
    // Rank 1 ran every attempt; rank 0 may have been stopped before printing
    // in an attempt that rank 1 failed first, but ran the last one.
    assert_eq!(f.by_rank()[&1], ["attempt 0 0", "attempt 1 1", "attempt 2 2"]);
    assert!(f.by_rank()[&0].contains(&"attempt 2 2".to_string()));
}

#[test]
fn restarts_give_up_with_the_last_failure() {
    let f = run(sh(&["--nproc-per-node", "2", "--max-restarts", "1"], r#"if [ "$RANK" = 0 ]; then exit $((5 + TESSERA_RESTART_COUNT)); fi; exec sleep 60"#));
    f.fails_with(6)
        .says("rank 0 failed (exit code 5); restarting all local ranks: restart 1 of 1")
        .says("rank 0 failed (exit code 6); giving up after 1 restart")
        .says("rank 0: exit code 6 (the first failure)");
}

/// A job of two ranks that write their pids to `dir` and wait; rank 1 also
/// waits for a child of its own.
fn waiting_job(dir: &Path, args: &[&str], script: &str) -> (Running, Vec<u32>) {
    let mut all = vec!["--nproc-per-node", "2"];
    all.extend(args);
    let mut cmd = sh(&all, script);
    cmd.env("D", dir);
    let running = start(cmd);
    let pids = pids_in(&[dir.join("0"), dir.join("1")]);
    assert!(pids.iter().all(|&p| alive(p)), "the ranks should be running: {pids:?}");
    (running, pids)
}

const WAITING: &str = r#"
    if [ "$LOCAL_RANK" = 0 ]; then echo $$ > "$D/0.tmp"; mv "$D/0.tmp" "$D/0"; exec sleep 60; fi
    sleep 60 & echo "$$ $!" > "$D/1.tmp"; mv "$D/1.tmp" "$D/1"; wait
"#;

/// Whether `signal` is ignored in this process (and so in those it starts).
fn ignored_here(signal: libc::c_int) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let mask = status.lines().find_map(|l| l.strip_prefix("SigIgn:")).unwrap().trim();
    u64::from_str_radix(mask, 16).unwrap() & (1 << (signal - 1)) != 0
}

fn kill(signal: &str, pid: u32) {
    assert!(Command::new("kill").args([signal, &pid.to_string()]).status().unwrap().success());
}

#[test]
fn sigterm_to_the_launcher_stops_every_rank() {
    let dir = scratch("sigterm");
    let (running, pids) = waiting_job(&dir, &[], WAITING);
    kill("-TERM", running.pid());
    let f = running.finish();
    f.fails_with(128 + 15).says("received SIGTERM; stopping all local ranks").says("rank 0: killed by SIGTERM (stopped by the launcher)");
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(left.is_empty(), "processes of the job outlived the launcher: {left:?}");
}

#[test]
fn sigint_is_forwarded_as_sigint() {
    // A signal ignored when a process starts stays ignored (the launcher
    // cannot see it, nor can a rank's shell trap it); some harnesses start
    // tests that way.
    if ignored_here(libc::SIGINT) {
        report_skip("sigint_is_forwarded_as_sigint", "SIGINT is ignored in this test's environment, so no process it starts can receive it");
        return;
    }
    // A rank that handles SIGINT itself, as a program that saves on Ctrl-C does.
    let dir = scratch("sigint");
    let script = r#"
        trap 'echo "caught INT"; exit 7' INT
        echo $$ > "$D/$LOCAL_RANK.tmp"; mv "$D/$LOCAL_RANK.tmp" "$D/$LOCAL_RANK"
        while :; do sleep 0.05; done
    "#;
    let (running, pids) = waiting_job(&dir, &[], script);
    kill("-INT", running.pid());
    let f = running.finish();
    f.fails_with(128 + 2).says("received SIGINT").says("rank 1: exit code 7 (stopped by the launcher)");
    assert_eq!(f.by_rank()[&0], ["caught INT"]);
    wait_dead(&pids, Duration::ZERO);
}

#[test]
fn ranks_that_ignore_the_stop_signal_are_killed_after_the_grace_period() {
    let dir = scratch("grace");
    let script = r#"
        trap '' TERM
        echo $$ > "$D/$LOCAL_RANK.tmp"; mv "$D/$LOCAL_RANK.tmp" "$D/$LOCAL_RANK"
        while :; do sleep 0.05; done
    "#;
    let (running, pids) = waiting_job(&dir, &["--grace-period", "1"], script);
    let signalled = Instant::now();
    kill("-TERM", running.pid());
    let f = running.finish();
    let took = signalled.elapsed();
    f.fails_with(128 + 15).says("rank 0: killed by SIGKILL (stopped by the launcher)").says("rank 1: killed by SIGKILL (stopped by the launcher)");
    assert!(took >= Duration::from_secs(1), "SIGKILL came before the grace period ended ({took:?})");
    assert!(took < Duration::from_secs(10), "the launcher took {took:?}");
    wait_dead(&pids, Duration::ZERO);
}

#[test]
fn ranks_die_with_a_killed_launcher() {
    // SIGKILL leaves the launcher no chance to stop anything: the kernel's
    // parent-death signal must.
    let dir = scratch("sigkill");
    let script = r#"echo $$ > "$D/$LOCAL_RANK.tmp"; mv "$D/$LOCAL_RANK.tmp" "$D/$LOCAL_RANK"; exec sleep 60"#;
    let (mut running, pids) = waiting_job(&dir, &[], script);
    running.child.kill().unwrap();
    running.child.wait().unwrap();
    wait_dead(&pids, Duration::from_secs(10));
}

#[test]
fn bad_arguments_are_refused() {
    let refused = |args: &[&str], needle: &str| {
        let f = run(launcher(args));
        assert!(f.code.is_some_and(|c| c != 0), "tessera launch {args:?} should fail");
        assert!(f.stderr.contains(needle), "tessera launch {args:?}: stderr should contain {needle:?}:\n{}", f.stderr);
    };
    refused(&["--nproc-per-node", "0", "--", "true"], "--nproc-per-node must be at least 1");
    refused(&["--nnodes", "0", "--", "true"], "--nnodes must be at least 1");
    refused(&["--nnodes", "2", "--node-rank", "2", "--", "true"], "--node-rank 2 is out of range for --nnodes 2");
    refused(&["--", ""], "the program to launch is empty");
    refused(&["--nproc-per-node", "2"], "required");
    refused(&["--master-port", "0", "--", "true"], "0 is not in 1..=65535");
    refused(&["--master-port", "70000", "--", "true"], "70000 is not in 1..=65535");
    refused(&["--monitor-interval", "0", "--", "true"], "more than 0 seconds");
    refused(&["--grace-period", "soon", "--", "true"], "not a number of seconds");
    refused(&["--master-addr", "", "--", "true"], "--master-addr is empty");
    refused(&["--nproc-per-node", "2", "--", "/nonexistent/program"], "cannot start rank 0 (`/nonexistent/program`)");
}
