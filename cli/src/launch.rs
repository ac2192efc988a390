//! `tessera launch`: start one process per local rank with torchrun's
//! environment variables, forward their output line by line with a rank
//! prefix, stop the whole node when one rank fails, and restart it a bounded
//! number of times. The rendezvous between ranks is the program's own work;
//! the launcher only says who is who and where to meet (see docs/launch.md).

mod elastic;
mod env;
mod output;
mod process;
mod signals;

use anyhow::{bail, Context};
use env::{RankEnv, Topology};
use signals::Event;
use std::ffi::OsString;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The rendezvous port of a multi-node job whose launchers were given none
/// (torchrun's default): every node must agree on it without talking first.
const DEFAULT_PORT: u16 = 29500;

/// How long the launcher waits for the ranks to die after SIGKILL. Only a
/// process stuck in the kernel outlives it, and the launcher then reports it
/// rather than hanging.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// How long the launcher waits, at the end of an attempt, for the ranks'
/// output to be forwarded; only a process that escaped the ranks' process
/// groups and still holds a pipe makes it wait that long.
const OUTPUT_WAIT: Duration = Duration::from_secs(2);

/// How long the launcher waits for a failed rank's last output before it
/// reports the failure and stops the other ranks: short, since the other
/// ranks may be blocked on the failed one.
const LAST_WORDS_WAIT: Duration = Duration::from_millis(500);

/// Arguments of `tessera launch`.
#[derive(clap::Args)]
#[command(after_help = "Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, \
MASTER_PORT, TESSERA_RESTART_COUNT (= TORCHELASTIC_RESTART_COUNT) and TESSERA_MAX_RESTARTS (= TORCHELASTIC_MAX_RESTARTS), and \
RAYON_NUM_THREADS = cores / nproc-per-node unless it is set already. See docs/launch.md.\n\n\
Example: tessera launch --nproc-per-node 4 -- ./train --config run.toml")]
pub struct Args {
    /// Ranks (processes) to start on this node.
    #[arg(long, value_name = "N", default_value_t = 1)]
    nproc_per_node: usize,

    /// Nodes in the job; each runs its own `tessera launch`.
    #[arg(long, value_name = "M", default_value_t = 1)]
    nnodes: usize,

    /// This node's index in 0..M; its ranks are R*N .. R*N+N-1.
    #[arg(long, value_name = "R", default_value_t = 0)]
    node_rank: usize,

    /// The host where the ranks meet (MASTER_ADDR); with several nodes, an address of node 0 that the others can reach.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    master_addr: String,

    /// The port where the ranks meet (MASTER_PORT). Default: a free port when --nnodes is 1 (so that jobs on one machine
    /// do not collide), 29500 otherwise.
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,

    /// Elastic job: after a failure, go on with the nodes whose launchers are still alive, as long as there are at least
    /// this many (of --nnodes). The launchers meet at --master-port (node 0's launcher serves it), the ranks one port above.
    #[arg(long, value_name = "MIN")]
    min_nodes: Option<usize>,

    /// Elastic job: seconds node 0's launcher waits for the remaining nodes of an attempt once --min-nodes have arrived.
    #[arg(long, value_name = "SECONDS", default_value = "5", value_parser = seconds)]
    last_call: Duration,

    /// Elastic job: seconds the launchers wait for --min-nodes nodes to arrive before the job fails.
    #[arg(long, value_name = "SECONDS", default_value = "600", value_parser = positive_seconds)]
    rdzv_timeout: Duration,

    /// After a failure, stop every local rank and start them all again, at most this many times.
    #[arg(long, value_name = "K", default_value_t = 0)]
    max_restarts: u32,

    /// Seconds between checks of the ranks (they are also checked as soon as one exits).
    #[arg(long, value_name = "SECONDS", default_value = "0.1", value_parser = positive_seconds)]
    monitor_interval: Duration,

    /// Seconds a rank has to exit after the stop signal before it is killed with SIGKILL.
    #[arg(long, value_name = "SECONDS", default_value = "5", value_parser = seconds)]
    grace_period: Duration,

    /// Forward the ranks' output lines without the `[rank R] ` prefix.
    #[arg(long)]
    no_prefix: bool,

    /// The program each rank runs, and its arguments (after `--`).
    #[arg(value_name = "PROGRAM", required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

fn seconds(s: &str) -> Result<Duration, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    Duration::try_from_secs_f64(v).map_err(|_| format!("`{s}` is not a duration in seconds (0 or more)"))
}

fn positive_seconds(s: &str) -> Result<Duration, String> {
    match seconds(s)? {
        d if d.is_zero() => Err("must be more than 0 seconds".into()),
        d => Ok(d),
    }
}

/// Prints one of the launcher's own lines to stderr. A closed stderr must
/// not stop the launcher halfway through stopping the ranks.
macro_rules! note {
    ($($t:tt)*) => {{
        let _ = writeln!(std::io::stderr().lock(), "tessera launch: {}", format_args!($($t)*));
    }};
}

/// Runs the job; exits the process with the job's status (see docs/launch.md):
/// 0 when every rank succeeded, the failed rank's exit code (128 + the signal
/// number when it was killed by a signal), or 128 + the signal number when
/// the launcher itself was told to stop.
pub fn run(args: Args) -> anyhow::Result<()> {
    let topology = Topology::new(args.nproc_per_node, args.nnodes, args.node_rank).map_err(anyhow::Error::msg)?;
    let (program, program_args) = args.command.split_first().context("no program to launch: give it after `--`")?;
    if program.is_empty() {
        bail!("the program to launch is empty: give it after `--`, as in `tessera launch --nproc-per-node 2 -- ./train --config run.toml`");
    }
    if args.master_addr.is_empty() {
        bail!("--master-addr is empty: give the host where the ranks meet");
    }
    let master_port = match args.master_port {
        Some(port) => port,
        None if topology.nnodes == 1 => free_port()?,
        None => DEFAULT_PORT,
    };
    let agent = match args.min_nodes {
        Some(min) if min == 0 || min > topology.nnodes => bail!("--min-nodes {min} must be between 1 and --nnodes {}", topology.nnodes),
        Some(min) if min < topology.nnodes => {
            // The launchers meet at the master port, the ranks one above it.
            let Some(ranks_port) = master_port.checked_add(1) else {
                bail!("--master-port {master_port}: an elastic job also uses the port above it; give a lower one")
            };
            let agent = elastic::Agent::join(
                &args.master_addr,
                master_port,
                args.node_rank,
                args.nproc_per_node,
                (min, topology.nnodes),
                args.last_call,
                args.rdzv_timeout,
            )?;
            Some((agent, ranks_port))
        }
        _ => None,
    };
    let (agent, master_port) = match agent {
        Some((agent, ranks_port)) => (Some(agent), ranks_port),
        None => (None, master_port),
    };
    let threads = match std::env::var_os("RAYON_NUM_THREADS") {
        Some(_) => None,
        None => Some(env::threads_per_rank(std::thread::available_parallelism().map_or(1, |n| n.get()), topology.nproc_per_node)),
    };

    let (events_in, events) = mpsc::channel();
    signals::watch(events_in).context("cannot watch the launcher's signals")?;
    process::become_subreaper();

    let first = topology.global_rank(0);
    let last = topology.global_rank(topology.nproc_per_node - 1);
    note!(
        "starting ranks {first}..={last} of {} (node {} of {}), master {}:{master_port}{}",
        topology.world_size(),
        topology.node_rank,
        topology.nnodes,
        args.master_addr,
        threads.map_or_else(String::new, |n| format!(", RAYON_NUM_THREADS={n}")),
    );
    let job = Job {
        program: program.clone(),
        args: program_args.to_vec(),
        topology,
        agent,
        master_addr: args.master_addr,
        master_port,
        max_restarts: args.max_restarts,
        threads,
        interval: args.monitor_interval,
        grace: args.grace_period,
        prefix: !args.no_prefix,
        events,
    };
    let code = job.run()?;
    let _ = std::io::stdout().flush();
    // The status is the job's, not an error of the launcher's own: exit with
    // it directly rather than through `main`'s error report.
    std::process::exit(code)
}

/// A port that nothing is bound to now, so a single-node job does not land
/// on the port of another job's rendezvous. The rendezvous binds it a moment
/// later; another program could take it in between, as with torchrun's
/// `--standalone`.
fn free_port() -> anyhow::Result<u16> {
    let probe = std::net::TcpListener::bind(("0.0.0.0", 0)).context("cannot find a free port for MASTER_PORT: give one with --master-port")?;
    Ok(probe.local_addr().context("cannot read the probed port: give one with --master-port")?.port())
}

struct Job {
    program: OsString,
    args: Vec<OsString>,
    topology: Topology,
    /// An elastic job's membership, settled anew before every attempt.
    agent: Option<elastic::Agent>,
    master_addr: String,
    master_port: u16,
    max_restarts: u32,
    threads: Option<usize>,
    interval: Duration,
    grace: Duration,
    prefix: bool,
    events: Receiver<Event>,
}

/// One local rank of one attempt.
struct Rank {
    global: usize,
    /// The process id, which is also its process group's id.
    pid: u32,
    status: Option<ExitStatus>,
    /// It was still running when the launcher began stopping the ranks.
    stopped: bool,
    output: Vec<JoinHandle<()>>,
}

/// How an attempt ended.
#[derive(Clone, Copy)]
enum End {
    /// Every rank exited with 0.
    Success,
    /// `ranks[index]` was the first to exit otherwise.
    Failed { index: usize, status: ExitStatus },
    /// The launcher received this stop signal.
    Interrupted(libc::c_int),
}

impl Job {
    fn run(&self) -> anyhow::Result<i32> {
        let mut restart = 0;
        loop {
            let topology = match &self.agent {
                Some(agent) => {
                    let t = agent.round(restart)?;
                    note!(
                        "attempt {restart}: {} of {} nodes; this node runs ranks {}..={} of {}",
                        t.nnodes,
                        self.topology.nnodes,
                        t.global_rank(0),
                        t.global_rank(t.nproc_per_node - 1),
                        t.world_size()
                    );
                    t
                }
                None => self.topology,
            };
            let mut ranks = self.start(topology, restart)?;
            let end = self.supervise(&mut ranks);
            let stop_signal = match end {
                End::Success => libc::SIGTERM,
                End::Failed { index, status } => {
                    // Its last words first, then the launcher's report.
                    let output = std::mem::take(&mut ranks[index].output);
                    ranks[index].output = output::join_until(output, Instant::now() + LAST_WORDS_WAIT);
                    note!("rank {} failed ({}); stopping the other local ranks", ranks[index].global, describe(status));
                    libc::SIGTERM
                }
                End::Interrupted(signal) => {
                    note!("received {}; stopping all local ranks", signals::name(signal));
                    signal
                }
            };
            let late = self.stop(&mut ranks, stop_signal);
            self.drain_output(&mut ranks);
            let (failed, status) = match (end, late) {
                (End::Success, _) => return Ok(0),
                (End::Interrupted(signal), _) => {
                    self.summary(&ranks, None);
                    return Ok(128 + signal);
                }
                (End::Failed { index, .. }, Some(signal)) => {
                    note!("received {} while stopping the ranks; not restarting", signals::name(signal));
                    self.summary(&ranks, Some(index));
                    return Ok(128 + signal);
                }
                (End::Failed { index, status }, None) => (index, status),
            };
            if restart < self.max_restarts {
                restart += 1;
                note!(
                    "rank {} failed ({}); restarting all local ranks: restart {restart} of {} (TESSERA_RESTART_COUNT={restart})",
                    ranks[failed].global,
                    describe(status),
                    self.max_restarts
                );
                continue;
            }
            match self.max_restarts {
                0 => note!("rank {} failed ({}); the job failed", ranks[failed].global, describe(status)),
                k => note!("rank {} failed ({}); giving up after {k} restart{}", ranks[failed].global, describe(status), if k == 1 { "" } else { "s" }),
            }
            self.summary(&ranks, Some(failed));
            return Ok(exit_code(status));
        }
    }

    /// Starts every local rank of attempt `restart`; if one cannot be
    /// started, stops those that were and fails: a missing program does not
    /// appear on a retry.
    fn start(&self, topology: Topology, restart: u32) -> anyhow::Result<Vec<Rank>> {
        let env = RankEnv {
            topology,
            master_addr: &self.master_addr,
            master_port: self.master_port,
            restart,
            max_restarts: self.max_restarts,
            threads: self.threads,
        };
        let mut ranks = Vec::with_capacity(topology.nproc_per_node);
        for local in 0..topology.nproc_per_node {
            let global = topology.global_rank(local);
            let started = process::spawn(&self.program, &self.args, env.vars(local)).and_then(|mut child| {
                let pid = child.id();
                let mut rank = Rank { global, pid, status: None, stopped: false, output: Vec::new() };
                let prefix = if self.prefix { format!("[rank {global}] ").into_bytes() } else { Vec::new() };
                // The pipes are always there: spawn asked for both.
                let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
                let forwarded = (|| -> std::io::Result<()> {
                    if let Some(pipe) = stdout {
                        rank.output.push(output::forward(pipe, output::Stream::Stdout, prefix.clone(), format!("rank {global} stdout"))?);
                    }
                    if let Some(pipe) = stderr {
                        rank.output.push(output::forward(pipe, output::Stream::Stderr, prefix, format!("rank {global} stderr"))?);
                    }
                    Ok(())
                })();
                // The rank is tracked (and so stopped) even when a forwarding
                // thread could not be started.
                ranks.push(rank);
                forwarded
            });
            if let Err(e) = started {
                self.stop(&mut ranks, libc::SIGTERM);
                self.drain_output(&mut ranks);
                return Err(e).with_context(|| format!("cannot start rank {global} (`{}`)", self.program.to_string_lossy()));
            }
        }
        Ok(ranks)
    }

    /// Waits until every rank has succeeded, one has failed, or the launcher
    /// is told to stop.
    fn supervise(&self, ranks: &mut [Rank]) -> End {
        loop {
            if let Some(end) = self.reap(ranks) {
                return end;
            }
            if ranks.iter().all(|r| r.status.is_some()) {
                return End::Success;
            }
            if let Some(Event::Stop(signal)) = self.next_event(self.interval) {
                return End::Interrupted(signal);
            }
        }
    }

    /// Records the status of every rank that has exited; the first failure
    /// seen, if any. Processes re-parented to the launcher are reaped too.
    fn reap(&self, ranks: &mut [Rank]) -> Option<End> {
        let mut failure = None;
        while let Some((pid, status)) = process::reap() {
            if let Some(index) = ranks.iter().position(|r| r.pid == pid && r.status.is_none()) {
                ranks[index].status = Some(status);
                if !status.success() && failure.is_none() {
                    failure = Some(End::Failed { index, status });
                }
            }
        }
        failure
    }

    /// Sends `signal` to every rank's process group, waits up to the grace
    /// period for the ranks and whatever they started to exit, then kills
    /// what is left with SIGKILL. Groups of ranks that already exited are
    /// signalled too, for the processes those ranks left behind. Returns a
    /// stop signal the launcher received meanwhile; it cuts the grace short.
    fn stop(&self, ranks: &mut [Rank], signal: libc::c_int) -> Option<libc::c_int> {
        let mut late = None;
        for r in ranks.iter_mut() {
            r.stopped = r.status.is_none();
            process::signal_group(r.pid, signal);
        }
        let deadline = Instant::now() + self.grace;
        loop {
            self.reap(ranks);
            if ranks.iter().all(|r| r.status.is_some() && !process::group_exists(r.pid)) {
                return late;
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            if let Some(Event::Stop(s)) = self.next_event((deadline - now).min(self.interval)) {
                late = Some(s);
                break;
            }
        }
        for r in ranks.iter() {
            process::signal_group(r.pid, libc::SIGKILL);
        }
        let deadline = Instant::now() + KILL_WAIT;
        loop {
            self.reap(ranks);
            if ranks.iter().all(|r| r.status.is_some()) || Instant::now() >= deadline {
                return late;
            }
            if let Some(Event::Stop(s)) = self.next_event(self.interval) {
                late.get_or_insert(s);
            }
        }
    }

    /// Lets the forwarding threads finish what the ranks wrote last.
    fn drain_output(&self, ranks: &mut [Rank]) {
        let deadline = Instant::now() + OUTPUT_WAIT;
        for r in ranks.iter_mut() {
            r.output = output::join_until(std::mem::take(&mut r.output), deadline);
        }
    }

    /// The next event, or `None` after `timeout`.
    fn next_event(&self, timeout: Duration) -> Option<Event> {
        match self.events.recv_timeout(timeout) {
            Ok(event) => Some(event),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => {
                // No signal thread: poll.
                std::thread::sleep(timeout);
                None
            }
        }
    }

    /// One line per local rank: how it ended.
    fn summary(&self, ranks: &[Rank], first_failure: Option<usize>) {
        note!("how each local rank ended:");
        for (i, r) in ranks.iter().enumerate() {
            let how = match r.status {
                Some(status) => describe(status),
                None => format!("still running as pid {} after SIGKILL", r.pid),
            };
            let why = if first_failure == Some(i) {
                " (the first failure)"
            } else if r.stopped {
                " (stopped by the launcher)"
            } else {
                ""
            };
            note!("  rank {}: {how}{why}", r.global);
        }
    }
}

/// "exit code 3", "killed by SIGSEGV (core dumped)".
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by {}{}", signals::name(signal), if status.core_dumped() { " (core dumped)" } else { "" }),
        (None, None) => status.to_string(),
    }
}

/// The launcher's exit code for a failed rank's status: its exit code, or
/// 128 + the signal number as shells report a process killed by a signal.
fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        (None, None) => 1,
    }
}
