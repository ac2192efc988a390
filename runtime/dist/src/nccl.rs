//! Communicators between CUDA devices through NCCL.
//!
//! One process drives several GPUs with a thread per GPU. The communicators
//! of a group are created together from the main thread
//! ([`NcclCommunicator::group`], NCCL's `ncclCommInitAll`), then each one is
//! moved to its rank's thread and used through the [`Communicator`] trait,
//! exactly like the in-process communicators of CPU ranks;
//! [`mesh_groups`] builds every rank's tensor-, data-, pipeline- and
//! expert-parallel groups of a [`Mesh`] the same way.
//!
//! ```no_run
//! use tessera::dist::{nccl::NcclCommunicator, Communicator};
//! use tessera::{Device, Tensor};
//!
//! let devices = [Device::cuda(0)?, Device::cuda(1)?];
//! let comms = NcclCommunicator::group(&devices)?;
//! std::thread::scope(|s| {
//!     for (comm, dev) in comms.iter().zip(&devices) {
//!         s.spawn(move || {
//!             let x = Tensor::from_vec(vec![1.0f32; 4], [4], dev)?;
//!             let sum = comm.all_reduce_sum(&x)?; // [2.0; 4] on both ranks
//!             Ok::<_, tessera::Error>(sum)
//!         });
//!     }
//! });
//! # Ok::<(), tessera::Error>(())
//! ```
//!
//! # Streams
//!
//! A collective is queued on its device's communication stream, which first
//! waits for the compute queued so far (the input was just written). A
//! synchronous call then makes the compute stream wait for it (the result is
//! read next); both are event waits between streams, so a call returns as
//! soon as the work is queued and the host never blocks. Only
//! [`barrier`](Communicator::barrier) and
//! [`all_to_all`](Communicator::all_to_all) wait on the host.
//!
//! The `*_async` forms of the all-reduce, all-gather, reduce-scatter and
//! broadcast leave the compute stream free: kernels queued after the call
//! (the rest of the backward) run while the collective does, and only
//! [`Pending::wait`] orders the compute stream after it. That is how a
//! data-parallel bucket's all-reduce overlaps the backward
//! (`tessera::parallel::data::DataParallel`). The handle holds the
//! buffers the collective reads until then, since the allocator hands freed
//! blocks out again in compute-stream order; [`Pending::is_done`] asks the
//! device whether the collective has run.
//!
//! All of a device's communicators (its rank's tp, dp, pp and ep groups)
//! share its one communication stream, so their collectives run in the order
//! they were issued: ranks must issue collectives of different groups in the
//! same relative order too, or each waits on its stream for a peer that
//! waits behind something else. The code generated for a model does, since
//! every rank runs the same program.
//!
//! # Differences from the in-process communicator
//!
//! - **Sums** are NCCL's: in the tensor's dtype (bf16 and f16 round at every
//!   step of the ring), in an order NCCL chooses. Every rank still receives
//!   the same values, but they can differ from the CPU's rank-order f32 sum
//!   in the last bits (bf16 and f16 by a few units in the last place).
//! - **Mismatched calls are not detected**: checking that the ranks agree
//!   would cost a host round trip per collective. A rank that skips a
//!   collective or passes another shape makes NCCL wait forever or compute
//!   garbage; the code generated for a model issues the same calls on every
//!   rank by construction.
//! - **Failures**: [`abort`](Communicator::abort) on one rank stops the whole
//!   group: every member's NCCL handle is aborted (which also ends the
//!   collectives already queued on the devices) and every later call returns
//!   [`Error::PeerFailed`] naming the rank. There is no timeout.
//! - [`all_to_all`](Communicator::all_to_all) first all-gathers a table of
//!   the parts' dtypes and shapes and reads it on the host: the one
//!   collective besides the barrier that waits on the host.
//! - **Point-to-point** [`send`](Communicator::send) and
//!   [`recv`](Communicator::recv) do not use NCCL's, which are a rendezvous
//!   (two ranks that both send first deadlock, which the trait promises they
//!   do not): when every rank of a group lives in this process, a message is
//!   a copy on the sender's device handed over through a mailbox and copied
//!   across by the receiver (`nccl/p2p.rs`); between processes it goes
//!   through the host, over the same members' host communicator.
//!
//! # Processes with a GPU each
//!
//! [`process_mesh_groups`] builds one process's groups in a job of processes
//! (`tessera launch`, torchrun, Slurm, mpirun; one GPU per process, the
//! node's `LOCAL_RANK`-th): each group's first rank makes its NCCL id
//! (`ncclGetUniqueId`) and publishes it in the rendezvous store, every member
//! joins with `ncclCommInitRank`, and a watchdog aborts the groups when the
//! connections between the processes see a rank fail (a killed process, a
//! hang past the timeout), so that no collective queued on a GPU waits for a
//! rank that is gone. Under MPI (features `cuda` and `mpi`),
//! [`mpi_mesh_groups`] does the same with each group's id broadcast from its
//! first rank over the MPI communicator of the same members
//! (`MPI_Bcast`); a failed rank ends the MPI job, which needs no watchdog.

mod all_to_all;
mod p2p;
mod raw;

use super::comm::{Communicator, Pending};
use super::mesh::{Axis, Mesh};
use crate::Groups;
use cudarc::driver::CudaEvent;
use cudarc::nccl::{result, sys};
use parking_lot::Mutex;
use raw::{describe, nccl_type, RawComm};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use tessera_core::backend::{CudaDevice, CudaStorage, Device, Storage};
use tessera_core::tensor::{DType, Shape, Tensor};
use tessera_core::{Error, Result};

/// One rank's communicator in a group of CUDA devices, through NCCL.
///
/// Cheap to share between threads (`Send + Sync`); calls on one
/// communicator are serialised. Created with [`group`](Self::group) or
/// [`mesh_groups`]; dropping every communicator of a group waits for the
/// collectives they queued, then releases the NCCL handles.
pub struct NcclCommunicator {
    shared: Arc<Shared>,
    rank: usize,
}

/// What the members of one group share: each rank's device and NCCL
/// handle, so that an abort on one rank reaches every handle.
///
/// A group of threads holds every member here; a group of processes holds
/// only this process's, and reaches the others' through NCCL alone.
struct Shared {
    /// The members in this process: group ranks `first..first + len`.
    members: Vec<Member>,
    /// The group rank of `members[0]`.
    first: usize,
    /// Ranks in the group, in every process.
    size: usize,
    /// Between processes, the same members over the host (TCP or shared
    /// memory): the path of point-to-point messages, which cannot be
    /// handed over within one process.
    host: Option<Arc<dyn Communicator>>,
    /// Each member's rank in the world (its group rank in a plain group),
    /// named in [`Error::PeerFailed`].
    world_ranks: Vec<usize>,
    /// The messages sent and not yet received.
    mail: p2p::Mailboxes,
}

struct Member {
    device: CudaDevice,
    state: Mutex<State>,
}

enum State {
    Live(RawComm),
    /// Stopped by `abort` on world rank `rank`.
    Stopped {
        rank: usize,
        reason: String,
    },
}

impl Drop for Member {
    fn drop(&mut self) {
        // The handle must outlive the collectives queued on it; a stopped
        // group's were aborted with it.
        if let State::Live(_) = &*self.state.lock() {
            let _ = self.device.comm_stream().synchronize();
        }
    }
}

/// The CUDA device of each of `devices`, refusing CPU devices and a device
/// named twice (NCCL runs one rank per GPU).
fn cuda_devices(op: &'static str, devices: &[Device]) -> Result<Vec<CudaDevice>> {
    if devices.is_empty() {
        return Err(Error::topology(op, "a group needs at least one device"));
    }
    let mut out: Vec<CudaDevice> = Vec::with_capacity(devices.len());
    for (i, d) in devices.iter().enumerate() {
        let Device::Cuda(c) = d else {
            return Err(Error::topology(
                op,
                format!("device {i} is {d}: NCCL connects CUDA devices; use the in-process communicator (`dist::inproc`) for CPU ranks"),
            ));
        };
        if let Some(j) = out.iter().position(|o| o.ordinal() == c.ordinal()) {
            return Err(Error::topology(
                op,
                format!("devices {j} and {i} are both cuda:{}: NCCL runs one rank per GPU; give every rank its own device", c.ordinal()),
            ));
        }
        out.push(c.clone());
    }
    Ok(out)
}

impl NcclCommunicator {
    /// The communicators of a group whose rank `i` runs on `devices[i]`,
    /// created together from this thread; hand each to its rank's thread.
    ///
    /// Tensors passed to rank `i`'s communicator must live on `devices[i]`
    /// (the same [`Device`] value, which owns the streams the collectives
    /// are ordered on). [`Error::NcclUnavailable`] when the NCCL library
    /// cannot be loaded.
    pub fn group(devices: &[Device]) -> Result<Vec<NcclCommunicator>> {
        let world_ranks: Vec<usize> = (0..devices.len()).collect();
        Self::group_of_world_ranks(devices, world_ranks)
    }

    /// [`group`](Self::group) for members that are the world ranks
    /// `world_ranks` of a larger mesh (named when one of them aborts).
    fn group_of_world_ranks(devices: &[Device], world_ranks: Vec<usize>) -> Result<Vec<NcclCommunicator>> {
        let op = "NcclCommunicator::group";
        let cuda = cuda_devices(op, devices)?;
        raw::library()?;
        let ordinals: Vec<usize> = cuda.iter().map(CudaDevice::ordinal).collect();
        let handles = RawComm::init_all(&ordinals).map_err(|detail| Error::Nccl {
            ordinal: ordinals[0],
            op: "creating the communicators of a group (ncclCommInitAll)",
            detail,
        })?;
        let members = cuda.into_iter().zip(handles).map(|(device, h)| Member { device, state: Mutex::new(State::Live(h)) }).collect();
        let shared = Arc::new(Shared { members, first: 0, size: world_ranks.len(), host: None, mail: p2p::Mailboxes::new(world_ranks.len()), world_ranks });
        Ok((0..devices.len()).map(|rank| NcclCommunicator { shared: shared.clone(), rank }).collect())
    }

    /// This process's communicator in the group of processes whose world
    /// ranks are `world_ranks`, this one running on `device`: the group's
    /// first rank makes its NCCL id and hands it out through `exchange`
    /// (`exchange(Some(id))` publishes, `exchange(None)` waits for it; the
    /// rendezvous store under a key naming the group, say), then every rank
    /// joins with `ncclCommInitRank`, which returns once all have. `host`
    /// is the same members' communicator over the host, which carries
    /// point-to-point messages.
    pub fn join(
        world_ranks: Vec<usize>,
        me: usize,
        device: &Device,
        host: Arc<dyn Communicator>,
        exchange: impl FnOnce(Option<[u8; 128]>) -> Result<[u8; 128]>,
    ) -> Result<NcclCommunicator> {
        let op = "NcclCommunicator::join";
        let cuda = cuda_devices(op, std::slice::from_ref(device))?.remove(0);
        let rank =
            world_ranks.iter().position(|&r| r == me).ok_or_else(|| Error::no_such_rank(op, format!("rank {me} is not a member of group {world_ranks:?}")))?;
        if host.size() != world_ranks.len() || host.rank() != rank {
            return Err(Error::topology(
                op,
                format!("the host communicator is rank {} of {} but this rank is {rank} of {}", host.rank(), host.size(), world_ranks.len()),
            ));
        }
        raw::library()?;
        let nccl_error = |detail| Error::Nccl { ordinal: cuda.ordinal(), op: "joining a group of processes (ncclGetUniqueId, ncclCommInitRank)", detail };
        let id = exchange(if rank == 0 { Some(RawComm::unique_id().map_err(nccl_error)?) } else { None })?;
        // NCCL creates the handle on the thread's current device.
        cuda.compute_stream().context().bind_to_thread().map_err(|e| cuda.error("making the device current before joining an NCCL group", e))?;
        let handle = RawComm::init_rank(world_ranks.len(), &id, rank).map_err(nccl_error)?;
        let size = world_ranks.len();
        let members = vec![Member { device: cuda, state: Mutex::new(State::Live(handle)) }];
        let shared = Arc::new(Shared { members, first: rank, size, host: Some(host), mail: p2p::Mailboxes::new(size), world_ranks });
        Ok(NcclCommunicator { shared, rank })
    }

    /// The device this rank's collectives run on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.member().device.clone())
    }

    /// This rank's index in the world (its group rank is [`Communicator::rank`]).
    pub fn world_rank(&self) -> usize {
        self.shared.world_ranks[self.rank]
    }

    fn member(&self) -> &Member {
        &self.shared.members[self.rank - self.shared.first]
    }

    fn cuda(&self) -> &CudaDevice {
        &self.member().device
    }

    /// `t` made contiguous, after checking it lives on this rank's device.
    fn input(&self, op: &'static str, t: &Tensor) -> Result<Tensor> {
        let mine = self.cuda();
        match t.device() {
            Device::Cuda(d) if d.same(mine) => t.contiguous(),
            other => Err(Error::placement(
                op,
                format!("the tensor is on {other} but rank {} of this NCCL group runs on cuda:{}; create the rank's tensors on the `Device` its communicator was built from (a second `Device::cuda(n)` is another handle with its own streams)", self.rank, mine.ordinal()),
            )),
        }
    }

    /// A tensor of `t`'s dtype and `shape` on this rank's device, written by the collective.
    fn output(&self, t: &Tensor, shape: Shape) -> Result<Tensor> {
        self.output_of(t.dtype(), shape)
    }

    /// A tensor of `dtype` and `shape` on this rank's device, written by the collective.
    fn output_of(&self, dtype: DType, shape: Shape) -> Result<Tensor> {
        let storage = CudaStorage::uninit(self.cuda(), dtype, shape.elem_count())?;
        Ok(Tensor::from_storage(Storage::Cuda(storage), shape, Device::Cuda(self.cuda().clone())))
    }

    /// Queues one NCCL call on the communication stream, ordered after the
    /// compute queued so far, and returns an event recorded after it.
    fn queue(
        &self,
        op: &'static str,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<Arc<CudaEvent>> {
        let member = self.member();
        let state = member.state.lock();
        let comm = match &*state {
            State::Live(c) => c.handle(),
            State::Stopped { rank, reason } => return Err(Error::PeerFailed { rank: *rank, reason: reason.clone() }),
        };
        let device = &member.device;
        device.comm_waits_for_compute()?;
        let stream = device.comm_stream();
        // NCCL launches through the CUDA runtime, on the thread's current device.
        stream.context().bind_to_thread().map_err(|e| device.error("making the device current before an NCCL call", e))?;
        let cu_stream = stream.cu_stream() as sys::cudaStream_t;
        match catch_unwind(AssertUnwindSafe(|| call(comm, cu_stream))) {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(Error::Nccl { ordinal: device.ordinal(), op, detail: describe(&e) }),
            Err(_) => return Err(Error::NcclUnavailable { detail: format!("the NCCL library lacks a function {op} needs") }),
        }
        let event = stream.record_event(None).map_err(|e| device.error("recording the end of a collective", e))?;
        Ok(Arc::new(event))
    }

    /// Queues one NCCL call like [`queue`](Self::queue), and orders the
    /// compute queued next after it.
    fn launch(
        &self,
        op: &'static str,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> std::result::Result<result::NcclStatus, result::NcclError>,
    ) -> Result<()> {
        let event = self.queue(op, call)?;
        Inflight { device: self.cuda().clone(), event, keep: Vec::new() }.release()
    }

    /// The handle of the collective `op` queued as `event`, reading the
    /// buffers `keep`: done once the device has run it; waiting for it orders
    /// the compute queued from then on after it (the host does not block),
    /// then returns what `finish` makes of the output.
    fn pending<T: Send + 'static>(
        &self,
        op: &'static str,
        event: Arc<CudaEvent>,
        keep: Vec<Tensor>,
        finish: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        let inflight = Inflight { device: self.cuda().clone(), event: event.clone(), keep };
        Pending::queued(
            op,
            self.rank,
            move || event.is_complete(),
            move || {
                inflight.release()?;
                finish()
            },
        )
    }

    fn check_dim(op: &'static str, t: &Tensor, dim: usize) -> Result<()> {
        if dim >= t.rank() {
            return Err(Error::invalid(op, format!("dim {dim} is out of range for a tensor of shape {} ({} dims)", t.shape(), t.rank())));
        }
        Ok(())
    }
}

/// The device address of a contiguous CUDA tensor's first element.
fn address(op: &'static str, t: &Tensor) -> Result<*mut std::ffi::c_void> {
    let guard = t.read();
    match &*guard {
        Storage::Cuda(s) => Ok(s.device_ptr_at(t.layout().offset()) as *mut std::ffi::c_void),
        Storage::Cpu(_) => Err(Error::placement(op, "an NCCL collective was given a host tensor; move it to the rank's CUDA device first")),
    }
}

/// A collective queued on a device's communication stream and the buffers
/// it reads. Releasing it (or dropping it unreleased, when a handle is
/// dropped without waiting) makes the compute stream wait for the
/// collective before the buffers go back to the allocator, which hands
/// freed blocks out again in compute-stream order.
struct Inflight {
    device: CudaDevice,
    event: Arc<CudaEvent>,
    keep: Vec<Tensor>,
}

impl Inflight {
    /// Orders the compute stream after the collective, then drops the buffers.
    fn release(mut self) -> Result<()> {
        let ordered = self.order_compute();
        if ordered.is_ok() {
            self.keep.clear();
        }
        ordered
    }

    fn order_compute(&self) -> Result<()> {
        self.device.compute_stream().wait(&self.event).map_err(|e| self.device.error("ordering the compute stream after a collective", e))
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        if !self.keep.is_empty() && self.order_compute().is_err() {
            // The device is failing: the stream cannot be ordered, so the
            // buffers are safer leaked than handed out while NCCL may read them.
            std::mem::forget(std::mem::take(&mut self.keep));
        }
    }
}

/// The product of the dimensions before `dim`: how many blocks a
/// concatenation along `dim` interleaves.
fn outer(t: &Tensor, dim: usize) -> usize {
    t.dims()[..dim].iter().product()
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.all_reduce_sum_async(t)?.wait()
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.all_gather_async(t, dim)?.wait()
    }

    fn reduce_scatter_sum(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.reduce_scatter_sum_async(t, dim)?.wait()
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.broadcast_async(t, root)?.wait()
    }

    fn all_reduce_sum_async(&self, t: &Tensor) -> Result<Pending> {
        let op = "all_reduce_sum";
        let x = self.input(op, t)?;
        let out = self.output(&x, x.shape().clone())?;
        let (src, dst, n, ty) = (address(op, &x)?, address(op, &out)?, x.elem_count(), nccl_type(x.dtype()));
        // SAFETY: `src` and `dst` hold `n` elements of `ty` on this rank's
        // device and live until the queued call has run: the handle keeps
        // `x`, and the compute stream, which reuses freed blocks, waits for
        // the call before either is released (`Inflight`).
        let event = self.queue(op, |comm, stream| unsafe { result::all_reduce(src, dst, n, ty, sys::ncclRedOp_t::ncclSum, comm, stream) })?;
        Ok(self.pending(op, event, vec![x], move || Ok(out)))
    }

    fn all_gather_async(&self, t: &Tensor, dim: usize) -> Result<Pending> {
        let op = "all_gather";
        Self::check_dim(op, t, dim)?;
        let x = self.input(op, t)?;
        let size = self.size();
        // NCCL concatenates along the leading dimension: gather into
        // [size, ...] and, if `dim` is not leading, move the rank index next
        // to `dim` with one strided copy on the compute stream once the
        // gather has run.
        let mut stacked = vec![size];
        stacked.extend_from_slice(x.dims());
        let gathered = self.output(&x, Shape::new(stacked))?;
        let (src, dst, n, ty) = (address(op, &x)?, address(op, &gathered)?, x.elem_count(), nccl_type(x.dtype()));
        // SAFETY: `src` holds `n` and `dst` `size · n` elements of `ty` on this
        // rank's device, alive until the call has run (see all_reduce_sum_async).
        let event = self.queue(op, |comm, stream| unsafe { result::all_gather(src, dst, n, ty, comm, stream) })?;
        let mut dims = x.dims().to_vec();
        dims[dim] *= size;
        let pre = outer(&x, dim);
        let per_rank = x.elem_count() / pre.max(1);
        Ok(self.pending(op, event, vec![x], move || {
            if pre == 1 {
                return gathered.reshape(dims);
            }
            gathered.reshape([size, pre, per_rank])?.transpose(0, 1)?.contiguous()?.reshape(dims)
        }))
    }

    fn reduce_scatter_sum_async(&self, t: &Tensor, dim: usize) -> Result<Pending> {
        let op = "reduce_scatter_sum";
        Self::check_dim(op, t, dim)?;
        let size = self.size();
        if !t.dims()[dim].is_multiple_of(size) {
            return Err(Error::shape(
                op,
                format!(
                    "dim {dim} of shape {} has {} elements, not a multiple of the group size {size}; pad it or scatter along another dim",
                    t.shape(),
                    t.dims()[dim]
                ),
            ));
        }
        let x = self.input(op, t)?;
        // NCCL scatters along the leading dimension: if `dim` is not
        // leading, first bring rank `r`'s part of every block together with
        // one strided copy ([pre, size, rest] to [size, pre, rest]).
        let pre = outer(&x, dim);
        let send = if pre == 1 { x.clone() } else { x.reshape([pre, size, x.elem_count() / (pre * size)])?.transpose(0, 1)?.contiguous()? };
        let mut dims = x.dims().to_vec();
        dims[dim] /= size;
        let out = self.output(&x, Shape::new(dims))?;
        let (src, dst, n, ty) = (address(op, &send)?, address(op, &out)?, out.elem_count(), nccl_type(x.dtype()));
        // SAFETY: `src` holds `size · n` and `dst` `n` elements of `ty` on this
        // rank's device, alive until the call has run (see all_reduce_sum_async).
        let event = self.queue(op, |comm, stream| unsafe { result::reduce_scatter(src, dst, n, ty, sys::ncclRedOp_t::ncclSum, comm, stream) })?;
        Ok(self.pending(op, event, vec![send], move || Ok(out)))
    }

    fn broadcast_async(&self, t: &Tensor, root: usize) -> Result<Pending> {
        let op = "broadcast";
        if root >= self.size() {
            return Err(Error::no_such_rank(op, format!("root {root} is not a rank of this group of {} ranks (0..{})", self.size(), self.size())));
        }
        let x = self.input(op, t)?;
        // The root sends from its own tensor in place and gets it back; the
        // others receive into a new tensor.
        let out = if self.rank == root { x.clone() } else { self.output(&x, x.shape().clone())? };
        let (src, dst, n, ty) = (address(op, &x)?, address(op, &out)?, x.elem_count(), nccl_type(x.dtype()));
        let root = root as i32; // checked above: below the group size, an i32
                                // SAFETY: `src` and `dst` hold `n` elements of `ty` on this rank's
                                // device, alive until the call has run (see all_reduce_sum_async); on
                                // the root they are the same buffer, which NCCL allows.
        let event = self.queue(op, |comm, stream| unsafe { result::broadcast(src, dst, n, ty, root, comm, stream) })?;
        Ok(self.pending(op, event, vec![x], move || Ok(out)))
    }

    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.all_to_all_parts(parts)
    }

    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        match &self.shared.host {
            // Staged through the host: NCCL's own send is a rendezvous that
            // deadlocks two ranks that both send first.
            Some(host) => host.send(&self.input("send", t)?.to_device(&Device::cpu())?, peer),
            None => self.send_to(t, peer),
        }
    }

    fn recv(&self, peer: usize) -> Result<Tensor> {
        match &self.shared.host {
            Some(host) => host.recv(peer)?.to_device(&self.device()),
            None => self.recv_from(peer),
        }
    }

    fn barrier(&self) -> Result<()> {
        let op = "barrier";
        // A one-element all-reduce every rank must join, then a host wait.
        let token = Tensor::zeros([1], DType::F32, &self.device())?;
        self.all_reduce_sum(&token)?;
        self.cuda().comm_stream().synchronize().map_err(|e| self.cuda().error(op, e))
    }

    fn abort(&self, reason: &str) {
        let me = self.world_rank();
        for member in &self.shared.members {
            let mut state = member.state.lock();
            if let State::Live(_) = &*state {
                // Replacing the state drops the handle, which aborts it.
                *state = State::Stopped { rank: me, reason: format!("aborted: {reason}") };
            }
        }
        self.shared.mail.wake_all();
    }

    fn failure(&self) -> Option<Error> {
        match &*self.member().state.lock() {
            State::Live(_) => None,
            State::Stopped { rank, reason } => Some(Error::PeerFailed { rank: *rank, reason: reason.clone() }),
        }
    }
}

impl fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NcclCommunicator(rank {} of {} on cuda:{})", self.rank, self.size(), self.cuda().ordinal())
    }
}

/// Every world rank's communicators for the axes of `mesh` (its tensor-,
/// data-, pipeline- and expert-parallel groups) and its data replicas,
/// world rank `r` running on
/// `devices[r]`; element `r` of the result goes to rank `r`'s thread.
///
/// An axis of size one gets [`SingleRank`](super::SingleRank); every group of
/// a larger axis gets its own NCCL communicators, so axes with the same
/// members stay independent, as with the in-process
/// [`mesh_groups`](super::inproc::mesh_groups).
pub fn mesh_groups(mesh: &Mesh, devices: &[Device]) -> Result<Vec<Groups>> {
    if devices.len() != mesh.world() {
        return Err(Error::topology(
            "nccl::mesh_groups",
            format!("the mesh {mesh} has {} ranks but {} devices were given; give one CUDA device per rank", mesh.world(), devices.len()),
        ));
    }
    cuda_devices("nccl::mesh_groups", devices)?;
    // Each rank's communicator of every group in `groups` (disjoint, covering the world).
    let communicators = |groups: Vec<Vec<usize>>| -> Result<Vec<Option<Arc<dyn Communicator>>>> {
        let mut comms: Vec<Option<Arc<dyn Communicator>>> = vec![None; mesh.world()];
        for members in groups {
            if members.len() == 1 {
                comms[members[0]] = Some(Arc::new(super::SingleRank));
                continue;
            }
            let group_devices: Vec<Device> = members.iter().map(|&r| devices[r].clone()).collect();
            let group = NcclCommunicator::group_of_world_ranks(&group_devices, members.clone())?;
            for (comm, &r) in group.into_iter().zip(&members) {
                comms[r] = Some(Arc::new(comm));
            }
        }
        Ok(comms)
    };
    // comms[axis][rank] (dp's spanning dp × cp), then the data replicas (dp × cp × ep).
    let mut comms =
        Axis::ALL.into_iter().map(|axis| communicators(if axis == Axis::Dp { mesh.data_groups() } else { mesh.groups(axis) })).collect::<Result<Vec<_>>>()?;
    let mut replicas = communicators(mesh.replica_groups())?;
    let slot = |axis: Axis| Axis::ALL.iter().position(|&a| a == axis).expect("every axis is in Axis::ALL");
    let take = |comms: &mut Vec<Vec<Option<Arc<dyn Communicator>>>>, axis: Axis, rank: usize| -> Result<Arc<dyn Communicator>> {
        comms[slot(axis)][rank]
            .take()
            .ok_or_else(|| Error::no_such_rank("nccl::mesh_groups", format!("rank {rank} belongs to no {axis} group of the mesh {mesh}")))
    };
    (0..mesh.world())
        .map(|r| {
            Ok(Groups {
                tp: take(&mut comms, Axis::Tp, r)?,
                dp: take(&mut comms, Axis::Dp, r)?,
                cp: take(&mut comms, Axis::Cp, r)?,
                pp: take(&mut comms, Axis::Pp, r)?,
                ep: take(&mut comms, Axis::Ep, r)?,
                replicas: replicas[r]
                    .take()
                    .ok_or_else(|| Error::no_such_rank("nccl::mesh_groups", format!("rank {r} belongs to no replica group of the mesh {mesh}")))?,
            })
        })
        .collect()
}

/// This process's NCCL communicator in the group of world ranks `members`
/// named `tag`, in a job of processes with a GPU each (`device`): the
/// group's first rank makes its NCCL id and hands it out through the
/// rendezvous store, every member joins, and point-to-point messages go
/// over the host communicator of the same members in `world`. Every member
/// calls it with the same tag and members; a group of one rank needs none.
pub fn process_group(
    world: &crate::process::ProcessWorld,
    rendezvous: &crate::store::Rendezvous,
    tag: &str,
    members: &[usize],
    device: &Device,
) -> Result<NcclCommunicator> {
    let timeout = world.timeout();
    let host: Arc<dyn Communicator> = Arc::new(world.tagged_group(&format!("nccl-{tag}"), members)?);
    let key = rendezvous.key(&format!("nccl/{tag}/{members:?}"));
    let store = rendezvous.store();
    let exchange = |id: Option<[u8; 128]>| -> Result<[u8; 128]> {
        match id {
            Some(id) => {
                store.set(&key, &id)?;
                Ok(id)
            }
            None => store.get(&key, timeout)?.try_into().map_err(|_| Error::rendezvous(store.addr(), format!("the NCCL id under {key} is not 128 bytes"))),
        }
    };
    NcclCommunicator::join(members.to_vec(), world.rank(), device, host, exchange)
}

/// This process's NCCL communicators for every axis of `mesh` and its data
/// replicas, in a job of processes with a GPU each (`device`): every group
/// of more than one rank gets its NCCL id from its first rank through the
/// rendezvous store, and carries its point-to-point messages over the
/// host communicator of the same members in `world`. A watchdog thread
/// aborts these communicators when `world` sees a rank fail (a killed
/// process, a hang past the timeout, an abort), so that no collective
/// queued on the device waits for a rank that is gone.
pub fn process_mesh_groups(world: &crate::process::ProcessWorld, rendezvous: &crate::store::Rendezvous, mesh: &Mesh, device: &Device) -> Result<Groups> {
    let me = world.rank();
    let group = |tag: &str, members: &[usize]| -> Result<Arc<dyn Communicator>> {
        if members.len() == 1 {
            return Ok(Arc::new(super::SingleRank));
        }
        Ok(Arc::new(process_group(world, rendezvous, tag, members, device)?))
    };
    let n = world.world_size();
    let world_is = format!("the job has {n} processes");
    let groups = Groups::of_mesh(mesh, me, (n, &world_is, "start as many processes as the mesh has ranks"), group)?;
    watch(world.watcher(), &groups)?;
    Ok(groups)
}

/// This process's NCCL communicators for every axis of `mesh` and its data
/// replicas, in an MPI job of processes with a GPU each (`device`): every
/// group of more than one rank gets its NCCL id from its first rank by a
/// broadcast over the MPI communicator of the same members, which also
/// carries its point-to-point messages. Every rank of the job calls it.
#[cfg(feature = "mpi")]
pub fn mpi_mesh_groups(world: &crate::mpi::MpiWorld, mesh: &Mesh, device: &Device) -> Result<Groups> {
    let me = world.rank();
    let n = world.world_size();
    let world_is = format!("the MPI job has {n} processes");
    let fix = format!("start as many processes as the mesh has ranks (`mpirun -np {}`)", mesh.world());
    Groups::of_mesh(mesh, me, (n, &world_is, &fix), |tag, members| {
        if members.len() == 1 {
            return Ok(Arc::new(super::SingleRank));
        }
        let host: Arc<dyn Communicator> = Arc::new(world.tagged_group(&format!("nccl-{tag}"), members)?);
        let exchange = |id| id_from_first_rank(host.as_ref(), id);
        Ok(Arc::new(NcclCommunicator::join(members.to_vec(), me, device, host.clone(), exchange)?))
    })
}

/// The NCCL id the group's first rank made (`id`, `None` on the others),
/// broadcast over the group's host communicator.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
fn id_from_first_rank(host: &dyn Communicator, id: Option<[u8; 128]>) -> Result<[u8; 128]> {
    let op = "sharing a group's NCCL id";
    if id.is_some() != (host.rank() == 0) {
        return Err(Error::state_mismatch(
            op,
            format!("rank {} of the group {} an id; the first rank alone makes it", host.rank(), if id.is_some() { "made" } else { "did not make" }),
        ));
    }
    let words: Vec<u32> = id.unwrap_or([0; 128]).chunks_exact(4).map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes"))).collect();
    let cpu = Device::cpu();
    let got = host.broadcast(&Tensor::from_vec(words, [32], &cpu)?, 0)?.to_vec::<u32>()?;
    let mut out = [0u8; 128];
    for (o, w) in out.chunks_exact_mut(4).zip(&got) {
        o.copy_from_slice(&w.to_le_bytes());
    }
    Ok(out)
}

/// Aborts `groups` once `failed` reports a failure of the job, polling every
/// 100 ms; ends when the groups are dropped.
fn watch(failed: impl Fn() -> Option<Error> + Send + 'static, groups: &Groups) -> Result<()> {
    let weak: Vec<std::sync::Weak<dyn Communicator>> = groups.all().iter().map(|c| Arc::downgrade(c)).collect();
    std::thread::Builder::new()
        .name("tessera-nccl-watchdog".into())
        .spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_millis(100));
            let live: Vec<Arc<dyn Communicator>> = weak.iter().filter_map(std::sync::Weak::upgrade).collect();
            if live.is_empty() {
                return;
            }
            if let Some(e) = failed() {
                for c in live {
                    c.abort(&e.to_string());
                }
                return;
            }
        })
        .map_err(|source| Error::Thread { what: "watching NCCL groups", source })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inproc::InProcess;

    #[test]
    fn a_groups_id_reaches_every_member_from_the_first() {
        let world = InProcess::new(3).unwrap();
        let id: [u8; 128] = std::array::from_fn(|i| (i * 37 + 11) as u8);
        let got: Vec<Result<[u8; 128]>> = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..3)
                .map(|r| {
                    let world = world.clone();
                    s.spawn(move || {
                        let comm = world.communicator(r, &Device::cpu())?;
                        id_from_first_rank(&comm, (r == 0).then_some(id))
                    })
                })
                .collect();
            ranks.into_iter().map(|t| t.join().unwrap()).collect()
        });
        for g in got {
            assert_eq!(g.unwrap(), id);
        }
    }

    #[test]
    fn an_id_made_by_another_rank_than_the_first_is_refused() {
        let world = InProcess::new(1).unwrap();
        let comm = world.communicator(0, &Device::cpu()).unwrap();
        let e = id_from_first_rank(&comm, None).unwrap_err();
        assert!(e.to_string().contains("first rank alone"), "{e}");
    }
}
