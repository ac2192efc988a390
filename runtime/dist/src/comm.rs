//! The communicator interface every backend implements, the handle of an
//! operation running in the background, and the trivial communicator of a
//! group of one rank.

use std::cell::OnceCell;
use std::fmt;
use std::sync::mpsc;
use std::time::Instant;
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};

/// Collective and point-to-point communication within one group of ranks
/// (one mesh axis).
///
/// # Ordering
///
/// All ranks of the group must call the same collectives in the same order,
/// with matching arguments (described per method); the code generated for a
/// model guarantees that by construction, since every rank runs the same
/// forward and backward. Implementations detect a mismatch (one rank
/// all-reduces while another all-gathers, or the shapes differ) and return
/// [`Error::CollectiveMismatch`] on every rank instead of hanging or
/// computing garbage.
///
/// A rank's calls on one communicator are issued by one thread at a time.
/// An asynchronous form (`*_async`) takes its place in that order when it
/// is *called*, not when it is waited for: `a = all_reduce_sum_async(x);
/// y = all_gather(z); a.wait()` runs the all-reduce before the all-gather on
/// every rank. Point-to-point messages ([`send`](Self::send) and
/// [`recv`](Self::recv)) are ordered per (sender, receiver) pair and
/// independently of the collectives.
///
/// # Failures
///
/// No call waits forever: when a rank of the group fails (calls
/// [`abort`](Self::abort), panics, or drops its communicator while others
/// wait) the pending and later calls on the other ranks return
/// [`Error::PeerFailed`] naming it; a wait that outlasts the backend's
/// timeout returns [`Error::Timeout`].
///
/// # Results
///
/// Reductions sum in the tensor's dtype, computed in `f32` (`f64` for `f64`
/// tensors, exactly for integers) in rank order, so every rank receives
/// bit-identical values that do not depend on thread timing. Tensors a rank
/// receives are allocated on the device of the tensor it passed in (for
/// [`recv`](Self::recv), on the device the communicator was created for).
pub trait Communicator: fmt::Debug + Send + Sync {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// The elementwise sum of `t` over the group, on every rank.
    ///
    /// Every rank passes a tensor of the same dtype and shape.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;

    /// The ranks' tensors concatenated along `dim`, in rank order, on every rank.
    ///
    /// Every rank passes a tensor of the same dtype and shape, and the same
    /// `dim`; the result's `dim` is `size()` times as long.
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor>;

    /// The sum over the group, split along `dim` into `size()` equal parts;
    /// rank `r` gets part `r`.
    ///
    /// Every rank passes a tensor of the same dtype and shape, whose
    /// dimension `dim` is a multiple of `size()`, and the same `dim`.
    fn reduce_scatter_sum(&self, t: &Tensor, dim: usize) -> Result<Tensor>;

    /// Rank `root`'s tensor, on every rank.
    ///
    /// Every rank passes the same `root` and a tensor of the root's dtype
    /// and shape; the non-root ranks' values are ignored and their tensor
    /// only says where the result goes. The root gets its own tensor back.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;

    /// Sends `parts[r]` to rank `r` and returns what every rank sent to this
    /// one, in rank order.
    ///
    /// Every rank passes exactly `size()` parts, all on this rank's device.
    /// The parts may differ in shape (uneven all-to-all, as expert
    /// parallelism needs): each part's shape and dtype travel with it. The
    /// part a rank addresses to itself is returned as is.
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>>;

    /// Returns once every rank of the group has called it.
    fn barrier(&self) -> Result<()>;

    /// Sends a copy of `t` to rank `peer` of the group, which receives it
    /// with [`recv`](Self::recv)`(this rank)`.
    ///
    /// Returns without waiting for the receiver: messages are buffered and
    /// delivered in the order sent, per (sender, receiver) pair, so two
    /// ranks may both send before they receive without deadlocking. `t` may
    /// be modified as soon as this returns. Sending to oneself is an error.
    ///
    /// The default refuses: a backend without point-to-point messages.
    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        let _ = t;
        Err(unsupported("send", peer, self))
    }

    /// The next tensor rank `peer` sent to this rank, with the shape and
    /// dtype it was sent with; waits for it if it has not been sent yet.
    ///
    /// The default refuses, like [`send`](Self::send)'s.
    fn recv(&self, peer: usize) -> Result<Tensor> {
        Err(unsupported("recv", peer, self))
    }

    /// Starts [`send`](Self::send) in the background: the copy is made by
    /// the communicator's thread instead of the caller's, which may compute
    /// meanwhile. Background sends to a peer arrive in the order they were
    /// started, each after the background collectives started before it
    /// (so a receiver must have joined those before it receives); a
    /// blocking `send` made while background ones wait may arrive first,
    /// so use one kind per peer. `t` must not be modified in place until
    /// the handle is waited for.
    ///
    /// The default sends now and returns a completed handle.
    fn send_async(&self, t: &Tensor, peer: usize) -> Result<Pending<()>> {
        Ok(Pending::ready("send", self.send(t, peer)))
    }

    /// Starts [`all_reduce_sum`](Self::all_reduce_sum) in the background.
    ///
    /// `t` must not be modified in place until the handle is waited for (the
    /// other ranks may still be reading it); the caller may compute anything
    /// else meanwhile, such as the rest of the backward pass.
    ///
    /// The default runs the collective synchronously and returns a completed
    /// handle: correct and in order, but without overlap. Backends that can
    /// progress in the background override every `*_async` method.
    fn all_reduce_sum_async(&self, t: &Tensor) -> Result<Pending> {
        Ok(Pending::ready("all_reduce_sum", self.all_reduce_sum(t)))
    }

    /// Starts [`all_gather`](Self::all_gather) in the background (same rules
    /// and default as [`all_reduce_sum_async`](Self::all_reduce_sum_async)).
    fn all_gather_async(&self, t: &Tensor, dim: usize) -> Result<Pending> {
        Ok(Pending::ready("all_gather", self.all_gather(t, dim)))
    }

    /// Starts [`reduce_scatter_sum`](Self::reduce_scatter_sum) in the
    /// background (same rules and default as
    /// [`all_reduce_sum_async`](Self::all_reduce_sum_async)).
    fn reduce_scatter_sum_async(&self, t: &Tensor, dim: usize) -> Result<Pending> {
        Ok(Pending::ready("reduce_scatter_sum", self.reduce_scatter_sum(t, dim)))
    }

    /// Starts [`broadcast`](Self::broadcast) in the background (same rules
    /// and default as [`all_reduce_sum_async`](Self::all_reduce_sum_async)).
    fn broadcast_async(&self, t: &Tensor, root: usize) -> Result<Pending> {
        Ok(Pending::ready("broadcast", self.broadcast(t, root)))
    }

    /// Starts [`all_to_all`](Self::all_to_all) in the background (same rules
    /// and default as [`all_reduce_sum_async`](Self::all_reduce_sum_async)).
    fn all_to_all_async(&self, parts: Vec<Tensor>) -> Result<Pending<Vec<Tensor>>> {
        Ok(Pending::ready("all_to_all", self.all_to_all(parts)))
    }

    /// Starts [`barrier`](Self::barrier) in the background (same default as
    /// [`all_reduce_sum_async`](Self::all_reduce_sum_async)).
    fn barrier_async(&self) -> Result<Pending<()>> {
        Ok(Pending::ready("barrier", self.barrier()))
    }

    /// Declares this rank failed: every other rank's pending and later calls
    /// return [`Error::PeerFailed`] naming this rank and `reason`, and so do
    /// this rank's own later calls. Call it when a rank hits an error it
    /// cannot recover from, so the others stop instead of waiting for it.
    ///
    /// The default does nothing: a backend with no failure propagation
    /// (or, like [`SingleRank`], no peer to tell).
    fn abort(&self, reason: &str) {
        let _ = reason;
    }

    /// The failure that stopped this communicator, if one has ([`abort`](Self::abort)
    /// on any rank, a peer that gave up waiting), without waiting: what a
    /// rank blocked on something other than a collective (a file another
    /// rank writes, say) polls so that it stops as soon as its peers do.
    ///
    /// The default reports none: a backend with no failure propagation.
    fn failure(&self) -> Option<Error> {
        None
    }
}

fn unsupported(op: &'static str, peer: usize, comm: &(impl Communicator + ?Sized)) -> Error {
    Error::unsupported(
        op,
        format!("peer {peer}: this communicator ({comm:?}) has no point-to-point messages; use one that implements `send` and `recv`, such as the in-process communicator"),
    )
}

/// The result of an operation that runs in the background: a collective
/// started with one of the `*_async` methods of [`Communicator`].
///
/// Dropping a handle without waiting does not cancel the operation (the
/// other ranks take part in it regardless); its result is discarded.
#[must_use = "a pending collective's result (and any error) is only seen by waiting for it"]
pub struct Pending<T = Tensor> {
    op: &'static str,
    rank: usize,
    rx: Option<mpsc::Receiver<(Result<T>, Instant)>>,
    /// The result, and when the operation finished, as stamped by whoever
    /// ran it.
    got: OnceCell<(Result<T>, Instant)>,
    queued: Option<Queued<T>>,
}

/// An operation queued on a device: how to ask whether it has run, and how
/// to take its result (which orders the caller's later work after it).
struct Queued<T> {
    done: Box<dyn Fn() -> bool + Send>,
    finish: Box<dyn FnOnce() -> Result<T> + Send>,
}

/// The sending side of a [`Pending`]: whoever runs the operation completes it.
///
/// Dropping it without completing (the thread running the operation died)
/// makes the handle's [`wait`](Pending::wait) return an error rather than
/// wait forever.
pub struct Completer<T = Tensor> {
    tx: mpsc::SyncSender<(Result<T>, Instant)>,
}

impl<T> Pending<T> {
    /// A handle that is already complete with `result`: for backends that
    /// finish an operation at once (a group of one rank).
    pub fn ready(op: &'static str, result: Result<T>) -> Self {
        let got = OnceCell::new();
        let _ = got.set((result, Instant::now()));
        Pending { op, rank: 0, rx: None, got, queued: None }
    }

    /// A handle for an operation queued on a device's stream rather than run
    /// by a thread: `done` tells whether the device has run it (never
    /// blocks), and `finish` produces the result when the handle is waited
    /// for. `finish` need not block either: it may order the work that reads
    /// the result after the operation on the device (a stream waiting for an
    /// event) and return at once.
    pub fn queued(op: &'static str, rank: usize, done: impl Fn() -> bool + Send + 'static, finish: impl FnOnce() -> Result<T> + Send + 'static) -> Self {
        Pending { op, rank, rx: None, got: OnceCell::new(), queued: Some(Queued { done: Box::new(done), finish: Box::new(finish) }) }
    }

    /// A handle for the operation `op` of rank `rank` (both named in
    /// errors), and the completer that delivers its result from the thread
    /// running it.
    pub fn channel(op: &'static str, rank: usize) -> (Completer<T>, Pending<T>) {
        // Capacity 1: the single result never blocks the completing thread.
        let (tx, rx) = mpsc::sync_channel(1);
        (Completer { tx }, Pending { op, rank, rx: Some(rx), got: OnceCell::new(), queued: None })
    }

    /// Whether the operation has finished, successfully or not (then
    /// [`wait`](Self::wait) returns at once). Never blocks.
    pub fn is_done(&self) -> bool {
        if self.got.get().is_some() {
            return true;
        }
        if let Some(q) = &self.queued {
            return (q.done)();
        }
        let Some(rx) = &self.rx else { return true };
        match rx.try_recv() {
            Ok(got) => {
                let _ = self.got.set(got);
                true
            }
            Err(mpsc::TryRecvError::Empty) => false,
            Err(mpsc::TryRecvError::Disconnected) => true,
        }
    }

    /// Waits for the operation to finish and returns its result.
    ///
    /// The operation's own waits have timeouts, so this returns too: with
    /// the result, or with the error that stopped the operation.
    pub fn wait(self) -> Result<T> {
        self.wait_timed().0
    }

    /// [`wait`](Self::wait), with the moment the operation finished as
    /// stamped by the thread that ran it, which a caller polling with
    /// [`is_done`](Self::is_done) would only see later. `None` for an
    /// operation queued on a device, whose end the host cannot see without
    /// polling.
    pub fn wait_timed(mut self) -> (Result<T>, Option<Instant>) {
        if let Some((r, at)) = self.got.take() {
            return (r, Some(at));
        }
        if let Some(q) = self.queued.take() {
            return ((q.finish)(), None);
        }
        match self.rx.take().map(|rx| rx.recv()) {
            Some(Ok((r, at))) => (r, Some(at)),
            _ => (
                Err(Error::PeerFailed {
                    rank: self.rank,
                    reason: format!("the thread running its {} stopped without delivering a result (it panicked; see its panic message)", self.op),
                }),
                None,
            ),
        }
    }
}

impl<T> fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pending").field("op", &self.op).field("done", &self.got.get().is_some()).finish()
    }
}

impl<T> Completer<T> {
    /// Delivers the operation's result to its handle (a no-op when the
    /// handle was dropped).
    pub fn complete(self, result: Result<T>) {
        let _ = self.tx.send((result, Instant::now()));
    }
}

/// The communicator of a group with a single rank: every collective is the
/// identity, and there is no peer to send to or receive from.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

impl SingleRank {
    fn no_peer(op: &'static str, peer: usize) -> Error {
        Error::no_such_rank(
            op,
            format!("peer {peer}: a group of one rank has no other rank to exchange messages with; point-to-point calls need a group of at least two ranks"),
        )
    }
}

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn all_gather(&self, t: &Tensor, _dim: usize) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn reduce_scatter_sum(&self, t: &Tensor, _dim: usize) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root != 0 {
            return Err(Error::no_such_rank("broadcast", format!("root {root} is not a rank of a group of one rank (only 0 is)")));
        }
        Ok(t.clone())
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        if parts.len() != 1 {
            return Err(Error::invalid("all_to_all", format!("{} parts given, a group of one rank takes exactly 1", parts.len())));
        }
        Ok(parts)
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn send(&self, _t: &Tensor, peer: usize) -> Result<()> {
        Err(Self::no_peer("send", peer))
    }
    fn recv(&self, peer: usize) -> Result<Tensor> {
        Err(Self::no_peer("recv", peer))
    }
    // The `*_async` defaults run each collective synchronously; with nobody
    // to wait for, that is exactly what a background run would do.
    /// Nothing to notify: there is no other rank.
    fn abort(&self, _reason: &str) {}
}
