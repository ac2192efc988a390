//! The in-process collectives: one rank's side of each, on the group's board
//! (see the module above for the algorithms).

use super::landing::Landing;
use super::state::{GroupState, Payload, Post, World};
use crate::call::{meta, Call, Op};
use crate::host::{check_split, chunk, concat, cpu_device, elements, reduce, streams, sum_blocks, wrap, Summand};
use crate::host_comm::HostCore;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tessera_core::tensor::{with_elem, Tensor};
use tessera_core::{Device, Error, Result};

/// What an in-process communicator's calls run on, shared with its
/// background thread.
pub struct Core {
    world: Arc<World>,
    group: Arc<GroupState>,
    /// This rank's index in the group.
    me: usize,
    device: Device,
    /// The number of this rank's next collective step on the group's board.
    step: AtomicU64,
}

/// `p` if it holds host tensors only: the in-process communicator moves host
/// memory, so every collective rejects CUDA tensors at its first step (which
/// is what lets `data` assume CPU storage).
fn host_only(op: &'static str, p: Payload) -> Result<Payload> {
    let tensors: &[Tensor] = match &p {
        Payload::One(t) | Payload::Reduce(t, _) => std::slice::from_ref(t),
        Payload::Many(ts) => ts,
        Payload::None => &[],
    };
    for t in tensors {
        if let Device::Cuda(d) = t.device() {
            return d.unsupported(op);
        }
    }
    Ok(p)
}

/// Sums elements `mine` of every rank's input, in rank order, and writes
/// each block of the sum into every rank's result while it is in cache.
fn reduce_into_landings<T: Summand>(posts: &[Arc<Post>], mine: Range<usize>) {
    let guards: Vec<_> = posts.iter().map(|p| p.one().read()).collect();
    let srcs: Vec<&[T]> = guards.iter().zip(posts).map(|(g, p)| &elements::<T>(p.one(), g)[mine.clone()]).collect();
    let outs: Vec<&Landing> = posts.iter().map(|p| p.landing()).collect();
    let stream = streams(std::mem::size_of_val(srcs[0]) * posts.len());
    sum_blocks(&srcs, |at, block| {
        for o in &outs {
            o.write(mine.start + at, block, stream);
        }
    });
}

impl Post {
    fn one(&self) -> &Tensor {
        match &self.data {
            Payload::One(t) | Payload::Reduce(t, _) => t,
            _ => unreachable!("the first step checked every rank posted a tensor"),
        }
    }

    fn landing(&self) -> &Landing {
        match &self.data {
            Payload::Reduce(_, out) => out,
            _ => unreachable!("the first step checked every rank posted its all-reduce result"),
        }
    }
}

impl Core {
    pub(super) fn new(world: Arc<World>, group: Arc<GroupState>, me: usize, device: Device) -> Core {
        Core { world, group, me, device, step: AtomicU64::new(0) }
    }

    /// The device received messages are allocated on.
    pub(super) fn device(&self) -> &Device {
        &self.device
    }

    fn size(&self) -> usize {
        self.group.size()
    }

    /// One step on the group's board.
    fn exchange(&self, op: &'static str, post: Post) -> Result<Vec<Arc<Post>>> {
        let step = self.step.fetch_add(1, Ordering::Relaxed);
        self.group.exchange(&self.world, op, self.me, step, post)
    }

    /// The last step of a collective that read this rank's input: returns
    /// once every peer has finished reading it.
    fn release(&self, op: &'static str) -> Result<()> {
        self.exchange(op, Post::phase(Payload::None)).map(drop)
    }

    /// The first step of every collective: posts this rank's call, whether
    /// its own arguments are valid (`local`), and checks that every rank made
    /// the same call with agreeing arguments. Every rank reaches the same
    /// verdict, since all see the same posts.
    fn open(&self, op: &'static str, call_op: Op, t: Option<&Tensor>, local: Result<Payload>) -> Result<Vec<Arc<Post>>> {
        let local = local.and_then(|p| host_only(op, p));
        let call = Call { op: call_op, meta: t.map(meta) };
        let (data, invalid, own_error) = match local {
            Ok(d) => (d, None, None),
            Err(e) => (Payload::None, Some(e.to_string()), Some(e)),
        };
        let posts = self.exchange(op, Post { call: Some(call), invalid, data })?;
        let ranks = &self.group.ranks;
        let first = &posts[0];
        let op_of = |p: &Post| p.call.as_ref().map(|c| c.op);
        if let Some((i, p)) = posts.iter().enumerate().find(|(_, p)| op_of(p) != op_of(first)) {
            return Err(Error::CollectiveMismatch { op, detail: format!("rank {} called {first} while rank {} called {p}", ranks[0], ranks[i]) });
        }
        if let Some(e) = own_error {
            return Err(e);
        }
        if let Some((i, p)) = posts.iter().enumerate().find(|(_, p)| p.invalid.is_some()) {
            let why = p.invalid.as_deref().unwrap_or_default();
            return Err(Error::CollectiveMismatch { op, detail: format!("rank {} passed invalid arguments ({why})", ranks[i]) });
        }
        if t.is_some() {
            if let Some((i, p)) = posts.iter().enumerate().find(|(_, p)| p.call != first.call) {
                return Err(Error::CollectiveMismatch { op, detail: format!("rank {} called {first} but rank {} called {p}", ranks[0], ranks[i]) });
            }
        }
        Ok(posts)
    }
}

impl HostCore for Core {
    const NAME: &'static str = "InProcessComm";

    fn world_rank(&self) -> usize {
        self.group.ranks[self.me]
    }

    fn group_ranks(&self) -> &[usize] {
        &self.group.ranks
    }

    fn group_rank(&self) -> usize {
        self.me
    }

    fn fail(&self, reason: String) {
        self.world.fail(self.world_rank(), reason);
    }

    fn failure(&self) -> Option<Error> {
        self.world.failure().map(|f| f.error())
    }

    fn close(&self) {
        self.group.depart(self.me, format!("its communicator for group {:?} was dropped while the other ranks still needed it", self.group.ranks));
    }

    fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_reduce_sum";
        // Every rank allocates its result first and shows it to the others
        // with its input (see `landing`): rank `r` sums chunk `r` of every
        // input and writes it into every rank's result, so each rank reads
        // its share of the inputs once and writes `S` bytes in all.
        let local = t.contiguous().and_then(|c| host_only(OP, Payload::One(c)));
        let out = match &local {
            Ok(Payload::One(c)) => Some(Arc::new(Landing::new(cpu_device(c.device()), c.dtype(), c.elem_count()))),
            _ => None,
        };
        let local = local.map(|p| match (p, &out) {
            (Payload::One(c), Some(o)) => Payload::Reduce(c, o.clone()),
            (p, _) => p,
        });
        let posts = self.open(OP, Op::AllReduce, Some(t), local)?;
        let mine = chunk(t.elem_count(), self.size(), self.me);
        with_elem!(t.dtype(), T => reduce_into_landings::<T>(&posts, mine));
        drop(posts);
        // Reaching this step means every rank has written its chunk into
        // every result and finished reading every input.
        self.release(OP)?;
        let out = out.expect("the first step checked this rank's input");
        let storage = Landing::finish(out)
            .map_err(|_| Error::state_mismatch(OP, "a peer still held this rank's result after the last step (a bug in the in-process communicator)"))?;
        Ok(wrap(storage, t.shape().clone(), cpu_device(t.device())))
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let local = t.shape().dim(OP, dim).and_then(|_| t.contiguous()).map(Payload::One);
        let posts = self.open(OP, Op::AllGather { dim }, Some(t), local)?;
        let dev = cpu_device(t.device());
        let dims = t.dims();
        let outer: usize = dims[..dim].iter().product();
        let block: usize = dims[dim..].iter().product();
        let pieces: Vec<(&Tensor, Range<usize>)> = (0..outer).flat_map(|o| posts.iter().map(move |p| (p.one(), o * block..(o + 1) * block))).collect();
        let mut out_dims = dims.to_vec();
        out_dims[dim] *= self.size();
        let out = wrap(concat(dev, t.dtype(), &pieces), out_dims, dev);
        drop(pieces);
        drop(posts);
        self.release(OP)?;
        Ok(out)
    }

    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "reduce_scatter_sum";
        let n = self.size();
        let local = check_split(OP, t, dim, n).and_then(|_| t.contiguous()).map(Payload::One);
        let posts = self.open(OP, Op::ReduceScatter { dim }, Some(t), local)?;
        let dev = cpu_device(t.device());
        let dims = t.dims();
        let outer: usize = dims[..dim].iter().product();
        let block: usize = dims[dim..].iter().product();
        let part = block / n;
        let segments: Vec<Range<usize>> = (0..outer).map(|o| o * block + self.me * part..o * block + (self.me + 1) * part).collect();
        let inputs: Vec<(&Tensor, usize)> = posts.iter().map(|p| (p.one(), 0)).collect();
        let mut out_dims = dims.to_vec();
        out_dims[dim] /= n;
        let out = wrap(reduce(dev, t.dtype(), &inputs, &segments), out_dims, dev);
        drop(inputs);
        drop(posts);
        self.release(OP)?;
        Ok(out)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        let local = if let Err(e) = self.check_root(OP, root) {
            Err(e)
        } else if root == self.me {
            t.contiguous().map(Payload::One)
        } else {
            Ok(Payload::None)
        };
        let posts = self.open(OP, Op::Broadcast { root }, Some(t), local)?;
        let out = if root == self.me {
            t.clone()
        } else {
            let dev = cpu_device(t.device());
            let src = posts[root].one();
            wrap(concat(dev, t.dtype(), &[(src, 0..src.elem_count())]), t.shape().clone(), dev)
        };
        drop(posts);
        self.release(OP)?;
        Ok(out)
    }

    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        const OP: &str = "all_to_all";
        let local = self.check_parts(OP, &parts).and_then(|_| parts.iter().map(Tensor::contiguous).collect::<Result<Vec<_>>>().map(Payload::Many));
        let posts = self.open(OP, Op::AllToAll, None, local)?;
        let mine = &parts[self.me];
        let dev = cpu_device(mine.device());
        let out = posts
            .iter()
            .enumerate()
            .map(|(j, p)| {
                if j == self.me {
                    return mine.clone();
                }
                let Payload::Many(theirs) = &p.data else { unreachable!("checked at the first step") };
                let src = &theirs[self.me];
                wrap(concat(dev, src.dtype(), &[(src, 0..src.elem_count())]), src.shape().clone(), dev)
            })
            .collect();
        drop(posts);
        self.release(OP)?;
        Ok(out)
    }

    fn barrier(&self) -> Result<()> {
        self.open("barrier", Op::Barrier, None, Ok(Payload::None)).map(drop)
    }

    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        self.check_peer("send", peer)?;
        if let Some(f) = self.world.failure() {
            return Err(f.error());
        }
        // Copied straight onto the receiver's device when it is known, so the
        // message is counted where it will live and needs no second copy.
        if let Device::Cuda(d) = t.device() {
            return d.unsupported("send");
        }
        let to = self.group.device_of(peer).unwrap_or_else(|| self.device.clone());
        let dev = cpu_device(&to);
        let src = t.contiguous()?;
        let msg = wrap(concat(dev, t.dtype(), &[(&src, 0..src.elem_count())]), t.shape().clone(), dev);
        self.group.post_message(&self.world, self.me, peer, msg)
    }

    fn recv(&self, peer: usize) -> Result<Tensor> {
        self.check_peer("recv", peer)?;
        let msg = self.group.take_message(&self.world, peer, self.me)?;
        if msg.device().same(&self.device) {
            return Ok(msg);
        }
        let dev = cpu_device(&self.device);
        Ok(wrap(concat(dev, msg.dtype(), &[(&msg, 0..msg.elem_count())]), msg.shape().clone(), dev))
    }
}
