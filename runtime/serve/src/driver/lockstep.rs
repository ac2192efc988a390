//! The engines of a tensor-parallel group, run as one.
//!
//! Each rank holds its shard of the model and its own engine, on a thread of
//! its own. Rank 0's engine runs on the driver's thread and decides: a
//! request it admits is added to every follower's engine, a cancellation
//! and a step go to all of them, in the order rank 0 saw them. Engines that
//! start alike and see the same operations schedule the same batches
//! (scheduling is deterministic, an unseeded request's draws are seeded from
//! its id), so their forwards issue the same collectives and their samplers
//! the same tokens: each step's outputs are compared with rank 0's, and a
//! difference stops the group rather than serve a wrong answer.
//!
//! A rank that fails (an error, a panic, a refused request rank 0 took)
//! aborts the group's communication so that the others' collectives return;
//! the driver then reports the first root cause, not the other ranks' failure
//! to reach it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use tessera_core::{Error, Result};
use tessera_nn::module::{Module, Replicated, SplitHidden};

use super::{panic_message, DriverState, EngineInfo, StepFailure, Stepper};
use crate::engine::{Engine, RequestId, RequestOutput};
use crate::sampling::SamplingParams;

/// Stops the group's communication on behalf of a failed rank.
type Abort = Arc<dyn Fn(usize, &str) + Send + Sync>;

/// Rank 0's engine and the followers' threads.
pub(super) struct Lockstep<M: Module<In = Replicated, Out = SplitHidden>> {
    leader: Engine<M>,
    followers: Vec<Follower>,
    abort: Abort,
}

/// What rank 0 tells a follower.
enum Op {
    /// Add this request; rank 0 gave it this id.
    Add {
        prompt: Vec<u32>,
        params: SamplingParams,
        id: RequestId,
    },
    Abort(RequestId),
    /// Step, and reply with what came out.
    Step,
}

/// A step's outputs, as much as must agree between the ranks: each
/// request's new tokens and whether it finished.
type Digest = Vec<(RequestId, Vec<u32>, bool)>;

fn digest(outputs: &[RequestOutput]) -> Digest {
    outputs.iter().map(|o| (o.id, o.tokens.iter().map(|t| t.id).collect(), o.finished.is_some())).collect()
}

/// A follower rank's thread, seen from rank 0.
struct Follower {
    rank: usize,
    ops: Sender<Op>,
    replies: Receiver<Result<Digest>>,
    thread: Option<JoinHandle<()>>,
}

impl<M: Module<In = Replicated, Out = SplitHidden> + 'static> Lockstep<M> {
    /// Builds rank 0's engine here and every other rank's on a thread of its
    /// own, all at once (loading a sharded model is collective).
    pub(super) fn build<F, A>(ranks: usize, make: F, abort: A) -> Result<Self>
    where
        F: Fn(usize) -> Result<Engine<M>> + Send + Sync + 'static,
        A: Fn(usize, &str) + Send + Sync + 'static,
    {
        let make = Arc::new(make);
        let abort: Abort = Arc::new(abort);
        let mut followers = Vec::with_capacity(ranks - 1);
        let mut built = Vec::with_capacity(ranks - 1);
        for rank in 1..ranks {
            let (ops, inbox) = mpsc::channel();
            let (reply, replies) = mpsc::channel();
            let (ready_tx, ready) = mpsc::channel();
            let (make, rank_abort) = (Arc::clone(&make), Arc::clone(&abort));
            let thread = std::thread::Builder::new().name(format!("tessera-engine-{rank}")).spawn(move || {
                let engine = match catch_unwind(AssertUnwindSafe(|| make(rank))) {
                    Ok(Ok(engine)) => engine,
                    Ok(Err(e)) => return fail_build(rank, e, &*rank_abort, &ready_tx),
                    Err(panic) => return fail_build(rank, panicked("building the engine", &panic), &*rank_abort, &ready_tx),
                };
                if ready_tx.send(Ok(())).is_ok() {
                    follow(rank, engine, inbox, reply, &*rank_abort);
                }
            });
            match thread {
                Ok(thread) => {
                    followers.push(Follower { rank, ops, replies, thread: Some(thread) });
                    built.push(ready);
                }
                Err(source) => {
                    // The ranks already started wait for this one in their
                    // first collective: stop them, let them report, join them.
                    let e = Error::Thread { what: "engine rank", source };
                    abort(rank, &e.to_string());
                    for ready in built {
                        let _ = ready.recv();
                    }
                    return Err(e);
                }
            }
        }
        let leader = match catch_unwind(AssertUnwindSafe(|| make(0))) {
            Ok(result) => result,
            Err(panic) => Err(panicked("building the engine", &panic)),
        };
        if let Err(e) = &leader {
            if !is_consequence(e) {
                abort(0, &e.to_string());
            }
        }
        let theirs: Vec<Result<()>> = built
            .iter()
            .zip(&followers)
            .map(|(ready, f)| {
                ready.recv().unwrap_or_else(|_| {
                    Err(Error::invalid("Driver::spawn_tensor_parallel", format!("rank {}'s thread ended before its engine was built", f.rank)))
                })
            })
            .collect();
        let mut results = vec![(0, leader.as_ref().err())];
        results.extend(followers.iter().zip(&theirs).map(|(f, r)| (f.rank, r.as_ref().err())));
        match first_root_cause(&results) {
            // Dropping the followers (on failure) ends their threads.
            Some(e) => Err(e),
            None => Ok(Lockstep { leader: leader.expect("rank 0 built its engine"), followers, abort }),
        }
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        // Closing the channel ends the follower's loop.
        let (closed, _) = mpsc::channel();
        self.ops = closed;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A follower's build failed: stop the others' collectives and say why.
fn fail_build(rank: usize, e: Error, abort: &(dyn Fn(usize, &str) + Send + Sync), ready: &Sender<Result<()>>) {
    if !is_consequence(&e) {
        abort(rank, &e.to_string());
    }
    let _ = ready.send(Err(e));
}

/// A follower's loop: do what rank 0 says, reply to each step.
fn follow<M: Module<In = Replicated, Out = SplitHidden>>(
    rank: usize,
    mut engine: Engine<M>,
    ops: Receiver<Op>,
    replies: Sender<Result<Digest>>,
    abort: &(dyn Fn(usize, &str) + Send + Sync),
) {
    // Set when this rank's engine no longer matches rank 0's: it must not
    // step again (its collectives would pair with the wrong ones).
    let mut broken: Option<String> = None;
    for op in ops {
        match op {
            Op::Add { prompt, params, id } => {
                if broken.is_some() {
                    continue;
                }
                match engine.add_request(prompt, params) {
                    Ok(mine) if mine == id => {}
                    Ok(mine) => broken = Some(format!("rank {rank} gave a request the id {mine} and rank 0 the id {id}")),
                    Err(e) => broken = Some(format!("rank {rank} refused a request rank 0 admitted: {e}")),
                }
            }
            Op::Abort(id) => {
                engine.abort(id);
            }
            Op::Step => {
                let reply = match &broken {
                    Some(e) => Err(diverged(e.clone())),
                    None => match catch_unwind(AssertUnwindSafe(|| engine.step())) {
                        Ok(Ok(outputs)) => Ok(digest(&outputs)),
                        Ok(Err(e)) => Err(e),
                        Err(panic) => Err(panicked("the engine", &panic)),
                    },
                };
                if let Err(e) = &reply {
                    if !is_consequence(e) {
                        abort(rank, &e.to_string());
                    }
                }
                if replies.send(reply).is_err() {
                    return;
                }
            }
        }
    }
}

impl<M: Module<In = Replicated, Out = SplitHidden>> Stepper for Lockstep<M> {
    fn info(&self) -> EngineInfo {
        self.leader.info()
    }

    fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestId> {
        // Rank 0 validates; only what it admits reaches the others (a
        // follower that refuses it stops the group at the next step).
        let id = self.leader.add_request(prompt.clone(), params.clone())?;
        for f in &self.followers {
            let _ = f.ops.send(Op::Add { prompt: prompt.clone(), params: params.clone(), id });
        }
        Ok(id)
    }

    fn abort(&mut self, id: RequestId) {
        self.leader.abort(id);
        for f in &self.followers {
            let _ = f.ops.send(Op::Abort(id));
        }
    }

    fn has_unfinished(&self) -> bool {
        self.leader.has_unfinished()
    }

    fn step(&mut self) -> std::result::Result<Vec<RequestOutput>, StepFailure> {
        // The followers step at once, concurrently with rank 0 (their
        // collectives meet rank 0's).
        let sent: Vec<bool> = self.followers.iter().map(|f| f.ops.send(Op::Step).is_ok()).collect();
        let mine = match catch_unwind(AssertUnwindSafe(|| self.leader.step())) {
            Ok(result) => result,
            Err(panic) => Err(panicked("the engine", &panic)),
        };
        if let Err(e) = &mine {
            if !is_consequence(e) {
                (self.abort)(0, &e.to_string());
            }
        }
        let theirs: Vec<(usize, Result<Digest>)> = self
            .followers
            .iter()
            .zip(sent)
            .map(|(f, sent)| {
                let reply = match sent {
                    true => f.replies.recv().ok(),
                    false => None,
                };
                (f.rank, reply.unwrap_or_else(|| Err(Error::invalid("Driver", format!("rank {}'s engine thread has stopped", f.rank)))))
            })
            .collect();
        let mut results = vec![(0, mine.as_ref().err())];
        results.extend(theirs.iter().map(|(rank, r)| (*rank, r.as_ref().err())));
        if let Some(e) = first_root_cause(&results) {
            return Err(StepFailure::Fatal(format!("a tensor-parallel step failed: {e}")));
        }
        let outputs = mine.expect("rank 0's step succeeded");
        let want = digest(&outputs);
        for (rank, got) in theirs {
            if got.as_ref().ok() != Some(&want) {
                return Err(StepFailure::Fatal(format!(
                    "a tensor-parallel step failed: {}",
                    diverged(format!("rank {rank} produced other tokens than rank 0 in the same step"))
                )));
            }
        }
        Ok(outputs)
    }

    fn publish(&self, state: &mut DriverState) {
        self.leader.publish(state);
    }
}

/// Whether `e` is only a consequence of another rank's failure.
fn is_consequence(e: &Error) -> bool {
    matches!(e, Error::PeerFailed { .. } | Error::RankFailed { .. })
}

/// The root cause among the ranks' failures (`None` where a rank
/// succeeded): the first rank's own failure; failing that, the reason the
/// first rank that stopped the others gave.
fn first_root_cause(results: &[(usize, Option<&Error>)]) -> Option<Error> {
    let failures = || results.iter().filter_map(|&(rank, e)| e.map(|e| (rank, e)));
    if let Some((rank, e)) = failures().find(|(_, e)| !is_consequence(e)) {
        return Some(Error::RankFailed { rank, reason: e.to_string() });
    }
    failures().next().map(|(_, e)| match e {
        Error::PeerFailed { rank, reason } => Error::RankFailed { rank: *rank, reason: reason.strip_prefix("aborted: ").unwrap_or(reason).to_string() },
        Error::RankFailed { rank, reason } => Error::RankFailed { rank: *rank, reason: reason.clone() },
        other => Error::invalid("Driver", other.to_string()),
    })
}

fn panicked(what: &str, panic: &Box<dyn std::any::Any + Send>) -> Error {
    Error::invalid("Driver", format!("{what} panicked: {}", panic_message(panic)))
}

fn diverged(what: String) -> Error {
    Error::invalid(
        "Driver::spawn_tensor_parallel",
        format!("{what}: the ranks' engines are no longer in step (built differently, or the model's forward is not deterministic), so the group stops"),
    )
}
