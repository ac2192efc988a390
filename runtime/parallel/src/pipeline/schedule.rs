//! The built-in schedules: one function each, producing the order of
//! computation on every stage; [`wire`] then adds the transfers that order
//! implies.

use super::{validate, Action, Schedule};
use tessera_core::{Error, Result};

/// A schedule family, for choosing one from a config or a command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// Every forward, then every backward: see [`gpipe`].
    GPipe,
    /// One forward, one backward in the steady state: see [`one_f_one_b`].
    OneFOneB,
    /// 1F1B over `chunks` model chunks per stage: see [`interleaved_one_f_one_b`].
    Interleaved {
        /// Model chunks per stage.
        chunks: usize,
    },
    /// 1F1B with the backward split in two and the weight halves filling
    /// the bubble: see [`zero_bubble_h1`].
    ZeroBubbleH1,
}

impl ScheduleKind {
    /// The schedule of this family for `stages` stages and `microbatches` microbatches.
    pub fn build(self, stages: usize, microbatches: usize) -> Result<Schedule> {
        match self {
            ScheduleKind::GPipe => gpipe(stages, microbatches),
            ScheduleKind::OneFOneB => one_f_one_b(stages, microbatches),
            ScheduleKind::Interleaved { chunks } => interleaved_one_f_one_b(stages, microbatches, chunks),
            ScheduleKind::ZeroBubbleH1 => zero_bubble_h1(stages, microbatches),
        }
    }

    /// Model chunks per stage: `chunks` when interleaved, else 1.
    pub fn chunks(self) -> usize {
        match self {
            ScheduleKind::Interleaved { chunks } => chunks,
            _ => 1,
        }
    }
}

/// GPipe: every stage runs all `microbatches` forwards, then all backwards.
///
/// Simple, and its bubble is the same as 1F1B's, but every stage holds the
/// activations of all microbatches at once.
///
/// ```
/// use tessera::parallel::pipeline::gpipe;
///
/// let s = gpipe(2, 3)?;
/// assert_eq!(s.to_string().lines().nth(1), Some("stage 0: F0.0 F1.0 F2.0 B0.0 B1.0 B2.0"));
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn gpipe(stages: usize, microbatches: usize) -> Result<Schedule> {
    validate("pipeline::gpipe", stages, microbatches, 1)?;
    let order: Vec<Action> = (0..microbatches)
        .map(|mb| Action::Forward { microbatch: mb, chunk: 0 })
        .chain((0..microbatches).map(|mb| Action::Backward { microbatch: mb, chunk: 0 }))
        .collect();
    let orders = vec![order; stages];
    Ok(Schedule::new("GPipe", stages, microbatches, 1, wire(stages, 1, orders)))
}

/// 1F1B: stage `s` runs `p − s − 1` warm-up forwards, then alternates one
/// forward and one backward, then drains the remaining backwards.
///
/// The bubble equals GPipe's, but stage `s` holds at most `p − s`
/// microbatches' activations instead of all of them: the backward of a
/// microbatch starts as soon as the last stage can run it.
///
/// ```
/// use tessera::parallel::pipeline::one_f_one_b;
///
/// let s = one_f_one_b(3, 4)?;
/// let text = s.to_string();
/// let mut lines = text.lines().skip(1);
/// assert_eq!(lines.next(), Some("stage 0: F0.0 F1.0 F2.0 B0.0 F3.0 B1.0 B2.0 B3.0"));
/// assert_eq!(lines.next(), Some("stage 1: F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 B3.0"));
/// assert_eq!(lines.next(), Some("stage 2: F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0"));
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn one_f_one_b(stages: usize, microbatches: usize) -> Result<Schedule> {
    validate("pipeline::one_f_one_b", stages, microbatches, 1)?;
    let unit = |microbatch| (microbatch, 0);
    let orders = (0..stages).map(|s| warm_steady_drain(stages - s - 1, microbatches, unit, unit)).collect();
    Ok(Schedule::new("1F1B", stages, microbatches, 1, wire(stages, 1, orders)))
}

/// Interleaved 1F1B: each stage holds `chunks` (v) model chunks, and the
/// 1F1B pattern runs over (microbatch, chunk) units, which cuts the bubble
/// by a factor of v at the cost of v times more transfers.
///
/// Microbatches go through in groups of `p`: a stage runs the forwards of
/// group 0 on chunk 0, then group 0 on chunk 1, …, then group 1 on chunk 0,
/// and the backwards in the same order with the chunks reversed. Stage `s`
/// warms up with `(v − 1)·p + 2·(p − s − 1)` forwards: `(v − 1)·p` to reach the
/// last chunk with the first group, and twice `p − s − 1` because the first
/// gradient has to come back through the later stages and so arrives that many
/// steps later than in plain 1F1B.
///
/// With a chunk's costs a v-th of a whole stage's, the bubble fraction is
/// `(p − 1) / (v·m + p − 1)` instead of 1F1B's `(p − 1) / (m + p − 1)`: the
/// warm-up and drain still cross `p − 1` stage boundaries, but each crossing
/// now costs one chunk instead of a whole stage.
///
/// Requires `microbatches` to be a multiple of `stages`, so that groups are
/// whole. With `chunks == 1` this is [`one_f_one_b`].
///
/// ```
/// use tessera::parallel::pipeline::interleaved_one_f_one_b;
///
/// let s = interleaved_one_f_one_b(2, 4, 2)?;
/// assert_eq!(s.virtual_stage(0, 1), 2); // stage 0 holds virtual stages 0 and 2
/// s.check()?;
/// assert!(interleaved_one_f_one_b(4, 6, 2).is_err()); // 6 is not a multiple of 4
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn interleaved_one_f_one_b(stages: usize, microbatches: usize, chunks: usize) -> Result<Schedule> {
    const OP: &str = "pipeline::interleaved_one_f_one_b";
    validate(OP, stages, microbatches, chunks)?;
    if chunks == 1 {
        return one_f_one_b(stages, microbatches);
    }
    if !microbatches.is_multiple_of(stages) {
        let below = microbatches / stages * stages;
        let above = below + stages;
        let options = if below > 0 { format!("{below} or {above}") } else { format!("{above}") };
        return Err(Error::schedule(
            OP,
            format!(
                "{microbatches} microbatches is not a multiple of the {stages} stages: interleaving sends microbatches through the chunks in groups of {stages}; use {options} microbatches, or plain 1F1B"
            ),
        ));
    }
    let (p, v) = (stages, chunks);
    // The i-th unit in forward order: group i / (p·v), chunk (i / p) mod v,
    // microbatch of the group i mod p.
    let forward = move |i: usize| (i / (p * v) * p + i % p, (i / p) % v);
    let backward = move |i: usize| {
        let (mb, chunk) = forward(i);
        (mb, v - 1 - chunk)
    };
    let orders = (0..p).map(|s| warm_steady_drain((v - 1) * p + 2 * (p - s - 1), microbatches * v, forward, backward)).collect();
    Ok(Schedule::new(&format!("interleaved 1F1B (v={v})"), stages, microbatches, chunks, wire(stages, chunks, orders)))
}

/// ZB-H1, the zero-bubble schedule of Qi et al. (ICLR 2024) that keeps
/// 1F1B's peak memory: each backward is split into its input half `Bx`,
/// which the previous stage waits for, and its weight half `Bw`, which no
/// one waits for. Stage `s` runs 1F1B's order with `Bx` in place of each
/// backward, and runs the weight half of microbatch `j` right after the input
/// half of microbatch `j + s` (the rest at the end).
///
/// The input gradients then cross the stages at the cost of `Bx` alone,
/// and the postponed `Bw`s fill the drain, where 1F1B's stages wait: with
/// forward `F`, input half `B` and weight half `W` (`W ≤ F`, `W ≤ B`), each
/// stage idles `(p − 1)·(F + B − W)` instead of 1F1B's `(p − 1)·(F + B + W)`,
/// a third of it when the three are equal. Every stage holds at most `p`
/// microbatches' activations (a `Bw` reads the layers' inputs, so a unit is
/// held until its weight half), 1F1B's peak on its first stage.
///
/// ```
/// use tessera::parallel::pipeline::{zero_bubble_h1, Costs};
///
/// let s = zero_bubble_h1(2, 3)?;
/// let text = s.to_string();
/// let mut lines = text.lines().skip(1);
/// assert_eq!(lines.next(), Some("stage 0: F0.0 F1.0 Bx0.0 Bw0.0 F2.0 Bx1.0 Bw1.0 Bx2.0 Bw2.0"));
/// assert_eq!(lines.next(), Some("stage 1: F0.0 Bx0.0 F1.0 Bx1.0 Bw0.0 F2.0 Bx2.0 Bw1.0 Bw2.0"));
/// // F = B = W = 1: one unit of idle per stage where 1F1B has three.
/// let sim = s.simulate(&Costs::new(1.0, 2.0).with_weight(1.0))?;
/// assert_eq!(sim.stages()[0].idle, 1.0);
/// # Ok::<(), tessera::Error>(())
/// ```
pub fn zero_bubble_h1(stages: usize, microbatches: usize) -> Result<Schedule> {
    validate("pipeline::zero_bubble_h1", stages, microbatches, 1)?;
    let unit = |microbatch| (microbatch, 0);
    let orders = (0..stages)
        .map(|s| {
            let mut order = Vec::with_capacity(3 * microbatches);
            let mut weighed = 0;
            for a in warm_steady_drain(stages - s - 1, microbatches, unit, unit) {
                match a {
                    Action::Backward { microbatch, chunk } => {
                        order.push(Action::BackwardInput { microbatch, chunk });
                        if microbatch >= s {
                            order.push(Action::BackwardWeight { microbatch: weighed, chunk });
                            weighed += 1;
                        }
                    }
                    a => order.push(a),
                }
            }
            order.extend((weighed..microbatches).map(|microbatch| Action::BackwardWeight { microbatch, chunk: 0 }));
            order
        })
        .collect();
    Ok(Schedule::new("ZB-H1", stages, microbatches, 1, wire(stages, 1, orders)))
}

/// The 1F1B pattern over `units` (microbatch, chunk) units, the i-th forward
/// being `forward(i)` and the i-th backward `backward(i)`: `warmup` forwards,
/// then forward/backward pairs, then the remaining backwards.
fn warm_steady_drain(warmup: usize, units: usize, forward: impl Fn(usize) -> (usize, usize), backward: impl Fn(usize) -> (usize, usize)) -> Vec<Action> {
    let warmup = warmup.min(units);
    let f = |i| {
        let (microbatch, chunk) = forward(i);
        Action::Forward { microbatch, chunk }
    };
    let b = |i| {
        let (microbatch, chunk) = backward(i);
        Action::Backward { microbatch, chunk }
    };
    let mut order: Vec<Action> = (0..warmup).map(f).collect();
    for i in 0..units - warmup {
        order.push(f(warmup + i));
        order.push(b(i));
    }
    order.extend((units - warmup..units).map(b));
    order
}

/// Adds the transfers a computation order implies: each compute receives its
/// input right before it runs (when another stage produced it) and sends its
/// output right after. Sends do not wait for the receiver, so sending early
/// never blocks, and receiving late never makes a stage wait longer than the
/// data takes to arrive.
fn wire(stages: usize, chunks: usize, orders: Vec<Vec<Action>>) -> Vec<Vec<Action>> {
    let last = stages * chunks - 1;
    let place = |k: usize| (k % stages, k / stages);
    orders
        .into_iter()
        .enumerate()
        .map(|(s, order)| {
            let mut out = Vec::with_capacity(order.len() * 3);
            for a in order {
                let (microbatch, chunk) = (a.microbatch(), a.chunk());
                let k = chunk * stages + s;
                // The neighbouring virtual stages' stages, when they are on another stage.
                let prev = (k > 0).then(|| place(k - 1).0).filter(|&t| t != s);
                let next = (k < last).then(|| place(k + 1).0).filter(|&t| t != s);
                match a {
                    Action::Forward { .. } => {
                        out.extend(prev.map(|from| Action::RecvActivation { from, microbatch, chunk }));
                        out.push(a);
                        out.extend(next.map(|to| Action::SendActivation { to, microbatch, chunk }));
                    }
                    Action::Backward { .. } | Action::BackwardInput { .. } => {
                        out.extend(next.map(|from| Action::RecvGrad { from, microbatch, chunk }));
                        out.push(a);
                        out.extend(prev.map(|to| Action::SendGrad { to, microbatch, chunk }));
                    }
                    _ => out.push(a),
                }
            }
            out
        })
        .collect()
}
