//! Runs a schedule's stages together in simulated time, checking every rule
//! of the executor on the way. [`Schedule::check`] is a replay at zero cost;
//! [`Schedule::simulate`] keeps the times.
//!
//! Each stage has its own clock. A stage advances until its next action is a
//! receive whose tensor has not been sent yet; when no stage can advance and
//! some are unfinished, the schedule deadlocks. Because sends never wait, the
//! times a stage sees depend only on its own actions and on when its
//! messages were sent, not on the order the stages are replayed in.

use super::{Action, Costs, Event, Schedule};
use std::collections::HashMap;
use tessera_core::{Error, Result};

/// What a replay produces: every action with its times, and per stage the
/// time it finished and the time it spent computing.
pub(super) struct Replay {
    pub events: Vec<Event>,
    pub finish: Vec<f64>,
    pub busy: Vec<f64>,
}

/// The two kinds of tensors that cross stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Kind {
    Activation,
    Grad,
}

/// A tensor in flight: its kind, sender, receiver, microbatch, and the
/// virtual stage that produced it.
type Message = (Kind, usize, usize, usize, usize);

/// One stage's progress. The flags are indexed by `microbatch · chunks + chunk`.
struct Stage {
    cursor: usize,
    clock: f64,
    busy: f64,
    forwarded: Vec<bool>,
    /// The unit's input gradient exists (a whole backward or its input half ran).
    backwarded: Vec<bool>,
    /// The unit's weight gradients exist (a whole backward or its weight half ran).
    weighed: Vec<bool>,
    has_input: Vec<bool>,
    has_output_grad: Vec<bool>,
}

enum Step {
    Ran(Event),
    Waiting,
}

pub(super) fn replay(schedule: &Schedule, costs: &Costs) -> Result<Replay> {
    let units = schedule.microbatches * schedule.chunks;
    let mut stages: Vec<Stage> = (0..schedule.stages)
        .map(|_| Stage {
            cursor: 0,
            clock: 0.0,
            busy: 0.0,
            forwarded: vec![false; units],
            backwarded: vec![false; units],
            weighed: vec![false; units],
            has_input: vec![false; units],
            has_output_grad: vec![false; units],
        })
        .collect();
    // Arrival time of every tensor sent and not yet received.
    let mut mailbox: HashMap<Message, f64> = HashMap::new();
    let mut events = Vec::new();
    loop {
        let mut progressed = false;
        for (s, stage) in stages.iter_mut().enumerate() {
            let actions = schedule.actions(s);
            while stage.cursor < actions.len() {
                match step(schedule, costs, s, stage, actions[stage.cursor], &mut mailbox)? {
                    Step::Ran(event) => {
                        events.push(event);
                        stage.cursor += 1;
                        progressed = true;
                    }
                    Step::Waiting => break,
                }
            }
        }
        let done = stages.iter().enumerate().all(|(s, st)| st.cursor == schedule.actions(s).len());
        if done {
            break;
        }
        if !progressed {
            return Err(deadlock(schedule, &stages));
        }
    }
    finished(schedule, &stages, &mailbox)?;
    Ok(Replay { events, finish: stages.iter().map(|s| s.clock).collect(), busy: stages.iter().map(|s| s.busy).collect() })
}

/// Runs `a` on stage `s` if it can run now; an error if it breaks a rule.
fn step(schedule: &Schedule, costs: &Costs, s: usize, st: &mut Stage, a: Action, mailbox: &mut HashMap<Message, f64>) -> Result<Step> {
    let index = st.cursor;
    let fail = |msg: String| -> Result<Step> { Err(error(schedule, s, index, a, msg)) };
    let (p, m, v) = (schedule.stages, schedule.microbatches, schedule.chunks);
    let (mb, c) = (a.microbatch(), a.chunk());
    if mb >= m {
        return fail(format!("microbatch {mb} is out of range; the schedule has microbatches 0..{m}"));
    }
    if c >= v {
        return fail(format!("chunk {c} is out of range; each stage has chunks 0..{v}"));
    }
    if let Some(peer) = a.peer().filter(|&t| t >= p) {
        return fail(format!("stage {peer} does not exist; the schedule has stages 0..{p}"));
    }
    let k = schedule.virtual_stage(s, c);
    let last = schedule.virtual_stages() - 1;
    let unit = mb * v + c;
    // The stage (and its chunk) of the virtual stages before and after this one.
    let prev = (k > 0).then(|| schedule.placement(k - 1));
    let next = (k < last).then(|| schedule.placement(k + 1));
    let start = st.clock;
    match a {
        Action::Forward { .. } => {
            if st.forwarded[unit] {
                return fail("this forward already ran; run each forward once".into());
            }
            match prev {
                Some((t, pc)) if t == s && !st.forwarded[mb * v + pc] => {
                    return fail(format!("its input is the output of this stage's chunk {pc}, whose forward has not run; run F{mb}.{pc} first"));
                }
                Some((t, _)) if t != s && !st.has_input[unit] => {
                    return fail(format!("its input has not been received; put RecvActivation {{ from: {t}, microbatch: {mb}, chunk: {c} }} before it"));
                }
                _ => {}
            }
            st.forwarded[unit] = true;
            st.clock += costs.forward;
            st.busy += costs.forward;
        }
        Action::Backward { .. } | Action::BackwardInput { .. } => {
            if !st.forwarded[unit] {
                return fail(format!("its forward has not run; run F{mb}.{c} first"));
            }
            if st.backwarded[unit] {
                return fail("this unit's backward (or its input half) already ran; run each backward once".into());
            }
            match next {
                Some((t, nc)) if t == s && !st.backwarded[mb * v + nc] => {
                    return fail(format!("it needs the gradient from this stage's chunk {nc}, whose backward has not run; run B{mb}.{nc} first"));
                }
                Some((t, _)) if t != s && !st.has_output_grad[unit] => {
                    return fail(format!("its output's gradient has not been received; put RecvGrad {{ from: {t}, microbatch: {mb}, chunk: {c} }} before it"));
                }
                _ => {}
            }
            st.backwarded[unit] = true;
            let cost = if matches!(a, Action::Backward { .. }) {
                st.weighed[unit] = true;
                costs.backward
            } else {
                costs.input()
            };
            st.clock += cost;
            st.busy += cost;
        }
        Action::BackwardWeight { .. } => {
            if st.weighed[unit] {
                return fail("this unit's weight gradients were already computed (by its whole backward or an earlier Bw); run each once".into());
            }
            if !st.backwarded[unit] {
                return fail(format!("its input half has not run; run Bx{mb}.{c} first (it puts aside what the weight half reads)"));
            }
            st.weighed[unit] = true;
            st.clock += costs.weight;
            st.busy += costs.weight;
        }
        Action::SendActivation { to, .. } | Action::SendGrad { to, .. } => {
            let activation = matches!(a, Action::SendActivation { .. });
            let (consumer, what, done) = if activation { (next, "output", st.forwarded[unit]) } else { (prev, "input's gradient", st.backwarded[unit]) };
            match consumer {
                None => return fail(format!("virtual stage {k} is the {} one: no stage consumes its {what}", if activation { "last" } else { "first" })),
                Some((t, _)) if t == s => return fail(format!("the consumer of its {what} is on this stage; hand it over locally, without a send")),
                Some((t, _)) if t != to => return fail(format!("the consumer of its {what} is on stage {t}, not stage {to}; send it to stage {t}")),
                _ => {}
            }
            if !done {
                let compute = if activation { "F" } else { "B" };
                return fail(format!("the tensor is not computed yet; run {compute}{mb}.{c} before sending"));
            }
            let kind = if activation { Kind::Activation } else { Kind::Grad };
            if mailbox.insert((kind, s, to, mb, k), st.clock + costs.latency).is_some() {
                return fail("the same tensor was sent before and not yet received; send it once".into());
            }
        }
        Action::RecvActivation { from, .. } | Action::RecvGrad { from, .. } => {
            let activation = matches!(a, Action::RecvActivation { .. });
            let (producer, what) = if activation { (prev, "input") } else { (next, "output's gradient") };
            let k_from = match producer {
                None => return fail(format!("virtual stage {k} is the {} one: it has no {what} to receive", if activation { "first" } else { "last" })),
                Some((t, _)) if t == s => return fail(format!("its {what} is produced on this stage; take it locally, without a receive")),
                Some((t, _)) if t != from => return fail(format!("its {what} comes from stage {t}, not stage {from}; receive it from stage {t}")),
                Some(_) => {
                    if activation {
                        k - 1
                    } else {
                        k + 1
                    }
                }
            };
            let flags = if activation { &mut st.has_input } else { &mut st.has_output_grad };
            if flags[unit] {
                return fail("this tensor was already received; receive it once".into());
            }
            let kind = if activation { Kind::Activation } else { Kind::Grad };
            let Some(arrival) = mailbox.remove(&(kind, from, s, mb, k_from)) else {
                return Ok(Step::Waiting);
            };
            flags[unit] = true;
            st.clock = st.clock.max(arrival);
        }
    }
    Ok(Step::Ran(Event { stage: s, action: a, start, end: st.clock }))
}

/// Every stage ran everything, and every tensor sent was received.
fn finished(schedule: &Schedule, stages: &[Stage], mailbox: &HashMap<Message, f64>) -> Result<()> {
    let v = schedule.chunks;
    for (s, st) in stages.iter().enumerate() {
        for (unit, ((&f, &b), &w)) in st.forwarded.iter().zip(&st.backwarded).zip(&st.weighed).enumerate() {
            let (mb, c) = (unit / v, unit % v);
            if !f || !b || !w {
                let missing = if !f {
                    "forward"
                } else if !b {
                    "backward"
                } else {
                    "weight half (Bw) of the backward"
                };
                return Err(Error::schedule(
                    "Schedule::check",
                    format!(
                        "{}: stage {s} never runs the {missing} of microbatch {mb}, chunk {c}; every stage must forward and backward every (microbatch, chunk)",
                        schedule.name
                    ),
                ));
            }
        }
    }
    let mut unreceived: Vec<&Message> = mailbox.keys().collect();
    unreceived.sort();
    if let Some(&&(kind, from, to, mb, k)) = unreceived.first() {
        let (_, c) = schedule.placement(k);
        let (what, recv) = match kind {
            Kind::Activation => ("activation", format!("RecvActivation {{ from: {from}, microbatch: {mb}, chunk: {} }}", schedule.placement(k + 1).1)),
            Kind::Grad => ("gradient", format!("RecvGrad {{ from: {from}, microbatch: {mb}, chunk: {} }}", schedule.placement(k - 1).1)),
        };
        return Err(Error::schedule(
            "Schedule::check",
            format!(
                "{}: stage {from} sends the {what} of microbatch {mb}, chunk {c} to stage {to}, which never receives it ({} unreceived sends in all); add {recv} on stage {to}",
                schedule.name,
                unreceived.len()
            ),
        ));
    }
    Ok(())
}

/// The error of a schedule whose every unfinished stage waits on a receive.
fn deadlock(schedule: &Schedule, stages: &[Stage]) -> Error {
    let waiting: Vec<String> = stages
        .iter()
        .enumerate()
        .filter_map(|(s, st)| schedule.actions(s).get(st.cursor).map(|a| format!("stage {s} at action {} (`{a}`)", st.cursor)))
        .collect();
    Error::schedule(
        "Schedule::check",
        format!(
            "{}: deadlock: {} wait(s) for a tensor that no stage can send yet; reorder the computations so that each receive's sender can get to its send",
            schedule.name,
            waiting.join(", ")
        ),
    )
}

fn error(schedule: &Schedule, s: usize, index: usize, a: Action, msg: String) -> Error {
    Error::schedule("Schedule::check", format!("{}: stage {s}, action {index} (`{a}`): {msg}", schedule.name))
}
