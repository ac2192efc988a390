//! One rank's communicator in a group of processes of one node, and the
//! collectives as steps over the group's segment (see `group` for steps).
//!
//! Every collective's first step carries each member's call, which every
//! member checks against its own (so all detect a mismatch at the same
//! step, and the group stays usable), and the first round of its data.
//! Large tensors move in rounds of one staging half per member; the
//! arithmetic is the in-process communicator's ([`host::Summand`]), so the
//! three backends give the same bits.
//!
//! - **all-reduce**: one step per round, plus one. Member `i` stages its
//!   input's round except its own part; at the next step member `j` has
//!   summed part `j` of the round over every member in rank order (its own
//!   input read in place), written it into its result and staged it beside
//!   its staging of the following round, and every member copies the other
//!   sums into its result. Each member copies `(n−1)/n` of its input in and
//!   `(n−1)/n` of the result out, besides reading its part of the inputs
//!   and writing its part of the result: with rounds of a megabyte, the
//!   staged bytes are still in the cache when they are read.
//! - **all-gather**, **broadcast**: per round one step, the members (the
//!   root) stage, every member copies.
//! - **reduce-scatter**: per round one step; member `i` stages for each
//!   peer `j` its slice of part `j`; member `j` sums its part.
//! - **all-to-all**: the first step carries every part's shape, then each
//!   round one step, member `i` staging a slice of every part.
//!
//! [`host::Summand`]: crate::host

use super::call::{describable, Place, Record};
use super::group::Group;
use crate::call::{meta, Call, Meta, Op};
use crate::host::{check_split, chunk, elements, host_device, store, streams, sum_blocks, sum_into, wrap, Summand};
use crate::host_comm::{HostComm, HostCore};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tessera_core::backend::cpu::Buffer;
use tessera_core::backend::{CpuDevice, CpuStorage};
use tessera_core::tensor::{with_elem, Element, Tensor};
use tessera_core::{Error, Result};

/// One rank's communicator for a group of ranks that are processes of this
/// node, through shared memory.
///
/// Synchronous calls run on the calling thread, asynchronous ones in order on
/// a background thread (see [`HostComm`]). Dropping it leaves the group (the
/// peers' calls that still need this rank fail); dropping it while its
/// thread panics stops the job.
pub type ShmComm = HostComm<ShmCore>;

/// What a shared-memory communicator's calls run on, shared with its
/// background thread.
pub struct ShmCore {
    group: Arc<Group>,
    device: CpuDevice,
    /// The number of this member's next step (collectives run one at a
    /// time, under the serial lock).
    steps: AtomicU64,
    /// The number of this member's next collective.
    colls: AtomicU64,
    /// Numbers the files of messages too large for a ring.
    files: AtomicU64,
    /// Collectives that worked in place in the members' arenas.
    in_place: AtomicU64,
}

fn cpu(t: &Tensor) -> Result<&CpuDevice> {
    host_device(t, "collectives through shared memory (CUDA ranks communicate through NCCL)")
}

/// `t` contiguous, if it is a host tensor whose shape a call record can
/// describe.
fn host(op: &'static str, t: &Tensor) -> Result<Tensor> {
    cpu(t)?;
    describable(t.dims()).map_err(|e| Error::invalid(op, e))?;
    t.contiguous()
}

/// Elements `T` of a staged byte range.
fn typed<T: Element>(b: &[u8]) -> &[T] {
    bytemuck::cast_slice(b)
}

fn typed_mut<T: Element>(b: &mut [u8]) -> &mut [T] {
    bytemuck::cast_slice_mut(b)
}

impl ShmComm {
    /// How many of this rank's collectives on this communicator read and
    /// wrote the members' tensors in place in their arenas, rather than
    /// staging them (see the module `arena`): what tells a job, or a test,
    /// that its tensors are where the fast path needs them.
    pub fn in_place_collectives(&self) -> u64 {
        self.core().in_place.load(Ordering::Relaxed)
    }
}

/// A result buffer this member offered its peers to write into. If the
/// collective fails once the offer is out, a peer may still be writing, so
/// the buffer is leaked rather than freed for reuse (the job is stopping).
struct Lent<T: Send + 'static>(Option<Buffer<T>>);

impl<T: Send + 'static> Lent<T> {
    fn buffer(&mut self) -> &mut Buffer<T> {
        self.0.as_mut().expect("not reclaimed yet")
    }

    /// The buffer, once no peer writes into it any more.
    fn reclaim(mut self) -> Buffer<T> {
        self.0.take().expect("not reclaimed yet")
    }
}

impl<T: Send + 'static> Drop for Lent<T> {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            std::mem::forget(b);
        }
    }
}

/// Where a collective stands after its first step, for
/// [`ShmCore::staged_or_in_place`]: the step and the collective's numbers,
/// every member's record, whether this member offered to work in place,
/// and the number of staged rounds.
struct Rounds<'a> {
    op: &'static str,
    s: u64,
    coll: u64,
    records: &'a [Record],
    offered: bool,
    rounds: usize,
}

/// A step's tag: the collective's number and the step's place in it.
fn tag(coll: u64, k: usize) -> u64 {
    (coll << 32) | (k as u64 & 0xffff_ffff)
}

impl ShmCore {
    pub(super) fn new(group: Arc<Group>, device: CpuDevice) -> ShmCore {
        ShmCore { group, device, steps: AtomicU64::new(0), colls: AtomicU64::new(0), files: AtomicU64::new(0), in_place: AtomicU64::new(0) }
    }

    fn n(&self) -> usize {
        self.group.n()
    }

    fn me(&self) -> usize {
        self.group.me
    }

    /// The number of this member's next step.
    fn next(&self) -> u64 {
        self.steps.load(Ordering::Relaxed)
    }

    /// Posts step `s` (the next one) as step `k` of collective `coll` and
    /// waits for every peer to post it.
    fn step(&self, op: &'static str, s: u64, coll: u64, k: usize) -> Result<()> {
        debug_assert_eq!(s, self.next());
        self.steps.store(s + 1, Ordering::Relaxed);
        self.group.step(op, s, tag(coll, k))
    }

    /// The first step of every collective: writes this member's call,
    /// stages the first round (`stage`, only when the call is valid here),
    /// posts, and checks that every member made the same call with valid
    /// arguments; every member reaches the same verdict. Returns the step,
    /// the collective's number and every member's call.
    fn open(&self, op: &'static str, record: Record, own: Result<()>, stage: impl FnOnce(u64)) -> Result<(u64, u64, Vec<Record>)> {
        if let Some(e) = self.group.node.failure() {
            return Err(e);
        }
        let coll = self.colls.fetch_add(1, Ordering::Relaxed);
        let s = self.next();
        // SAFETY: before posting step `s`, after every peer posted `s - 1`
        // (this member's previous step returned only once they had).
        record.write(unsafe { self.group.call_mut(s) });
        if own.is_ok() {
            stage(s);
        }
        self.step(op, s, coll, 0)?;
        let (n, me) = (self.n(), self.me());
        let ranks = &self.group.ranks;
        let records = ranks
            .iter()
            .enumerate()
            .map(|(m, rank)| match m == me {
                true => Ok(record.clone()),
                // SAFETY: `m` posted step `s`; this member posts `s + 1`
                // only after reading.
                false => Record::read(unsafe { self.group.call(m, s) }, n)
                    .ok_or_else(|| Error::CollectiveMismatch { op, detail: format!("rank {rank}'s call record does not parse (a rank of another version?)") }),
            })
            .collect::<Result<Vec<_>>>()?;
        let (world, call) = (ranks[me], &record.call);
        if let Some((m, r)) = records.iter().enumerate().find(|(_, r)| r.call.op != call.op) {
            return Err(Error::CollectiveMismatch { op, detail: format!("rank {world} called {call} while rank {} called {}", ranks[m], r.call) });
        }
        own?;
        if let Some((m, r)) = records.iter().enumerate().find(|(_, r)| r.invalid.is_some()) {
            return Err(Error::CollectiveMismatch {
                op,
                detail: format!("rank {} passed invalid arguments ({})", ranks[m], r.invalid.as_deref().unwrap_or_default()),
            });
        }
        if let Some((m, r)) = records.iter().enumerate().find(|(_, r)| r.call.meta != call.meta) {
            return Err(Error::CollectiveMismatch { op, detail: format!("rank {world} called {call} but rank {} called {}", ranks[m], r.call) });
        }
        Ok((s, coll, records))
    }

    /// This member's record of `op` on `t`, given its verdict on its own
    /// arguments.
    fn record(op: Op, t: Option<&Tensor>, local: &Result<impl Sized>) -> Record {
        Record { call: Call { op, meta: t.map(meta) }, invalid: local.as_ref().err().map(|e| e.to_string()), parts: Vec::new(), place: None }
    }

    fn all_reduce_typed<T: Summand>(&self, t: &Tensor, local: Result<Tensor>, mut record: Record) -> Result<Tensor> {
        const OP: &str = "all_reduce_sum";
        let (n, me) = (self.n(), self.me());
        let e = std::mem::size_of::<T>();
        let len = t.elem_count();
        // A half holds a round of the input (`per` elements) and, after it,
        // this member's part of the previous round's sum.
        let per = (self.group.lay.half - 128) / e * n / (n + 1);
        let sums_at = (per * e).div_ceil(64) * 64;
        let rounds = len.div_ceil(per);
        let round = |k: usize| k * per..((k + 1) * per).min(len);
        let c = local.as_ref().ok().cloned();
        let guard = c.as_ref().map(|c| c.read());
        let x: &[T] = match (&c, &guard) {
            (Some(c), Some(g)) => elements::<T>(c, g),
            _ => &[],
        };
        // In place when this member's input and result lie in its arena and
        // it maps every peer's (see `arena`): the offer goes in its record.
        let lent = match &local {
            Ok(_) if n > 1 => self.lend::<T>(x, cpu(t)?).map(|(place, out)| {
                record.place = Some(place);
                Lent(Some(out))
            }),
            _ => None,
        };
        let offered = lent.is_some();
        // Round `k` of the input, but for this member's own part, which it
        // reads in place.
        let stage = |s: u64, k: usize| {
            let r = round(k);
            let mine = chunk(r.len(), n, me);
            // SAFETY: called before posting step `s`, after every peer
            // posted `s - 1`; no other borrow of these bytes lives.
            let dst: &mut [T] = typed_mut(unsafe { self.group.stage(s, 0, r.len() * e) });
            dst[..mine.start].copy_from_slice(&x[r.start..r.start + mine.start]);
            dst[mine.end..].copy_from_slice(&x[r.start + mine.end..r.end]);
        };
        let (mut s, coll, records) = self.open(OP, record, local.map(drop), |s| {
            if rounds > 0 && !offered {
                stage(s, 0)
            }
        })?;
        let dev = cpu(t)?;
        let stream = streams(len * e);
        if let Some(mut lent) = lent {
            if records.iter().all(|r| r.place.is_some()) {
                self.all_reduce_in_place(x, lent.buffer(), &records)?;
                self.in_place.fetch_add(1, Ordering::Relaxed);
                s = self.next();
                self.step(OP, s, coll, 1)?;
                return Ok(wrap(CpuStorage::from_buffer(lent.reclaim()), t.shape().clone(), dev));
            }
            // Every member saw the same records: no peer writes into it.
            drop(lent.reclaim());
        }
        // Staged. Members that offered to work in place staged nothing at
        // the first step: then every member stages the first round again.
        let extra = usize::from(records.iter().any(|r| r.place.is_some()));
        if extra == 1 && rounds > 0 {
            s = self.next();
            stage(s, 0);
            self.step(OP, s, coll, 1)?;
        }
        let mut out = dev.buffer_for_overwrite::<T>(len);
        // Step `k` (after the first) carries this member's part of round
        // `k - 1`'s sum and its staging of round `k`: one step per round.
        for k in 1..=rounds {
            let r = round(k - 1);
            let mine = chunk(r.len(), n, me);
            // This member's part of the round, summed in rank order into its
            // result and into the next step's half for the others.
            let srcs: Vec<&[T]> = (0..n)
                .map(|i| match i == me {
                    true => &x[r.start + mine.start..r.start + mine.end],
                    // SAFETY: `i` posted step `s`, and this member posts
                    // `s + 1` only after reading.
                    false => typed(unsafe { self.group.staged(i, s, mine.start * e, mine.len() * e) }),
                })
                .collect();
            let sums: &mut [T] = match n {
                1 => &mut [],
                // SAFETY: before posting step `s + 1`, after every peer
                // posted `s`; the staging below writes other bytes, after
                // this borrow ends.
                _ => typed_mut(unsafe { self.group.stage(s + 1, sums_at, mine.len() * e) }),
            };
            let dst = &mut out[r.start + mine.start..r.start + mine.end];
            sum_blocks(&srcs, |off, block| {
                if !sums.is_empty() {
                    sums[off..off + block.len()].copy_from_slice(block);
                }
                store(block, &mut dst[off..off + block.len()], stream);
            });
            drop(srcs);
            if k < rounds {
                stage(s + 1, k);
            }
            s += 1;
            self.step(OP, s, coll, k + extra)?;
            for j in (0..n).filter(|&j| j != me) {
                let theirs = chunk(r.len(), n, j);
                // SAFETY: `j` posted step `s`, and this member posts `s + 1`
                // only after reading.
                let src: &[T] = typed(unsafe { self.group.staged(j, s, sums_at, theirs.len() * e) });
                store(src, &mut out[r.start + theirs.start..r.start + theirs.end], stream);
            }
        }
        drop(guard);
        Ok(wrap(CpuStorage::from_buffer(out), t.shape().clone(), dev))
    }

    /// The data steps of a collective whose members stage its first round
    /// at the first step unless they offered to work in place: `in_place`
    /// when every member offered, then the collective's last step;
    /// otherwise `plan.rounds` rounds, round `k` staged by `stage(step, k)`
    /// (the first one again, at a step of its own, when some member offered
    /// and so staged nothing) and read by `read(out, step, k)` at the step
    /// that carries it.
    fn staged_or_in_place<O: ?Sized>(
        &self,
        plan: Rounds<'_>,
        out: &mut O,
        stage: impl Fn(u64, usize),
        in_place: impl FnOnce(&mut O) -> Result<()>,
        mut read: impl FnMut(&mut O, u64, usize),
    ) -> Result<()> {
        let Rounds { op, mut s, coll, records, offered, rounds } = plan;
        if offered && records.iter().all(|r| r.place.is_some()) {
            in_place(out)?;
            self.in_place.fetch_add(1, Ordering::Relaxed);
            s = self.next();
            return self.step(op, s, coll, 1);
        }
        let extra = usize::from(records.iter().any(|r| r.place.is_some()));
        for k in 0..rounds {
            if k > 0 || extra == 1 {
                s = self.next();
                stage(s, k);
                self.step(op, s, coll, k + extra)?;
            }
            read(out, s, k);
        }
        Ok(())
    }

    /// Where this member's input `x` lies in its arena, if the group can
    /// work in place (see `arena`) and it does.
    fn offer<T: Element>(&self, x: &[T]) -> Option<u64> {
        let arena = self.group.node.arena.as_ref()?;
        self.group.arenas()?;
        arena.offset_of(x.as_ptr().cast(), std::mem::size_of_val(x))
    }

    /// Where this member's input `x` lies in its arena, and a result buffer
    /// there for the peers to write into: `None` unless the group can work
    /// in place and both lie in the arena (a result on `dev`, the input's
    /// device, which must be the device the arena belongs to).
    fn lend<T: Element>(&self, x: &[T], dev: &CpuDevice) -> Option<(Place, Buffer<T>)> {
        if !dev.same(&self.device) {
            return None;
        }
        let input = self.offer(x)?;
        let out = dev.buffer_for_overwrite::<T>(x.len());
        let result = self.group.node.arena.as_ref()?.offset_of(out.as_ptr().cast(), std::mem::size_of_val(x))?;
        Some((Place { input, result }, out))
    }

    /// Every member's input, read where it lies (this member's own is `x`),
    /// once every member offered its own and all lie within their arenas
    /// (which every member checks alike, so all reach the same verdict).
    ///
    /// # Safety
    ///
    /// The collective must end with a step every member posts only after
    /// its last read of the peers' inputs, and no member may change its
    /// input before that step.
    unsafe fn inputs_in_place<'a, T: Element>(&'a self, op: &'static str, x: &'a [T], records: &[Record]) -> Result<Vec<&'a [T]>> {
        self.check_places(op, records, std::mem::size_of_val(x), 0, std::mem::align_of::<T>())?;
        let arenas = self.group.arenas().expect("this member offered to work in place");
        Ok(records
            .iter()
            .zip(arenas)
            .map(|(r, a)| match a {
                None => x,
                // SAFETY: within the arena (checked above), and unchanged
                // until the last step, by the caller's contract.
                Some(a) => unsafe { a.slice::<T>(r.place.expect("checked").input, x.len()) }.expect("checked"),
            })
            .collect())
    }

    /// Checks that every member's place lies within its arena, for an
    /// input of `input` bytes and a result of `result` bytes (0: the peers
    /// do not write it) of elements aligned to `align`: every member checks
    /// every place against the sizes the arenas were published with, so all
    /// reach the same verdict before any touches a peer's memory.
    fn check_places(&self, op: &'static str, records: &[Record], input: usize, result: usize, align: usize) -> Result<()> {
        for (m, r) in records.iter().enumerate() {
            let rank = self.group.ranks[m];
            let size = self.group.node.arenas[rank].map_or(0, |a| a.1) as u64;
            let fits = |off: u64, bytes: usize| off.is_multiple_of(align as u64) && off.checked_add(bytes as u64).is_some_and(|end| end <= size);
            if !r.place.is_some_and(|p| fits(p.input, input) && (result == 0 || fits(p.result, result))) {
                return Err(Error::CollectiveMismatch { op, detail: format!("rank {rank}'s tensors lie outside its arena (a rank of another version?)") });
            }
        }
        Ok(())
    }

    /// This member's part of an all-reduce in place: it sums part `me` of
    /// every member's input, read where it lies, and writes the sum into
    /// every member's result while it is in the cache. Each member reads
    /// its share of the inputs once and writes `S` bytes in all, as the
    /// in-process communicator does.
    fn all_reduce_in_place<T: Summand>(&self, x: &[T], out: &mut [T], records: &[Record]) -> Result<()> {
        let bytes = std::mem::size_of_val(x);
        self.check_places("all_reduce_sum", records, bytes, bytes, std::mem::align_of::<T>())?;
        let (n, me) = (self.n(), self.me());
        let arenas = self.group.arenas().expect("this member offered to work in place");
        let mine = chunk(x.len(), n, me);
        let skip = (mine.start * std::mem::size_of::<T>()) as u64;
        let mut srcs: Vec<&[T]> = Vec::with_capacity(n);
        let mut outs: Vec<&mut [T]> = Vec::with_capacity(n);
        for (r, a) in records.iter().zip(arenas) {
            let place = r.place.expect("checked");
            match a {
                None => srcs.push(&x[mine.clone()]),
                // SAFETY: within the arena (checked above); member `m` keeps
                // its input unchanged and its result allocated until it sees
                // this member post the collective's last step, and reads its
                // result only then; this member writes part `me` of it alone.
                Some(a) => unsafe {
                    srcs.push(a.slice::<T>(place.input + skip, mine.len()).expect("checked"));
                    outs.push(a.slice_mut::<T>(place.result + skip, mine.len()).expect("checked"));
                },
            }
        }
        outs.push(&mut out[mine]);
        let stream = streams(std::mem::size_of_val(x));
        sum_blocks(&srcs, |at, block| {
            for o in outs.iter_mut() {
                store(block, &mut o[at..at + block.len()], stream);
            }
        });
        Ok(())
    }

    fn all_gather_typed<T: Element + Default>(&self, t: &Tensor, dim: usize, local: Result<Tensor>, mut record: Record) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let (n, me) = (self.n(), self.me());
        let e = std::mem::size_of::<T>();
        let len = t.elem_count();
        let per = self.group.lay.half / e;
        let rounds = len.div_ceil(per);
        let round = |k: usize| k * per..((k + 1) * per).min(len);
        let c = local.as_ref().ok().cloned();
        let guard = c.as_ref().map(|c| c.read());
        let x: &[T] = match (&c, &guard) {
            (Some(c), Some(g)) => elements::<T>(c, g),
            _ => &[],
        };
        // In place when every member's input lies in its arena: each reads
        // the others' where they are.
        let offered = local.is_ok() && n > 1 && self.offer(x).map(|input| record.place = Some(Place { input, result: 0 })).is_some();
        let stage = |s: u64, k: usize| {
            if n > 1 {
                let r = round(k);
                // SAFETY: before posting step `s`, after every peer posted `s - 1`.
                typed_mut::<T>(unsafe { self.group.stage(s, 0, r.len() * e) }).copy_from_slice(&x[r]);
            }
        };
        let (s, coll, records) = self.open(OP, record, local.map(drop), |s| {
            if rounds > 0 && !offered {
                stage(s, 0)
            }
        })?;
        let dev = cpu(t)?;
        let dims = t.dims();
        let block: usize = dims[dim..].iter().product();
        let mut out = dev.buffer_for_overwrite::<T>(n * len);
        let stream = streams(n * len * e);
        // Element `i` of rank `j`'s input lands in block `i / block` of the
        // output, after the `j` blocks of the ranks before it; `src` holds
        // the input's elements `r`.
        let place = |out: &mut [T], j: usize, src: &[T], r: Range<usize>| {
            let mut i = r.start;
            while i < r.end {
                let (o, w) = (i / block, i % block);
                let run = (block - w).min(r.end - i);
                let at = o * n * block + j * block + w;
                store(&src[i - r.start..i - r.start + run], &mut out[at..at + run], stream);
                i += run;
            }
        };
        let plan = Rounds { op: OP, s, coll, records: &records, offered, rounds };
        self.staged_or_in_place(
            plan,
            &mut out[..],
            stage,
            |out| {
                // SAFETY: the collective's last step follows, and every
                // member posts it after its last read.
                for (j, src) in unsafe { self.inputs_in_place(OP, x, &records) }?.into_iter().enumerate() {
                    place(out, j, src, 0..len);
                }
                Ok(())
            },
            |out, s, k| {
                let r = round(k);
                for j in 0..n {
                    let src: &[T] = match j == me {
                        true => &x[r.clone()],
                        // SAFETY: `j` posted step `s`; this member posts `s + 1`
                        // only after reading.
                        false => typed(unsafe { self.group.staged(j, s, 0, r.len() * e) }),
                    };
                    place(out, j, src, r.clone());
                }
            },
        )?;
        drop(guard);
        let mut out_dims = dims.to_vec();
        out_dims[dim] *= n;
        Ok(wrap(CpuStorage::from_buffer(out), out_dims, dev))
    }

    fn reduce_scatter_typed<T: Summand>(&self, t: &Tensor, dim: usize, local: Result<Tensor>, mut record: Record) -> Result<Tensor> {
        const OP: &str = "reduce_scatter_sum";
        let (n, me) = (self.n(), self.me());
        let e = std::mem::size_of::<T>();
        let c = local.as_ref().ok().cloned();
        let (outer, block) = match &c {
            Some(c) => (c.dims()[..dim].iter().product::<usize>(), c.dims()[dim..].iter().product::<usize>()),
            None => (0, 0),
        };
        let part = block / n;
        // Rank `j`'s part, gathered: element `g` is input element
        // `(g / part) · block + j · part + g mod part`. Each round stages a
        // slice of it for every peer, in an area of its own.
        let q = outer * part;
        let area = self.group.lay.half / n / e;
        let rounds = q.div_ceil(area);
        let round = |k: usize| k * area..((k + 1) * area).min(q);
        let guard = c.as_ref().map(|c| c.read());
        let x: &[T] = match (&c, &guard) {
            (Some(c), Some(g)) => elements::<T>(c, g),
            _ => &[],
        };
        // In place when every member's input lies in its arena: each sums
        // its part of the others' where they are.
        let offered = local.is_ok() && n > 1 && self.offer(x).map(|input| record.place = Some(Place { input, result: 0 })).is_some();
        // Calls `f(g, input range)` for the runs of gathered elements `r` of
        // rank `j`'s part that are contiguous in the input.
        let runs = |j: usize, r: Range<usize>, f: &mut dyn FnMut(usize, Range<usize>)| {
            let mut g = r.start;
            while g < r.end {
                let (o, w) = (g / part, g % part);
                let run = (part - w).min(r.end - g);
                let at = o * block + j * part + w;
                f(g, at..at + run);
                g += run;
            }
        };
        let stage = |s: u64, k: usize| {
            let r = round(k);
            for j in (0..n).filter(|&j| j != me) {
                // SAFETY: before posting step `s`, after every peer posted `s - 1`.
                let dst: &mut [T] = typed_mut(unsafe { self.group.stage(s, j * area * e, r.len() * e) });
                runs(j, r.clone(), &mut |g, src| dst[g - r.start..g - r.start + src.len()].copy_from_slice(&x[src]));
            }
        };
        let (s, coll, records) = self.open(OP, record, local.map(drop), |s| {
            if rounds > 0 && !offered {
                stage(s, 0)
            }
        })?;
        let dev = cpu(t)?;
        let mut out = dev.buffer_for_overwrite::<T>(q);
        let stream = streams(q * e);
        let sum = |srcs: &[&[T]], dst: &mut [T]| {
            if stream {
                sum_blocks(srcs, |off, block| store(block, &mut dst[off..off + block.len()], true));
            } else {
                sum_into(srcs, dst);
            }
        };
        let plan = Rounds { op: OP, s, coll, records: &records, offered, rounds };
        self.staged_or_in_place(
            plan,
            &mut out[..],
            stage,
            |out| {
                // SAFETY: the collective's last step follows, and every
                // member posts it after its last read.
                let inputs = unsafe { self.inputs_in_place(OP, x, &records) }?;
                runs(me, 0..q, &mut |g, own| {
                    let srcs: Vec<&[T]> = inputs.iter().map(|i| &i[own.clone()]).collect();
                    sum(&srcs, &mut out[g..g + own.len()]);
                });
                Ok(())
            },
            |out, s, k| {
                let r = round(k);
                runs(me, r.clone(), &mut |g, own| {
                    let srcs: Vec<&[T]> = (0..n)
                        .map(|i| match i == me {
                            true => &x[own.clone()],
                            // SAFETY: `i` posted step `s`; this member posts
                            // `s + 1` only after reading.
                            false => typed(unsafe { self.group.staged(i, s, (me * area + g - r.start) * e, own.len() * e) }),
                        })
                        .collect();
                    sum(&srcs, &mut out[g..g + own.len()]);
                });
            },
        )?;
        drop(guard);
        let mut out_dims = t.dims().to_vec();
        out_dims[dim] /= n;
        Ok(wrap(CpuStorage::from_buffer(out), out_dims, dev))
    }

    fn broadcast_typed<T: Element + Default>(&self, t: &Tensor, root: usize, local: Result<Tensor>, record: Record) -> Result<Tensor> {
        const OP: &str = "broadcast";
        let me = self.me();
        let e = std::mem::size_of::<T>();
        let len = t.elem_count();
        let per = self.group.lay.half / e;
        let rounds = len.div_ceil(per);
        let round = |k: usize| k * per..((k + 1) * per).min(len);
        let c = local.as_ref().ok().cloned();
        let guard = c.as_ref().map(|c| c.read());
        let x: &[T] = match (&c, &guard) {
            (Some(c), Some(g)) => elements::<T>(c, g),
            _ => &[],
        };
        let stage = |s: u64, k: usize| {
            if me == root && self.n() > 1 {
                let r = round(k);
                // SAFETY: before posting step `s`, after every peer posted `s - 1`.
                typed_mut::<T>(unsafe { self.group.stage(s, 0, r.len() * e) }).copy_from_slice(&x[r]);
            }
        };
        let (mut s, coll, _) = self.open(OP, record, local.map(drop), |s| {
            if rounds > 0 {
                stage(s, 0)
            }
        })?;
        let dev = cpu(t)?;
        let mut out = (me != root).then(|| dev.buffer_for_overwrite::<T>(len));
        let stream = streams(len * e);
        for k in 0..rounds {
            if k > 0 {
                s = self.next();
                stage(s, k);
                self.step(OP, s, coll, k)?;
            }
            if let Some(out) = &mut out {
                let r = round(k);
                // SAFETY: the root posted step `s`; this member posts `s + 1`
                // only after reading.
                let src: &[T] = typed(unsafe { self.group.staged(root, s, 0, r.len() * e) });
                store(src, &mut out[r], stream);
            }
        }
        drop(guard);
        Ok(match out {
            Some(out) => wrap(CpuStorage::from_buffer(out), t.shape().clone(), dev),
            None => t.clone(),
        })
    }
}

impl HostCore for ShmCore {
    const NAME: &'static str = "ShmComm";

    fn world_rank(&self) -> usize {
        self.group.ranks[self.group.me]
    }

    fn group_ranks(&self) -> &[usize] {
        &self.group.ranks
    }

    fn group_rank(&self) -> usize {
        self.group.me
    }

    fn fail(&self, reason: String) {
        self.group.node.fail(self.world_rank(), reason);
    }

    fn failure(&self) -> Option<Error> {
        self.group.node.failure()
    }

    fn close(&self) {
        self.group.drain();
        self.group.node.before_leaving();
        self.group.leave();
    }

    fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_reduce_sum";
        let local = host(OP, t);
        let record = Self::record(Op::AllReduce, Some(t), &local);
        with_elem!(t.dtype(), T => self.all_reduce_typed::<T>(t, local, record))
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let local = t.shape().dim(OP, dim).and_then(|_| host(OP, t));
        let record = Self::record(Op::AllGather { dim }, Some(t), &local);
        with_elem!(t.dtype(), T => self.all_gather_typed::<T>(t, dim, local, record))
    }

    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "reduce_scatter_sum";
        let n = self.n();
        let local = check_split(OP, t, dim, n).and_then(|_| host(OP, t));
        let record = Self::record(Op::ReduceScatter { dim }, Some(t), &local);
        with_elem!(t.dtype(), T => self.reduce_scatter_typed::<T>(t, dim, local, record))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        let local = self.check_root(OP, root).and_then(|_| host(OP, t));
        let record = Self::record(Op::Broadcast { root }, Some(t), &local);
        with_elem!(t.dtype(), T => self.broadcast_typed::<T>(t, root, local, record))
    }

    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        const OP: &str = "all_to_all";
        let (n, me) = (self.n(), self.me());
        let local = self.check_parts(OP, &parts).and_then(|_| parts.iter().map(|p| host(OP, p)).collect::<Result<Vec<_>>>());
        let mut record = Self::record(Op::AllToAll, None, &local);
        let (ps, own) = match local {
            Ok(ps) => {
                record.parts = ps.iter().map(meta).collect();
                (ps, Ok(()))
            }
            Err(e) => (Vec::new(), Err(e)),
        };
        // Each round stages up to `area` bytes of the part for every peer.
        let area = self.group.lay.half / n / 64 * 64;
        let guards: Vec<_> = ps.iter().map(Tensor::read).collect();
        let bytes_of: Vec<&[u8]> =
            ps.iter().zip(&guards).map(|(p, g)| with_elem!(p.dtype(), T => bytemuck::cast_slice::<T, u8>(elements::<T>(p, g)))).collect();
        let stage = |s: u64, k: usize| {
            for j in (0..n).filter(|&j| j != me) {
                let src = bytes_of[j];
                let r = (k * area).min(src.len())..((k + 1) * area).min(src.len());
                // SAFETY: before posting step `s`, after every peer posted `s - 1`.
                unsafe { self.group.stage(s, j * area, r.len()) }.copy_from_slice(&src[r]);
            }
        };
        let (mut s, coll, records) = self.open(OP, record, own, |s| stage(s, 0))?;
        let size = |m: &Meta| m.1.iter().product::<usize>() * m.0.size_in_bytes();
        let rounds =
            (0..n).flat_map(|i| records[i].parts.iter().enumerate().filter(move |(j, _)| *j != i).map(|(_, p)| size(p).div_ceil(area))).max().unwrap_or(0);
        let mut received: Vec<Option<CpuStorage>> = (0..n)
            .map(|i| {
                let (dtype, dims) = &records[i].parts[me];
                (i != me).then(|| with_elem!(*dtype, T => CpuStorage::from_buffer(self.device.buffer_for_overwrite::<T>(dims.iter().product()))))
            })
            .collect();
        for k in 0..rounds.max(1) {
            if k > 0 {
                s = self.next();
                stage(s, k);
                self.step(OP, s, coll, k)?;
            }
            for (i, got) in received.iter_mut().enumerate() {
                let Some(got) = got else { continue };
                let dst: &mut [u8] = with_elem!(got.dtype(), T => bytemuck::cast_slice_mut::<T, u8>(got.as_mut_slice::<T>().expect("its own dtype")));
                let r = (k * area).min(dst.len())..((k + 1) * area).min(dst.len());
                // SAFETY: `i` posted step `s`; this member posts `s + 1`
                // only after reading.
                dst[r.clone()].copy_from_slice(unsafe { self.group.staged(i, s, me * area, r.len()) });
            }
        }
        drop(bytes_of);
        drop(guards);
        Ok(received
            .into_iter()
            .enumerate()
            .map(|(i, got)| match got {
                Some(st) => Tensor::from_cpu(st, records[i].parts[me].1.clone(), &self.device),
                None => parts[me].clone(),
            })
            .collect())
    }

    fn barrier(&self) -> Result<()> {
        let record = Record { call: Call::bare(Op::Barrier), invalid: None, parts: Vec::new(), place: None };
        self.open("barrier", record, Ok(()), |_| {}).map(drop)
    }

    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        self.check_peer("send", peer)?;
        if let Some(e) = self.group.node.failure() {
            return Err(e);
        }
        if self.group.has_left(peer) {
            if let Some(e) = self.group.node.failure() {
                return Err(e);
            }
            return Err(Error::PeerFailed {
                rank: self.group.ranks[peer],
                reason: "it left the job (its process finished or closed its communicators) while this rank still needed it".into(),
            });
        }
        let t = host("send", t)?;
        self.group.send(peer, &t, self.files.fetch_add(1, Ordering::Relaxed))
    }

    fn recv(&self, peer: usize) -> Result<Tensor> {
        self.check_peer("recv", peer)?;
        self.group.recv(peer, &self.device)
    }
}
