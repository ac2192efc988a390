//! One rank's communicator in a group of processes, and the collectives as
//! exchanges of messages.
//!
//! Every collective starts with one exchange in which each rank sends a
//! message to every other and receives one from every other, in rank order.
//! Each message names the call (the collective, its arguments, the caller's
//! dtype and shape, its number in the group) and carries what the receiver
//! needs of the sender's data, so every rank sees every other rank's call and
//! all of them detect a mismatch, after draining the exchange (the group
//! stays usable). The algorithms are the in-process communicator's, so the
//! two give the same bits:
//!
//! - **all-reduce**: rank `r` receives chunk `r` of every input, sums them in
//!   rank order (in `f32`, `f64` for `f64`, rounding once) and sends the
//!   summed chunk to every rank, which concatenates the chunks. Each rank
//!   sends and receives `2·(n−1)/n·N` elements, as in a ring, in two rounds
//!   instead of `2(n−1)`.
//! - **reduce-scatter** is the first round alone, **all-gather** sends the
//!   whole input to every rank, **broadcast** sends the root's tensor, and
//!   **all-to-all** sends each rank its part.

use super::link::{Links, Message};
use super::wire::{Channel, Header};
use crate::call::{Call, Meta, Op};
use crate::host::{check_split, chunk, concat, host_device, reduce, wrap};
use crate::host_comm::HostCore;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tessera_core::backend::CpuDevice;
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};

/// What a TCP communicator's calls run on, shared with its background
/// thread.
pub struct TcpCore {
    links: Arc<Links>,
    /// The group's identity on the wire.
    group: u64,
    /// The members' world ranks, in group-rank order.
    ranks: Vec<usize>,
    /// This rank's index in the group.
    me: usize,
    /// The number of this rank's next collective in the group.
    step: AtomicU64,
}

impl TcpCore {
    pub(super) fn new(links: Arc<Links>, group: u64, ranks: Vec<usize>) -> Self {
        let me = ranks.iter().position(|&r| r == links.me()).expect("the caller checked membership");
        TcpCore { links, group, ranks, me, step: AtomicU64::new(0) }
    }
}

/// What a rank sends to one peer in an exchange: elements of its tensors,
/// and the shape the receiver gives them.
struct Outgoing<'a> {
    pieces: Vec<(&'a Tensor, Range<usize>)>,
    payload: Option<Meta>,
}

impl<'a> Outgoing<'a> {
    fn nothing() -> Self {
        Outgoing { pieces: Vec::new(), payload: None }
    }

    /// The elements `range` of `t`, received as a vector.
    fn elements(t: &'a Tensor, range: Range<usize>) -> Self {
        let payload = Some((t.dtype(), vec![range.len()]));
        Outgoing { pieces: vec![(t, range)], payload }
    }

    /// All of `t`, received with its shape.
    fn whole(t: &'a Tensor) -> Self {
        Outgoing { pieces: vec![(t, 0..t.elem_count())], payload: Some((t.dtype(), t.dims().to_vec())) }
    }
}

fn cpu(t: &Tensor) -> Result<&CpuDevice> {
    host_device(t, "collectives between processes over TCP (CUDA ranks communicate through NCCL)")
}

/// `t`, if it is a host tensor.
fn host(t: Tensor) -> Result<Tensor> {
    cpu(&t)?;
    Ok(t)
}

impl TcpCore {
    fn size(&self) -> usize {
        self.ranks.len()
    }

    /// One exchange (number `phase` of the collective): sends `outgoing(j)`
    /// to every peer `j` under `call`, then receives every peer's message,
    /// and checks that all made the same call with valid arguments. `local`
    /// is this rank's own verdict on its arguments. Returns the messages by
    /// group rank (`None` for this rank).
    fn exchange<'a>(&self, call: &Call, phase: u8, local: Result<()>, outgoing: impl Fn(usize) -> Outgoing<'a>) -> Result<Vec<Option<Message>>> {
        let op = call.op.name();
        let step = if phase == 0 { self.step.fetch_add(1, Ordering::Relaxed) } else { self.step.load(Ordering::Relaxed) - 1 };
        let mut header = Header::message(self.group, Channel::Collective, call.clone(), phase, step);
        if let Err(e) = &local {
            header.text = e.to_string();
        }
        for j in (0..self.size()).filter(|&j| j != self.me) {
            let out = if local.is_ok() { outgoing(j) } else { Outgoing::nothing() };
            header.payload = out.payload.clone();
            self.links.send(self.ranks[j], &header, &out.pieces)?;
        }
        let mut got = Vec::with_capacity(self.size());
        for j in 0..self.size() {
            got.push(if j == self.me { None } else { Some(self.links.receive(self.group, Channel::Collective, self.ranks[j], op)?) });
        }
        let me = self.ranks[self.me];
        for (j, m) in got.iter().enumerate() {
            let Some(m) = m else { continue };
            let theirs = &m.header;
            let them = self.ranks[j];
            if theirs.call.op != call.op || theirs.phase != phase {
                return Err(Error::CollectiveMismatch { op, detail: format!("rank {me} called {call} while rank {them} called {}", theirs.call) });
            }
            if theirs.step != step {
                return Err(Error::CollectiveMismatch {
                    op,
                    detail: format!(
                        "rank {me} is at collective #{step} of this group but rank {them} at #{}: a rank skipped or added a collective",
                        theirs.step
                    ),
                });
            }
        }
        local?;
        if let Some((j, m)) = got.iter().enumerate().find_map(|(j, m)| m.as_ref().filter(|m| !m.header.text.is_empty()).map(|m| (j, m))) {
            return Err(Error::CollectiveMismatch { op, detail: format!("rank {} passed invalid arguments ({})", self.ranks[j], m.header.text) });
        }
        if let Some((j, m)) = got.iter().enumerate().find_map(|(j, m)| m.as_ref().filter(|m| m.header.call.meta != call.meta).map(|m| (j, m))) {
            return Err(Error::CollectiveMismatch { op, detail: format!("rank {me} called {call} but rank {} called {}", self.ranks[j], m.header.call) });
        }
        Ok(got)
    }
}

impl HostCore for TcpCore {
    const NAME: &'static str = "TcpComm";

    fn world_rank(&self) -> usize {
        self.links.me()
    }

    fn group_ranks(&self) -> &[usize] {
        &self.ranks
    }

    fn group_rank(&self) -> usize {
        self.me
    }

    fn fail(&self, reason: String) {
        self.links.fail(self.links.me(), reason);
    }

    fn failure(&self) -> Option<Error> {
        self.links.failure()
    }

    fn close(&self) {}

    fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        let n = self.size();
        let call = Call::on(Op::AllReduce, t);
        let local = t.contiguous().and_then(host);
        let tc = local.as_ref().ok().cloned();
        let len = t.elem_count();
        let got = self.exchange(&call, 0, local.map(drop), |j| Outgoing::elements(tc.as_ref().expect("valid"), chunk(len, n, j)))?;
        let t = tc.expect("the exchange checked it");
        let dev = cpu(&t)?;
        let mine = chunk(len, n, self.me);
        let sources: Vec<(&Tensor, usize)> = got.iter().map(|m| m.as_ref().map_or((&t, mine.start), |m| (m.tensor.as_ref().expect("a chunk"), 0))).collect();
        let summed = wrap(reduce(dev, t.dtype(), &sources, std::slice::from_ref(&(0..mine.len()))), [mine.len()], dev);
        drop(sources);
        drop(got);
        let got = self.exchange(&call, 1, Ok(()), |_| Outgoing::whole(&summed))?;
        let pieces: Vec<(&Tensor, Range<usize>)> = got
            .iter()
            .map(|m| {
                let c = m.as_ref().map_or(&summed, |m| m.tensor.as_ref().expect("a summed chunk"));
                (c, 0..c.elem_count())
            })
            .collect();
        Ok(wrap(concat(dev, t.dtype(), &pieces), t.shape().clone(), dev))
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let call = Call::on(Op::AllGather { dim }, t);
        let local = t.shape().dim("all_gather", dim).and_then(|_| t.contiguous()).and_then(host);
        let tc = local.as_ref().ok().cloned();
        let got = self.exchange(&call, 0, local.map(drop), |_| Outgoing::whole(tc.as_ref().expect("valid")))?;
        let t = tc.expect("the exchange checked it");
        let dev = cpu(&t)?;
        let dims = t.dims();
        let outer: usize = dims[..dim].iter().product();
        let block: usize = dims[dim..].iter().product();
        let parts: Vec<&Tensor> = got.iter().map(|m| m.as_ref().map_or(&t, |m| m.tensor.as_ref().expect("a tensor"))).collect();
        let pieces: Vec<(&Tensor, Range<usize>)> = (0..outer).flat_map(|o| parts.iter().map(move |&p| (p, o * block..(o + 1) * block))).collect();
        let mut out_dims = dims.to_vec();
        out_dims[dim] *= self.size();
        Ok(wrap(concat(dev, t.dtype(), &pieces), out_dims, dev))
    }

    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "reduce_scatter_sum";
        let n = self.size();
        let call = Call::on(Op::ReduceScatter { dim }, t);
        let local = check_split(OP, t, dim, n).and_then(|_| t.contiguous()).and_then(host);
        let tc = local.as_ref().ok().cloned();
        let (outer, block) = match &tc {
            Some(t) => (t.dims()[..dim].iter().product::<usize>(), t.dims()[dim..].iter().product::<usize>()),
            None => (0, 0),
        };
        let part = block / n;
        // Part `j` of every outer block, in order: what rank `j` sums.
        let segments = |j: usize| -> Vec<Range<usize>> { (0..outer).map(|o| o * block + j * part..o * block + (j + 1) * part).collect() };
        let got = self.exchange(&call, 0, local.map(drop), |j| {
            let t = tc.as_ref().expect("valid");
            Outgoing { pieces: segments(j).into_iter().map(|r| (t, r)).collect(), payload: Some((t.dtype(), vec![outer * part])) }
        })?;
        let t = tc.expect("the exchange checked it");
        let dev = cpu(&t)?;
        // This rank's own part, gathered the way its peers' arrived.
        let own = wrap(concat(dev, t.dtype(), &segments(self.me).into_iter().map(|r| (&t, r)).collect::<Vec<_>>()), [outer * part], dev);
        let sources: Vec<(&Tensor, usize)> = got.iter().map(|m| (m.as_ref().map_or(&own, |m| m.tensor.as_ref().expect("a part")), 0)).collect();
        let mut out_dims = t.dims().to_vec();
        out_dims[dim] /= n;
        Ok(wrap(reduce(dev, t.dtype(), &sources, std::slice::from_ref(&(0..outer * part))), out_dims, dev))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let call = Call::on(Op::Broadcast { root }, t);
        let local = self.check_root("broadcast", root).and_then(|_| t.contiguous()).and_then(host);
        let tc = local.as_ref().ok().cloned();
        let me = self.me;
        let mut got =
            self.exchange(&call, 0, local.map(drop), |_| if me == root { Outgoing::whole(tc.as_ref().expect("valid")) } else { Outgoing::nothing() })?;
        if me == root {
            return Ok(t.clone());
        }
        got[root]
            .take()
            .and_then(|m| m.tensor)
            .ok_or_else(|| Error::CollectiveMismatch { op: "broadcast", detail: format!("the root, rank {}, sent no tensor", self.ranks[root]) })
    }

    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let call = Call::bare(Op::AllToAll);
        let local = self.check_parts("all_to_all", &parts).and_then(|_| parts.iter().map(|p| p.contiguous().and_then(host)).collect::<Result<Vec<_>>>());
        let contiguous = local.as_ref().ok().cloned();
        let got = self.exchange(&call, 0, local.map(drop), |j| Outgoing::whole(&contiguous.as_ref().expect("valid")[j]))?;
        let mine = &parts[self.me];
        Ok(got.into_iter().map(|m| m.map_or_else(|| mine.clone(), |m| m.tensor.expect("every part is sent"))).collect())
    }

    fn barrier(&self) -> Result<()> {
        self.exchange(&Call::bare(Op::Barrier), 0, Ok(()), |_| Outgoing::nothing()).map(drop)
    }

    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        self.check_peer("send", peer)?;
        let t = t.contiguous()?;
        cpu(&t)?;
        let mut header = Header::message(self.group, Channel::PointToPoint, Call::bare(Op::Send), 0, 0);
        let out = Outgoing::whole(&t);
        header.payload = out.payload;
        self.links.send(self.ranks[peer], &header, &out.pieces)
    }

    fn recv(&self, peer: usize) -> Result<Tensor> {
        self.check_peer("recv", peer)?;
        let m = self.links.receive(self.group, Channel::PointToPoint, self.ranks[peer], "recv")?;
        m.tensor.ok_or_else(|| Error::CollectiveMismatch { op: "recv", detail: format!("rank {} sent a message without a tensor", self.ranks[peer]) })
    }
}
