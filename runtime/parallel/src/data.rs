//! Data parallelism: gradients bucketed in the order they become final and
//! all-reduced while the backward goes on.

use crate::buckets::Buckets;
use crate::powersgd::{PowerSgd, Sent};
use parking_lot::{Mutex, MutexGuard};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_core::ops;
use tessera_core::tensor::{DType, Tensor};
use tessera_core::{Error, Result};
use tessera_dist::{Communicator, Pending};
use tessera_nn::module::{self, Hooks, Module, Param};

/// How gradient traffic is encoded on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Compression {
    /// Gradients travel in their own dtype.
    #[default]
    None,
    /// Gradients travel as bf16 (half the bytes of f32): each input and the
    /// sum are rounded once (unit roundoff 2⁻⁸), so an averaged element is
    /// off by at most 2⁻⁷ times the mean of its magnitudes over the replicas.
    Bf16,
    /// PowerSGD: each weight matrix's gradient travels as two rank-`rank`
    /// factors, `(n + m)·rank` values for an `n × m` matrix, with error
    /// feedback (what the factors missed is added to the next step's
    /// gradient); vectors and matrices too small to gain travel as they
    /// are. The factors need every gradient, so they are computed and sent
    /// in [`DataParallel::finish`], after the backward, in two all-reduces.
    PowerSgd {
        /// The rank of the factors (1 to 4 is the usual range).
        rank: usize,
        /// Steps ([`DataParallel::finish`] calls) sent uncompressed first,
        /// as the method's authors advise for the start of training, when
        /// gradients change fastest.
        warmup: u64,
    },
}

/// What one step's gradient synchronisation cost, measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SyncStats {
    /// Buckets all-reduced.
    pub buckets: usize,
    /// Bytes sent into all-reduces (after compression).
    pub bytes: usize,
    /// Buckets launched before [`DataParallel::finish`], i.e. during the backward.
    pub launched_during_backward: usize,
    /// Wall time during which at least one all-reduce was in flight: the
    /// union over buckets of the span from its launch to its completion, as
    /// stamped by the thread that ran it (buckets in flight together count
    /// once). For a collective queued on a GPU, the host sees its end only
    /// when it polls, so the span ends at the first poll that saw it done.
    pub comm: Duration,
    /// Time `finish` spent blocked on unfinished all-reduces: communication
    /// on the critical path.
    pub exposed: Duration,
}

impl SyncStats {
    /// Communication time that ran while the backward did (`comm −
    /// exposed`). An upper bound of the time overlap saved: on CPU ranks
    /// the collectives share the cores with the backward and slow it, so
    /// the step gains less (`examples/parallel --compare` measures both).
    pub fn hidden(&self) -> Duration {
        self.comm.saturating_sub(self.exposed)
    }
}

/// When a collective waited for from `started_wait` counts as ended, and
/// how long the wait blocked: a collective that had finished before the
/// wait (at `finished`) ended then and blocked nothing; otherwise the wait
/// blocked until its result arrived, which is when it ended for this rank
/// (including the hand-over from the thread that ran it), so every blocked
/// moment lies within the collective's span.
pub(crate) fn wait_span(started_wait: Instant, finished: Option<Instant>) -> (Instant, Duration) {
    match finished {
        Some(at) if at <= started_wait => (at, Duration::ZERO),
        _ => {
            let now = Instant::now();
            (now, now.saturating_duration_since(started_wait))
        }
    }
}

/// The total length of the union of `spans` (start, end): time covered by
/// at least one of them.
pub(crate) fn union_length(mut spans: Vec<(Instant, Instant)>) -> Duration {
    spans.sort_by_key(|s| s.0);
    let mut total = Duration::ZERO;
    let mut current: Option<(Instant, Instant)> = None;
    for (start, end) in spans {
        current = match current {
            Some((a, b)) if start <= b => Some((a, b.max(end))),
            Some((a, b)) => {
                total += b.saturating_duration_since(a);
                Some((start, end))
            }
            None => Some((start, end)),
        };
    }
    total + current.map_or(Duration::ZERO, |(a, b)| b.saturating_duration_since(a))
}

struct Inflight {
    bucket: usize,
    pending: Pending,
    launched: Instant,
    done_at: Option<Instant>,
}

#[derive(Default)]
struct State {
    /// Whether each parameter's gradient was announced this step.
    ready: Vec<bool>,
    /// Buckets sent this step: they go in order (`0..launched`), so that
    /// every rank issues the same collectives in the same order, whatever
    /// order its backward finished its gradients in (NCCL requires it of
    /// communicators that share a stream, and it costs little: buckets are
    /// cut in about the order gradients become final).
    launched: usize,
    inflight: Vec<Inflight>,
    stats: SyncStats,
}

/// Averages gradients over the data replicas during the backward.
///
/// Install it as a [`Hooks`] on each rank's `Cx`. The buckets are fixed when
/// the engine is built: the model's parameters in reverse order (about the
/// order their gradients become final), cut every `bucket_bytes`. Every rank
/// therefore packs the same parameters in the same order, whatever order its
/// own backward announced them in (a layer that skips work on one rank, such
/// as an expert no token chose, must not misalign the sums). A bucket is
/// flattened and all-reduced asynchronously as soon as all its gradients are
/// final, while the backward continues; [`finish`](Self::finish) sends the
/// rest, waits for all, and writes every gradient back as the average over
/// the replicas.
///
/// With expert parallelism ([`with_experts`](Self::with_experts)), an
/// expert's gradient already holds the tokens of every expert-parallel rank
/// (the all-to-all brought them), so it is summed over the replicas that
/// hold the same expert only, while every other gradient is summed over all
/// replicas; the two kinds travel in separate buckets.
///
/// A parameter the model uses in several places (an embedding tied to the
/// head) is sent only by `finish`, in buckets of its own: under pipeline
/// parallelism its uses sit on different stages, and the caller sums its
/// gradient over them (`sync_tied_grads`) after the backward and before
/// `finish`.
///
/// On GPUs with NCCL (`dist::nccl`), a bucket's all-reduce is queued
/// on the device's communication stream and runs beside the kernels of the
/// rest of the backward on the compute stream; `finish` orders the compute
/// stream after each one without blocking the host. There the figures of
/// [`SyncStats`] are host-side: `comm` ends when the host first sees the
/// device done with the bucket, and `exposed` is near zero, since the
/// device, not the host, does the waiting.
pub struct DataParallel {
    /// Sums the gradients every replica holds.
    replicas: Arc<dyn Communicator>,
    /// With expert parallelism, sums the experts' gradients (the replicas
    /// that hold the same experts).
    experts: Option<Arc<dyn Communicator>>,
    /// Whether each bucket holds experts' gradients.
    expert_bucket: Vec<bool>,
    /// The buckets the backward may send (`0..sent_during_backward`); the
    /// rest hold tied parameters, sent only by `finish`.
    sent_during_backward: usize,
    compression: Compression,
    /// PowerSGD's errors and factors, with [`Compression::PowerSgd`].
    powersgd: Option<Mutex<PowerSgd>>,
    params: Vec<Param>,
    /// Each parameter's index in `params`.
    index: std::collections::HashMap<tessera_nn::module::ParamId, usize>,
    /// The fixed gradient buckets (indices into `params`).
    buckets: Buckets,
    state: Mutex<State>,
}

impl DataParallel {
    /// Buckets of about `bucket_bytes` (25 MiB is a common choice) of
    /// `model`'s parameters, over the group `dp`.
    pub fn new<M: Module>(model: &M, dp: Arc<dyn Communicator>, bucket_bytes: usize) -> Result<Self> {
        DataParallel::build(model, dp, None, bucket_bytes)
    }

    /// With expert parallelism: the experts' gradients are summed over
    /// `experts` (the data-parallel group: the replicas holding the same
    /// experts), every other gradient over `replicas` (data × expert
    /// parallel, [`Groups::replicas`](tessera_dist::Groups::replicas)), and
    /// all are divided by the number of replicas.
    pub fn with_experts<M: Module>(model: &M, replicas: Arc<dyn Communicator>, experts: Arc<dyn Communicator>, bucket_bytes: usize) -> Result<Self> {
        DataParallel::build(model, replicas, Some(experts), bucket_bytes)
    }

    fn build<M: Module>(model: &M, replicas: Arc<dyn Communicator>, experts: Option<Arc<dyn Communicator>>, bucket_bytes: usize) -> Result<Self> {
        if bucket_bytes == 0 {
            return Err(Error::invalid("DataParallel::new", "the bucket size must be positive (e.g. 25 MiB)"));
        }
        if let Some(e) = &experts {
            if e.size() == 0 || !replicas.size().is_multiple_of(e.size()) {
                return Err(Error::topology(
                    "DataParallel::with_experts",
                    format!(
                        "the experts' group ({} ranks) must divide the replicas ({} ranks): it is the data-parallel group inside them",
                        e.size(),
                        replicas.size()
                    ),
                ));
            }
        }
        // Parameters of other pipeline stages have no gradient here to
        // average; which are experts' only matters with an experts' group.
        let mut params: Vec<Param> = Vec::new();
        let mut is_expert: Vec<bool> = Vec::new();
        let mut tied = std::collections::HashSet::new();
        let mut seen = std::collections::HashMap::new();
        module::visit_params(model, |e| {
            if e.param.is_remote() {
                return Ok(());
            }
            match seen.get(&e.param.id()) {
                Some(&i) => {
                    tied.insert(i);
                }
                None => {
                    seen.insert(e.param.id(), params.len());
                    params.push(e.param.clone());
                    is_expert.push(experts.is_some() && e.expert.is_some());
                }
            }
            Ok(())
        })?;
        // Tied parameters first: buckets are cut from the last parameter,
        // so theirs come last, after every bucket the backward may send.
        let order: Vec<usize> = (0..params.len()).filter(|i| tied.contains(i)).chain((0..params.len()).filter(|i| !tied.contains(i))).collect();
        let params: Vec<Param> = order.iter().map(|&i| params[i].clone()).collect();
        let is_expert: Vec<bool> = order.iter().map(|&i| is_expert[i]).collect();
        let deferred = tied.len();
        let bytes: Vec<usize> = params.iter().map(|p| p.local_shape().elem_count() * p.value().map(|v| v.dtype().size_in_bytes()).unwrap_or(4)).collect();
        // Keys: shared 0, expert 1, tied 2 and 3.
        let keys: Vec<usize> = (0..params.len()).map(|i| usize::from(is_expert[i]) + if i < deferred { 2 } else { 0 }).collect();
        let buckets = Buckets::keyed(&bytes, &keys, bucket_bytes);
        let expert_bucket = buckets.iter().map(|m| is_expert[m[0]]).collect();
        let sent_during_backward = buckets.iter().take_while(|m| m[0] >= deferred).count();
        let state = State { ready: vec![false; params.len()], ..State::default() };
        let index = params.iter().enumerate().map(|(i, p)| (p.id(), i)).collect();
        Ok(DataParallel {
            replicas,
            experts,
            expert_bucket,
            sent_during_backward,
            compression: Compression::None,
            powersgd: None,
            params,
            index,
            buckets,
            state: Mutex::new(state),
        })
    }

    /// Sends gradients compressed as `compression`; an error for PowerSGD
    /// of rank 0.
    pub fn with_compression(mut self, compression: Compression) -> Result<Self> {
        self.powersgd = match compression {
            Compression::PowerSgd { rank, warmup } => Some(Mutex::new(PowerSgd::new(rank, warmup)?)),
            _ => None,
        };
        self.compression = compression;
        Ok(self)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// Flattens the next bucket's gradients (zeros for a parameter without
    /// one) and starts its all-reduce.
    fn launch(&self, s: &mut State) -> Result<()> {
        let b = s.launched;
        s.launched += 1;
        let grads: Vec<Tensor> = self.buckets.members(b).iter().map(|&i| grad_or_zeros(&self.params[i])).collect::<Result<_>>()?;
        let flat = Tensor::concat_flat(&grads.iter().collect::<Vec<_>>())?;
        let wire = match self.compression {
            Compression::Bf16 => flat.to_dtype(DType::BF16)?,
            Compression::None | Compression::PowerSgd { .. } => flat,
        };
        s.stats.bytes += wire.elem_count() * wire.dtype().size_in_bytes();
        s.stats.buckets += 1;
        let group = match &self.experts {
            Some(experts) if self.expert_bucket[b] => experts,
            _ => &self.replicas,
        };
        // Stamped before the call: the last rank in may finish the
        // collective inside it, and its span must still cover that work.
        let launched = Instant::now();
        let pending = group.all_reduce_sum_async(&wire)?;
        s.inflight.push(Inflight { bucket: b, pending, launched, done_at: None });
        Ok(())
    }

    /// Notes when all-reduces were first seen done (the end of a collective
    /// queued on a device, whose completion is not stamped).
    fn poll(s: &mut State) {
        let now = Instant::now();
        for b in s.inflight.iter_mut().filter(|b| b.done_at.is_none()) {
            if b.pending.is_done() {
                b.done_at = Some(now);
            }
        }
    }

    /// Sends the buckets not sent yet, waits for every all-reduce and writes
    /// each gradient back as the average over the group. Returns the step's
    /// measured communication figures and resets them for the next step.
    pub fn finish(&self) -> Result<SyncStats> {
        if let Some(powersgd) = &self.powersgd {
            let mut powersgd = powersgd.lock();
            if powersgd.compressing() {
                return self.finish_powersgd(&mut powersgd);
            }
            // Still warming up: this step goes whole, like `Compression::None`.
            powersgd.step();
        }
        let mut s = self.state();
        s.stats.launched_during_backward = s.stats.buckets;
        while s.launched < self.buckets.len() {
            self.launch(&mut s)?;
        }
        Self::poll(&mut s);
        // Every gradient is a sum over all replicas by now (an expert's
        // through the all-to-all and the experts' group).
        let scale = 1.0 / self.replicas.size() as f64;
        let mut spans = Vec::with_capacity(s.inflight.len());
        for b in std::mem::take(&mut s.inflight) {
            let started_wait = Instant::now();
            let (summed, stamped) = b.pending.wait_timed();
            let summed = summed?;
            let (end, exposed) = wait_span(started_wait, stamped.or(b.done_at));
            s.stats.exposed += exposed;
            spans.push((b.launched, end));
            let summed = if summed.dtype() == DType::F32 || summed.dtype() == DType::F64 { summed } else { summed.to_dtype(DType::F32)? };
            let mean = ops::scale(&summed, scale)?;
            let mut offset = 0;
            for &i in self.buckets.members(b.bucket) {
                let p = &self.params[i];
                let shape = p.local_shape();
                let n = shape.elem_count();
                let g = mean.narrow(0, offset, n)?.reshape(shape)?;
                set_averaged(p, g)?;
                offset += n;
            }
        }
        s.stats.comm = union_length(spans);
        s.ready.iter_mut().for_each(|r| *r = false);
        s.launched = 0;
        Ok(std::mem::take(&mut s.stats))
    }
}

impl DataParallel {
    /// [`finish`](Self::finish) with PowerSGD: every gradient, factored
    /// where that gains, summed over its group (the experts' over theirs)
    /// and averaged over the replicas.
    fn finish_powersgd(&self, powersgd: &mut PowerSgd) -> Result<SyncStats> {
        let started = Instant::now();
        let mut sent = Sent::default();
        let expert: Vec<bool> = {
            let mut e = vec![false; self.params.len()];
            for (b, &is) in self.expert_bucket.iter().enumerate() {
                for &i in self.buckets.members(b) {
                    e[i] = is;
                }
            }
            e
        };
        let scale = 1.0 / self.replicas.size() as f64;
        for experts in [false, true] {
            let group = match (&self.experts, experts) {
                (_, false) => &self.replicas,
                (Some(g), true) => g,
                (None, true) => continue,
            };
            let ids: Vec<usize> = (0..self.params.len()).filter(|&i| expert[i] == experts).collect();
            if ids.is_empty() {
                continue;
            }
            let params: Vec<Param> = ids.iter().map(|&i| self.params[i].clone()).collect();
            let grads: Vec<Tensor> = params.iter().map(grad_or_zeros).collect::<Result<_>>()?;
            let sums = powersgd.sum(&**group, &ids, &params, grads, scale, &mut sent)?;
            for (p, g) in params.iter().zip(sums) {
                set_averaged(p, g)?;
            }
        }
        powersgd.step();
        self.state().ready.iter_mut().for_each(|r| *r = false);
        // Nothing ran beside the backward: all of it was on the critical path.
        let comm = started.elapsed();
        Ok(SyncStats { buckets: sent.collectives, bytes: sent.bytes, launched_during_backward: 0, comm, exposed: comm })
    }
}

/// `p`'s gradient, or zeros for a parameter without one (every rank sends
/// the same parameters).
fn grad_or_zeros(p: &Param) -> Result<Tensor> {
    match p.grad() {
        Some(g) => Ok(g),
        None => {
            let v = p.value()?;
            Tensor::zeros(p.local_shape(), v.dtype(), v.device())
        }
    }
}

/// Replaces `p`'s gradient with the averaged `g`, in the gradient's dtype
/// (the parameter's when it had none).
fn set_averaged(p: &Param, g: Tensor) -> Result<()> {
    let dtype = p.grad().map(|g| g.dtype()).unwrap_or(p.value()?.dtype());
    p.set_grad(if g.dtype() == dtype { g } else { g.to_dtype(dtype)? })
}

impl Hooks for DataParallel {
    fn grad_ready(&self, param: &Param) -> Result<()> {
        if self.powersgd.as_ref().is_some_and(|p| p.lock().compressing()) {
            // The factors need every gradient: all of it goes in `finish`.
            return Ok(());
        }
        let mut s = self.state();
        Self::poll(&mut s);
        let Some(&i) = self.index.get(&param.id()) else {
            return Err(Error::state_mismatch(
                "DataParallel",
                format!("{param:?} is not a parameter of the model this engine was built for; build one engine per model"),
            ));
        };
        s.ready[i] = true;
        // Send every bucket, in order, whose gradients are all final.
        while s.launched < self.sent_during_backward && self.buckets.members(s.launched).iter().all(|&j| s.ready[j]) {
            self.launch(&mut s)?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DataParallel(replicas = {}, {} buckets, {:?})", self.replicas.size(), self.buckets.len(), self.compression)
    }
}

#[cfg(test)]
mod tests {
    use super::union_length;
    use std::time::{Duration, Instant};

    #[test]
    fn overlapping_spans_count_once() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // [0, 10] and [5, 20] overlap into [0, 20]; [30, 35] stands alone;
        // [31, 32] lies inside it.
        let spans = vec![(at(30), at(35)), (at(0), at(10)), (at(5), at(20)), (at(31), at(32))];
        assert_eq!(union_length(spans), Duration::from_millis(25));
        assert_eq!(union_length(Vec::new()), Duration::ZERO);
    }
}
