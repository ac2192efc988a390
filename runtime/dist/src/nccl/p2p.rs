//! Point-to-point messages between the GPUs of one group.
//!
//! NCCL's own send and receive are a rendezvous: a send does not complete
//! until the peer posts the matching receive, so two ranks that both send
//! first deadlock, which [`Communicator::send`] promises they do not. Every
//! rank of a group lives in this process (a thread per GPU), so a message
//! needs no network: `send` copies the tensor on the sender's device (the
//! caller may overwrite it at once), records an event after the copy and
//! leaves the copy in the receiver's mailbox; `recv` takes the oldest
//! message from that sender, makes its own compute stream wait for the
//! event and copies the bytes across (`cuMemcpyPeerAsync`, which goes
//! through NVLink or PCIe peer access where the devices have it and is
//! staged by the driver where they do not). Neither side blocks on the
//! device; only a receiver whose message has not been sent yet waits, on
//! the host, until it is (or until the group is aborted).
//!
//! [`Communicator::send`]: crate::Communicator::send

use super::{address, Inflight, NcclCommunicator, State};
use crate::Communicator;
use cudarc::driver::CudaEvent;
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::sync::Arc;
use tessera_core::backend::{CudaDevice, CudaStorage, Storage};
use tessera_core::tensor::Tensor;
use tessera_core::Device;
use tessera_core::{Error, Result};

/// A message on its way: the sender's copy and the event after it.
struct Message {
    data: Tensor,
    copied: Arc<CudaEvent>,
    from: CudaDevice,
}

/// The mailboxes of a group: one queue per (sender, receiver) pair.
pub(super) struct Mailboxes {
    size: usize,
    queues: Mutex<Vec<VecDeque<Message>>>,
    arrived: Condvar,
}

impl Mailboxes {
    pub(super) fn new(size: usize) -> Self {
        Mailboxes { size, queues: Mutex::new((0..size * size).map(|_| VecDeque::new()).collect()), arrived: Condvar::new() }
    }

    /// Wakes every waiting receiver (the group was aborted). Taking the
    /// queues' lock first means no receiver is between checking the group's
    /// state and starting to wait.
    pub(super) fn wake_all(&self) {
        let _queues = self.queues.lock();
        self.arrived.notify_all();
    }
}

impl NcclCommunicator {
    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size() {
            return Err(Error::no_such_rank(op, format!("peer {peer} is not a rank of this group of {} ranks (0..{})", self.size(), self.size())));
        }
        if peer == self.rank() {
            return Err(Error::no_such_rank(op, format!("rank {peer} cannot message itself; keep the tensor instead")));
        }
        Ok(())
    }

    /// The error of a stopped group, if this rank's member is stopped.
    fn stopped(&self) -> Option<Error> {
        match &*self.member().state.lock() {
            State::Live(_) => None,
            State::Stopped { rank, reason } => Some(Error::PeerFailed { rank: *rank, reason: reason.clone() }),
        }
    }

    pub(super) fn send_to(&self, t: &Tensor, peer: usize) -> Result<()> {
        let op = "send";
        self.check_peer(op, peer)?;
        if let Some(e) = self.stopped() {
            return Err(e);
        }
        let x = self.input(op, t)?;
        let device = self.cuda();
        let copy = {
            let guard = x.read();
            let Storage::Cuda(s) = &*guard else { return Err(Error::placement(op, "a host tensor; move it to the rank's CUDA device first")) };
            let start = x.layout().offset();
            CudaStorage::concat(device, x.dtype(), &[(s, start..start + x.elem_count())])?
        };
        let data = Tensor::from_storage(Storage::Cuda(copy), x.shape().clone(), Device::Cuda(device.clone()));
        let copied = Arc::new(device.compute_stream().record_event(None).map_err(|e| device.error("recording the copy of a message", e))?);
        let mail = &self.shared.mail;
        mail.queues.lock()[self.rank() * mail.size + peer].push_back(Message { data, copied, from: device.clone() });
        mail.arrived.notify_all();
        Ok(())
    }

    pub(super) fn recv_from(&self, peer: usize) -> Result<Tensor> {
        let op = "recv";
        self.check_peer(op, peer)?;
        let mail = &self.shared.mail;
        let message = {
            let mut queues = mail.queues.lock();
            loop {
                if let Some(m) = queues[peer * mail.size + self.rank()].pop_front() {
                    break m;
                }
                if let Some(e) = self.stopped() {
                    return Err(e);
                }
                mail.arrived.wait(&mut queues);
            }
        };
        let device = self.cuda();
        let out = self.output(&message.data, message.data.shape().clone())?;
        let stream = device.compute_stream();
        stream.wait(&message.copied).map_err(|e| device.error("ordering a receive after the sender's copy", e))?;
        let bytes = message.data.elem_count() * message.data.dtype().size_in_bytes();
        if bytes > 0 {
            let (src, dst) = (address(op, &message.data)? as u64, address(op, &out)? as u64);
            stream.context().bind_to_thread().map_err(|e| device.error("making the device current before a copy", e))?;
            // SAFETY: `src` holds `bytes` bytes on the sender's device and
            // `dst` as many on this one; the sender's copy is kept alive until
            // the sender's stream has waited for this copy (`Inflight`), and
            // `out` is ordered by this device's compute stream.
            unsafe {
                cudarc::driver::result::memcpy_peer_async(
                    stream.context().cu_ctx(),
                    dst,
                    message.from.compute_stream().context().cu_ctx(),
                    src,
                    bytes,
                    stream.cu_stream(),
                )
            }
            .map_err(|e| device.error("copying a message from a peer GPU", e))?;
        }
        let received = Arc::new(stream.record_event(None).map_err(|e| device.error("recording a received message", e))?);
        // The sender's allocator may hand the block out again only after
        // this copy has read it.
        Inflight { device: message.from, event: received, keep: vec![message.data] }.release()?;
        // That bound the sender's context to this thread; this rank's work
        // (cuBLAS among it) runs in its own.
        stream.context().bind_to_thread().map_err(|e| device.error("making the device current again after a receive", e))?;
        Ok(out)
    }
}
