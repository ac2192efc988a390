//! Data parallelism: gradients bucketed in the order they become final and
//! all-reduced while the backward goes on.

use crate::dist::{Communicator, Pending};
use crate::error::{Error, Result};
use crate::module::{Hooks, Param};
use crate::ops;
use crate::tensor::{DType, Tensor};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

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
    /// Time the all-reduces were in flight, summed over buckets (from launch
    /// to the first moment they were seen complete).
    pub comm: Duration,
    /// Time `finish` spent blocked on unfinished all-reduces.
    pub exposed: Duration,
}

impl SyncStats {
    /// Communication time overlapped with computation.
    pub fn hidden(&self) -> Duration {
        self.comm.saturating_sub(self.exposed)
    }
}

struct Bucket {
    params: Vec<Param>,
    pending: Pending,
    launched: Instant,
    done_at: Option<Instant>,
}

#[derive(Default)]
struct State {
    open: Vec<Param>,
    open_bytes: usize,
    inflight: Vec<Bucket>,
    stats: SyncStats,
}

/// Averages gradients over the data-parallel group during the backward.
///
/// Install it as a [`Hooks`] on each rank's `Cx`: every parameter whose
/// gradient is final (announced by [`Cx::grad`](crate::module::Cx::grad),
/// roughly in reverse order of the forward) joins the open bucket; when the
/// bucket holds `bucket_bytes`, its gradients are flattened into one tensor
/// and all-reduced asynchronously while the backward continues. After the
/// backward, [`finish`](Self::finish) sends the last bucket, waits for all,
/// and writes every gradient back as the average over the replicas.
pub struct DataParallel {
    dp: Arc<dyn Communicator>,
    bucket_bytes: usize,
    compression: Compression,
    state: Mutex<State>,
}

impl DataParallel {
    /// Buckets of about `bucket_bytes` (25 MiB is a common choice) over the group `dp`.
    pub fn new(dp: Arc<dyn Communicator>, bucket_bytes: usize) -> Result<Self> {
        if bucket_bytes == 0 {
            return Err(Error::invalid("DataParallel::new", "the bucket size must be positive (e.g. 25 MiB)"));
        }
        Ok(DataParallel { dp, bucket_bytes, compression: Compression::None, state: Mutex::default() })
    }

    /// Sends gradients compressed as `compression`.
    pub fn with_compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Flattens the open bucket and starts its all-reduce.
    fn launch(&self, s: &mut State) -> Result<()> {
        if s.open.is_empty() {
            return Ok(());
        }
        let params = std::mem::take(&mut s.open);
        s.open_bytes = 0;
        let grads: Vec<Tensor> = params
            .iter()
            .map(|p| p.grad().ok_or_else(|| Error::invalid("DataParallel", format!("parameter {p:?} was announced without a gradient"))))
            .collect::<Result<_>>()?;
        let flat = Tensor::concat_flat(&grads.iter().collect::<Vec<_>>())?;
        let wire = match self.compression {
            Compression::None => flat,
            Compression::Bf16 => flat.to_dtype(DType::BF16)?,
        };
        s.stats.bytes += wire.elem_count() * wire.dtype().size_in_bytes();
        s.stats.buckets += 1;
        let pending = self.dp.all_reduce_sum_async(&wire)?;
        s.inflight.push(Bucket { params, pending, launched: Instant::now(), done_at: None });
        Ok(())
    }

    /// Notes the completion time of buckets that finished since the last look.
    fn poll(s: &mut State) {
        let now = Instant::now();
        for b in s.inflight.iter_mut().filter(|b| b.done_at.is_none()) {
            if b.pending.is_done() {
                b.done_at = Some(now);
            }
        }
    }

    /// Sends the last bucket, waits for every all-reduce and writes each
    /// gradient back as the average over the group. Returns the step's
    /// measured communication figures and resets them for the next step.
    pub fn finish(&self) -> Result<SyncStats> {
        let mut s = self.state();
        s.stats.launched_during_backward = s.stats.buckets;
        self.launch(&mut s)?;
        Self::poll(&mut s);
        let scale = 1.0 / self.dp.size() as f64;
        let buckets = std::mem::take(&mut s.inflight);
        for b in buckets {
            let started_wait = Instant::now();
            let already = b.done_at;
            let summed = b.pending.wait()?;
            let done = already.unwrap_or_else(Instant::now);
            if already.is_none() {
                s.stats.exposed += started_wait.elapsed();
            }
            s.stats.comm += done.saturating_duration_since(b.launched);
            let summed = if summed.dtype() == DType::F32 || summed.dtype() == DType::F64 { summed } else { summed.to_dtype(DType::F32)? };
            let mean = ops::scale(&summed, scale)?;
            let mut offset = 0;
            for p in &b.params {
                let shape = p.local_shape();
                let n = shape.elem_count();
                let g = mean.narrow(0, offset, n)?.reshape(shape)?;
                let g = match p.grad() {
                    Some(old) if old.dtype() != g.dtype() => g.to_dtype(old.dtype())?,
                    _ => g,
                };
                p.set_grad(g)?;
                offset += n;
            }
        }
        Ok(std::mem::take(&mut s.stats))
    }
}

impl Hooks for DataParallel {
    fn grad_ready(&self, param: &Param) -> Result<()> {
        let mut s = self.state();
        Self::poll(&mut s);
        let bytes = param.grad().map(|g| g.elem_count() * g.dtype().size_in_bytes()).unwrap_or(0);
        s.open.push(param.clone());
        s.open_bytes += bytes;
        if s.open_bytes >= self.bucket_bytes {
            self.launch(&mut s)?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DataParallel(dp = {}, bucket {} bytes, {:?})", self.dp.size(), self.bucket_bytes, self.compression)
    }
}
