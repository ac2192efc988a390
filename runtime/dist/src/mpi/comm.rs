//! One rank's communicator in a group of an MPI job, and the collectives as
//! MPI calls.
//!
//! Each collective checks its own arguments, compares every rank's call
//! (unless verification is off; see the module above), then moves the data
//! with one MPI collective, or two for the exact all-reduce:
//!
//! - **all-reduce**: `MPI_Allreduce` (native), or `MPI_Alltoallv` of the
//!   chunks, the in-process sum of chunk `r` on rank `r`, and
//!   `MPI_Allgatherv` of the sums (exact);
//! - **reduce-scatter**: the input rearranged so that each rank's part is
//!   contiguous (only when `dim` is not the outermost), then
//!   `MPI_Reduce_scatter_block` (native) or `MPI_Alltoall` and the
//!   in-process sum (exact);
//! - **all-gather**: `MPI_Allgather`, then the blocks interleaved along
//!   `dim` when it is not the outermost;
//! - **broadcast**: `MPI_Bcast`;
//! - **all-to-all**: `MPI_Alltoall` of the parts' shapes, then a
//!   non-blocking send and receive per peer straight between the parts'
//!   own buffers;
//! - **send**: the tensor copied (the caller may change it at once), and
//!   its shape and elements sent as two `MPI_Isend`s that complete in the
//!   background; **recv** receives the shape, then the elements into the
//!   new tensor.

use super::call::{check_dims, decode_shape, encode_shape, Call, Op, Record, CALL_WORDS, SHAPE_WORDS};
use super::watchdog::Watched;
use super::wire::{self, bits, bits_mut, Bits, BitsMut, Comm, Request, Summand};
use super::{abort_job, Reduction, Shared};
use crate::call::{meta, Meta};
use crate::host::{check_split, chunk, concat, cpu_device, host_device, reduce, wrap};
use crate::host_comm::{HostComm, HostCore};
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::AsRaw;
use parking_lot::Mutex;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tessera_core::backend::{CpuDevice, CpuStorage, Storage};
use tessera_core::tensor::{with_elem, DType, Tensor};
use tessera_core::{Error, Result};
use tessera_kernels::cpu::cast;

/// Message tags on a group's communicator: a message's shape, its elements,
/// and the elements of an all-to-all part.
const TAG_SHAPE: i32 = 1;
const TAG_DATA: i32 = 2;
const TAG_ALL_TO_ALL: i32 = 3;

/// One rank's communicator for a group of an MPI job.
///
/// Synchronous calls run on the calling thread, asynchronous ones in order on
/// a background thread (see [`HostComm`]). Dropping it waits until its peers
/// have received the messages it sent (bounded by the world's timeout), then
/// frees the MPI communicator; dropped while its thread panics, it aborts the
/// job. [`Communicator::abort`](crate::Communicator::abort) aborts the whole
/// job (`MPI_Abort`) and does not return, and
/// [`Communicator::failure`](crate::Communicator::failure) is always `None`:
/// a failure never returns here, it ends the job (see the module's
/// documentation of failures).
pub type MpiComm = HostComm<MpiCore>;

/// An MPI communicator handle that may be used from any thread.
struct Handle(SimpleCommunicator);

// SAFETY: the world runs at MPI_THREAD_MULTIPLE, where any thread may call
// MPI on any communicator; calls that must not overlap on one communicator
// (collectives) are serialized by `Serial`, and each point-to-point receive
// by a per-peer lock.
unsafe impl Send for Handle {}
// SAFETY: as for `Send`: the handle is only passed to MPI calls.
unsafe impl Sync for Handle {}

/// A message on its way: the two requests (shape, elements) and the
/// buffers they read from, kept until both complete.
struct Sent {
    requests: [Request; 2],
    _shape: Box<[u64; SHAPE_WORDS]>,
    _data: Tensor,
}

/// What a communicator's calls run on, shared with its background thread.
pub struct MpiCore {
    /// Declared first: freed (`MPI_Comm_free`) before `shared`, which may
    /// hold the last reference to the MPI library.
    comm: Handle,
    shared: Arc<Shared>,
    /// The members' world ranks, in group-rank order.
    ranks: Vec<usize>,
    /// This rank's index in the group.
    me: usize,
    /// The group as messages name it: its tag and members.
    name: Arc<str>,
    reduction: Reduction,
    /// Whether collectives compare the ranks' calls first.
    verify: bool,
    /// The number of this rank's next collective in the group.
    step: AtomicU64,
    /// Messages sent and not yet known to be received.
    sent: Mutex<Vec<Sent>>,
    /// Held while receiving from each peer: a message's shape and elements
    /// are two MPI messages, taken together.
    receiving: Vec<Mutex<()>>,
}

fn cpu(t: &Tensor) -> Result<&CpuDevice> {
    host_device(t, "collectives over MPI (CUDA ranks communicate through NCCL)")
}

/// `t`, if it is a host tensor with a shape the call records carry.
fn host(op: &'static str, t: Tensor) -> Result<Tensor> {
    cpu(&t)?;
    check_dims(op, t.dims())?;
    Ok(t)
}

/// Runs `f` on the storage of the contiguous host tensor `t` and the range
/// of it that `t` occupies.
fn with_storage<R>(t: &Tensor, f: impl FnOnce(&CpuStorage, Range<usize>) -> R) -> R {
    let range = t.layout().contiguous_range().expect("collectives move contiguous tensors");
    let guard = t.read();
    let Storage::Cpu(s) = &*guard else { unreachable!("checked to be a host tensor") };
    f(s, range)
}

/// Storage of `len` elements of `dtype` that MPI (or a kernel) writes
/// entirely: a buffer reused from the device's pool is not zeroed first.
fn for_overwrite(dev: &CpuDevice, dtype: DType, len: usize) -> CpuStorage {
    with_elem!(dtype, T => CpuStorage::from_buffer(dev.buffer_for_overwrite::<T>(len)))
}

/// The elements of a contiguous `bf16` or `f16` tensor, widened to `f32`.
fn widen(t: &Tensor, dev: &CpuDevice) -> tessera_core::backend::cpu::Buffer<f32> {
    let mut out = dev.buffer_for_overwrite::<f32>(t.elem_count());
    with_storage(t, |s, r| match t.dtype() {
        DType::BF16 => cast::bf16_to_f32(&s.as_slice().expect("bf16")[r], &mut out),
        DType::F16 => cast::f16_to_f32(&s.as_slice().expect("f16")[r], &mut out),
        other => unreachable!("only half precision is widened, not {other:?}"),
    });
    out
}

/// `acc` rounded once to `dtype` (`bf16` or `f16`), as a tensor of `dims`.
fn narrow(acc: &[f32], dtype: DType, dims: Vec<usize>, dev: &CpuDevice) -> Tensor {
    let storage = match dtype {
        DType::BF16 => {
            let mut out = dev.buffer_for_overwrite(acc.len());
            cast::f32_to_bf16(acc, &mut out);
            CpuStorage::from_buffer(out)
        }
        DType::F16 => {
            let mut out = dev.buffer_for_overwrite(acc.len());
            cast::f32_to_f16(acc, &mut out);
            CpuStorage::from_buffer(out)
        }
        other => unreachable!("only half precision is narrowed, not {other:?}"),
    };
    wrap(storage, dims, dev)
}

impl MpiCore {
    pub(super) fn new(shared: Arc<Shared>, comm: SimpleCommunicator, ranks: Vec<usize>, name: Arc<str>, reduction: Reduction, verify: bool) -> Self {
        let me = ranks.iter().position(|&r| r == shared.rank).expect("the caller checked membership");
        let receiving = ranks.iter().map(|_| Mutex::new(())).collect();
        MpiCore { comm: Handle(comm), shared, ranks, me, name, reduction, verify, step: AtomicU64::new(0), sent: Mutex::default(), receiving }
    }

    fn size(&self) -> usize {
        self.ranks.len()
    }

    fn raw(&self) -> Comm {
        self.comm.0.as_raw()
    }

    /// Registers a blocking call with the world's watchdog.
    fn watch(&self, op: &'static str) -> Option<Watched<'_>> {
        self.shared.watchdog.as_ref().map(|w| w.watch(op, &self.name))
    }

    /// Forgets the sent messages that have been received.
    fn progress_sends(&self) {
        let mut sent = self.sent.lock();
        sent.retain_mut(|s| !s.requests.iter_mut().all(Request::test));
    }

    /// The first step of every collective: compares this rank's call with
    /// every other's (when verification is on) and returns this rank's
    /// valid arguments, or the error every rank agrees on.
    fn open<T>(&self, call: Call, local: Result<T>) -> Result<T> {
        let step = self.step.fetch_add(1, Ordering::Relaxed);
        self.progress_sends();
        if !self.verify {
            return local;
        }
        let op = call.op.name();
        let n = self.size();
        let mine = Record { call: call.clone(), step, valid: local.is_ok() }.encode();
        let mut all = vec![0u64; CALL_WORDS * n];
        {
            let _w = self.watch(op);
            wire::all_gather(self.raw(), Bits::B64(&mine), BitsMut::B64(&mut all))?;
        }
        let me = self.ranks[self.me];
        let mut records = Vec::with_capacity(n);
        for (j, w) in all.chunks_exact(CALL_WORDS).enumerate() {
            let them = self.ranks[j];
            let r = Record::decode(w).ok_or_else(|| Error::CollectiveMismatch {
                op,
                detail: format!("rank {them} sent a call record that does not parse (a process of a different build?) while rank {me} called {call}"),
            })?;
            if r.call.op != call.op {
                return Err(Error::CollectiveMismatch { op, detail: format!("rank {me} called {call} while rank {them} called {}", r.call) });
            }
            if r.step != step {
                return Err(Error::CollectiveMismatch {
                    op,
                    detail: format!("rank {me} is at collective #{step} of this group but rank {them} at #{}: a rank skipped or added a collective", r.step),
                });
            }
            records.push(r);
        }
        let t = local?;
        if let Some(j) = records.iter().position(|r| !r.valid) {
            return Err(Error::CollectiveMismatch {
                op,
                detail: format!("rank {} passed invalid arguments to {} (its own error says why)", self.ranks[j], records[j].call),
            });
        }
        if let Some(j) = records.iter().position(|r| r.call.meta != call.meta) {
            return Err(Error::CollectiveMismatch { op, detail: format!("rank {me} called {call} but rank {} called {}", self.ranks[j], records[j].call) });
        }
        Ok(t)
    }

    fn native_all_reduce<T: Summand + Default>(&self, t: &Tensor, dev: &CpuDevice) -> Result<Tensor> {
        let mut out = dev.buffer_for_overwrite::<T>(t.elem_count());
        with_storage(t, |s, r| wire::all_reduce_sum(self.raw(), &s.as_slice::<T>().expect("the tensor's dtype")[r], &mut out))?;
        Ok(wrap(CpuStorage::from_buffer(out), t.shape().clone(), dev))
    }

    /// The in-process algorithm: rank `r` sums chunk `r` of every input in
    /// rank order, and every rank gathers the summed chunks.
    fn exact_all_reduce(&self, t: &Tensor, dev: &CpuDevice) -> Result<Tensor> {
        let (n, len, dtype) = (self.size(), t.elem_count(), t.dtype());
        let lens: Vec<usize> = (0..n).map(|j| chunk(len, n, j).len()).collect();
        let m = lens[self.me];
        let mut gathered = for_overwrite(dev, dtype, n * m);
        with_storage(t, |s, r| wire::all_to_all_v(self.raw(), bits(s, r), &lens, bits_mut(&mut gathered), &vec![m; n]))?;
        let gathered = wrap(gathered, [n * m], dev);
        let sources: Vec<(&Tensor, usize)> = (0..n).map(|i| (&gathered, i * m)).collect();
        let summed = wrap(reduce(dev, dtype, &sources, std::slice::from_ref(&(0..m))), [m], dev);
        let mut out = for_overwrite(dev, dtype, len);
        with_storage(&summed, |s, r| wire::all_gather_v(self.raw(), bits(s, r), bits_mut(&mut out), &lens))?;
        Ok(wrap(out, t.shape().clone(), dev))
    }

    fn native_reduce_scatter<T: Summand + Default>(&self, send: &Tensor, seg: usize, out_dims: Vec<usize>, dev: &CpuDevice) -> Result<Tensor> {
        let mut out = dev.buffer_for_overwrite::<T>(seg);
        with_storage(send, |s, r| wire::reduce_scatter_sum(self.raw(), self.size(), &s.as_slice::<T>().expect("the tensor's dtype")[r], &mut out))?;
        Ok(wrap(CpuStorage::from_buffer(out), out_dims, dev))
    }
}

impl HostCore for MpiCore {
    const NAME: &'static str = "MpiComm";

    fn world_rank(&self) -> usize {
        self.shared.rank
    }

    fn group_ranks(&self) -> &[usize] {
        &self.ranks
    }

    fn group_rank(&self) -> usize {
        self.me
    }

    /// Aborts the whole job (`MPI_Abort`); does not return.
    fn fail(&self, reason: String) {
        abort_job(&reason)
    }

    /// None: a failure never returns here, it ends the job.
    fn failure(&self) -> Option<Error> {
        None
    }

    /// Waits until the peers have received the messages this rank sent.
    fn close(&self) {
        let mut sent = self.sent.lock();
        let _w = self.watch("send (waiting for the peer to receive it)");
        for s in sent.iter_mut() {
            wire::wait_all(&mut s.requests);
        }
        sent.clear();
    }

    fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_reduce_sum";
        let call = Call::on(Op::AllReduce, t);
        let t = self.open(call, t.contiguous().and_then(|t| host(OP, t)))?;
        let dev = cpu(&t)?;
        let _w = self.watch(OP);
        match (self.reduction, t.dtype()) {
            (Reduction::Exact, _) => self.exact_all_reduce(&t, dev),
            (Reduction::Native, DType::F32) => self.native_all_reduce::<f32>(&t, dev),
            (Reduction::Native, DType::F64) => self.native_all_reduce::<f64>(&t, dev),
            (Reduction::Native, DType::I32) => self.native_all_reduce::<i32>(&t, dev),
            (Reduction::Native, DType::U32) => self.native_all_reduce::<u32>(&t, dev),
            (Reduction::Native, DType::BF16 | DType::F16) => {
                let wide = widen(&t, dev);
                let mut acc = dev.buffer_for_overwrite::<f32>(wide.len());
                wire::all_reduce_sum(self.raw(), &wide, &mut acc)?;
                Ok(narrow(&acc, t.dtype(), t.dims().to_vec(), dev))
            }
        }
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "all_gather";
        let call = Call::on(Op::AllGather { dim }, t);
        let t = self.open(call, t.shape().dim(OP, dim).and_then(|_| t.contiguous()).and_then(|t| host(OP, t)))?;
        let dev = cpu(&t)?;
        let (n, l) = (self.size(), t.elem_count());
        let dims = t.dims();
        let outer: usize = dims[..dim].iter().product();
        let block: usize = dims[dim..].iter().product();
        let mut out_dims = dims.to_vec();
        out_dims[dim] *= n;
        let mut gathered = for_overwrite(dev, t.dtype(), n * l);
        {
            let _w = self.watch(OP);
            with_storage(&t, |s, r| wire::all_gather(self.raw(), bits(s, r), bits_mut(&mut gathered)))?;
        }
        if outer == 1 {
            return Ok(wrap(gathered, out_dims, dev));
        }
        // MPI lays the inputs end to end; along an inner `dim` each outer
        // block takes one block of every rank in turn.
        let g = wrap(gathered, [n * l], dev);
        let pieces: Vec<(&Tensor, Range<usize>)> =
            (0..outer).flat_map(|o| (0..n).map(move |r| r * l + o * block..r * l + (o + 1) * block)).map(|r| (&g, r)).collect();
        Ok(wrap(concat(dev, t.dtype(), &pieces), out_dims, dev))
    }

    fn reduce_scatter(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "reduce_scatter_sum";
        let n = self.size();
        let call = Call::on(Op::ReduceScatter { dim }, t);
        let local = check_split(OP, t, dim, n).and_then(|_| t.contiguous()).and_then(|t| host(OP, t));
        let t = self.open(call, local)?;
        let dev = cpu(&t)?;
        let dtype = t.dtype();
        let outer: usize = t.dims()[..dim].iter().product();
        let block: usize = t.dims()[dim..].iter().product();
        let part = block / n;
        let seg = outer * part;
        let mut out_dims = t.dims().to_vec();
        out_dims[dim] /= n;
        // What goes to rank `j` (part `j` of every outer block), made
        // contiguous and laid out in rank order.
        let send = if outer == 1 {
            t.clone()
        } else {
            let pieces: Vec<(&Tensor, Range<usize>)> =
                (0..n).flat_map(|j| (0..outer).map(move |o| o * block + j * part..o * block + (j + 1) * part)).map(|r| (&t, r)).collect();
            wrap(concat(dev, dtype, &pieces), [n * seg], dev)
        };
        let _w = self.watch(OP);
        match (self.reduction, dtype) {
            (Reduction::Exact, _) => {
                let mut gathered = for_overwrite(dev, dtype, n * seg);
                with_storage(&send, |s, r| wire::all_to_all(self.raw(), n, bits(s, r), bits_mut(&mut gathered)))?;
                let gathered = wrap(gathered, [n * seg], dev);
                let sources: Vec<(&Tensor, usize)> = (0..n).map(|i| (&gathered, i * seg)).collect();
                Ok(wrap(reduce(dev, dtype, &sources, std::slice::from_ref(&(0..seg))), out_dims, dev))
            }
            (Reduction::Native, DType::F32) => self.native_reduce_scatter::<f32>(&send, seg, out_dims, dev),
            (Reduction::Native, DType::F64) => self.native_reduce_scatter::<f64>(&send, seg, out_dims, dev),
            (Reduction::Native, DType::I32) => self.native_reduce_scatter::<i32>(&send, seg, out_dims, dev),
            (Reduction::Native, DType::U32) => self.native_reduce_scatter::<u32>(&send, seg, out_dims, dev),
            (Reduction::Native, DType::BF16 | DType::F16) => {
                let wide = widen(&send, dev);
                let mut acc = dev.buffer_for_overwrite::<f32>(seg);
                wire::reduce_scatter_sum(self.raw(), n, &wide, &mut acc)?;
                Ok(narrow(&acc, dtype, out_dims, dev))
            }
        }
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        let call = Call::on(Op::Broadcast { root }, t);
        let local = if let Err(e) = self.check_root(OP, root) {
            Err(e)
        } else if root == self.me {
            t.contiguous().and_then(|t| host(OP, t))
        } else {
            // The non-roots' values are ignored: only where the result goes.
            host(OP, t.clone())
        };
        let local = self.open(call, local)?;
        let dev = cpu(&local)?;
        let _w = self.watch(OP);
        if root == self.me {
            with_storage(&local, |s, r| wire::broadcast_from(self.raw(), root, bits(s, r)))?;
            return Ok(t.clone());
        }
        let mut out = for_overwrite(dev, t.dtype(), t.elem_count());
        wire::broadcast_into(self.raw(), root, bits_mut(&mut out))?;
        Ok(wrap(out, t.shape().clone(), dev))
    }

    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        const OP: &str = "all_to_all";
        let n = self.size();
        let local = self.check_parts(OP, &parts).and_then(|_| parts.iter().map(|p| p.contiguous().and_then(|p| host(OP, p))).collect::<Result<Vec<_>>>());
        // The check looks at the call only: the parts' shapes may differ.
        let contiguous = self.open(Call::bare(Op::AllToAll), local)?;
        let dev = cpu_device(parts[self.me].device());
        let _w = self.watch(OP);
        // Every rank learns the shape of what each peer sends it.
        let mut shapes = vec![0u64; n * SHAPE_WORDS];
        for (j, p) in contiguous.iter().enumerate() {
            shapes[j * SHAPE_WORDS..(j + 1) * SHAPE_WORDS].copy_from_slice(&encode_shape(Some(&meta(p))));
        }
        let mut theirs = vec![0u64; n * SHAPE_WORDS];
        wire::all_to_all(self.raw(), n, Bits::B64(&shapes), BitsMut::B64(&mut theirs))?;
        let metas = theirs
            .chunks_exact(SHAPE_WORDS)
            .enumerate()
            .map(|(i, w)| {
                decode_shape(w)?.ok_or_else(|| Error::CollectiveMismatch { op: OP, detail: format!("rank {} announced a part without a shape", self.ranks[i]) })
            })
            .collect::<Result<Vec<Meta>>>()?;
        // Every count is checked before the first request is posted: an
        // error between two posts would free buffers MPI still uses.
        for (_, dims) in &metas {
            wire::count(OP, dims.iter().product())?;
        }
        for p in &contiguous {
            wire::count(OP, p.elem_count())?;
        }
        let mut received: Vec<Option<CpuStorage>> =
            metas.iter().enumerate().map(|(i, (dtype, dims))| (i != self.me).then(|| for_overwrite(dev, *dtype, dims.iter().product()))).collect();
        let guards: Vec<_> = contiguous.iter().map(|p| (p.read(), p.layout().contiguous_range().expect("contiguous"))).collect();
        let mut requests = Vec::with_capacity(2 * n);
        for (i, r) in received.iter_mut().enumerate() {
            if let Some(s) = r {
                requests.push(wire::irecv(self.raw(), bits_mut(s), i, TAG_ALL_TO_ALL).expect("counts checked above"));
            }
        }
        for (j, (g, range)) in guards.iter().enumerate() {
            if j == self.me {
                continue;
            }
            let Storage::Cpu(s) = &**g else { unreachable!("host tensors") };
            requests.push(wire::isend(self.raw(), bits(s, range.clone()), j, TAG_ALL_TO_ALL).expect("counts checked above"));
        }
        // The buffers above stay borrowed (guards) or untouched (received)
        // until every request is complete.
        wire::wait_all(&mut requests);
        drop(guards);
        Ok(received.into_iter().zip(metas).enumerate().map(|(i, (s, (_, dims)))| s.map_or_else(|| parts[i].clone(), |s| wrap(s, dims, dev))).collect())
    }

    fn barrier(&self) -> Result<()> {
        if self.verify {
            // Every rank's record arrives only once every rank has sent it:
            // the comparison is itself a barrier.
            return self.open(Call::bare(Op::Barrier), Ok(()));
        }
        self.step.fetch_add(1, Ordering::Relaxed);
        self.progress_sends();
        let _w = self.watch("barrier");
        wire::barrier(self.raw());
        Ok(())
    }

    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        const OP: &str = "send";
        self.check_peer(OP, peer)?;
        let t = host(OP, t.contiguous()?)?;
        wire::count(OP, t.elem_count())?;
        let dev = cpu(&t)?;
        // A copy of its own: the caller may change `t` as soon as this
        // returns, while MPI still reads the message.
        let copy = wrap(concat(dev, t.dtype(), &[(&t, 0..t.elem_count())]), [t.elem_count()], dev);
        let shape = Box::new(encode_shape(Some(&meta(&t))));
        let mut sent = self.sent.lock();
        sent.retain_mut(|s| !s.requests.iter_mut().all(Request::test));
        // The element count was checked above, so neither post fails
        // between the two (a shape without its elements would leave the
        // receiver waiting).
        let shape_req = wire::isend(self.raw(), Bits::B64(&shape[..]), peer, TAG_SHAPE).expect("a shape record is small");
        let data_req = with_storage(&copy, |s, r| wire::isend(self.raw(), bits(s, r), peer, TAG_DATA)).expect("the count was checked");
        sent.push(Sent { requests: [shape_req, data_req], _shape: shape, _data: copy });
        Ok(())
    }

    fn recv(&self, peer: usize) -> Result<Tensor> {
        const OP: &str = "recv";
        self.check_peer(OP, peer)?;
        self.progress_sends();
        let _turn = self.receiving[peer].lock();
        let _w = self.watch(OP);
        let mut shape = [0u64; SHAPE_WORDS];
        wire::recv(self.raw(), BitsMut::B64(&mut shape), peer, TAG_SHAPE)?;
        let (dtype, dims) = decode_shape(&shape)?
            .ok_or_else(|| Error::CollectiveMismatch { op: OP, detail: format!("rank {} sent a message without a shape", self.ranks[peer]) })?;
        let dev = cpu_device(&self.shared.device);
        let mut data = for_overwrite(dev, dtype, dims.iter().product());
        wire::recv(self.raw(), bits_mut(&mut data), peer, TAG_DATA)?;
        Ok(wrap(data, dims, dev))
    }
}
