//! Gradients averaged over the group: stage 1 through the data-parallel
//! engine's all-reduce; stages 2 and 3 packed into the fixed buckets as
//! they become final and reduce-scattered, each rank keeping its shard.

use super::layout::{flat_view, Entry};
use super::state::{Bucket, State};
use super::Zero;
use std::collections::HashMap;
use tessera_core::tensor::Tensor;
use tessera_core::{ops, Error, Result};

impl Zero {
    /// Averages the gradients over the group: waits for every bucket started
    /// during the backward, after reducing the rest. Stage 1 writes the
    /// averages back into the parameters' gradients; stages 2 and 3 keep
    /// only this rank's shard of them and drop the full gradients.
    ///
    /// [`step`](Self::step) calls it when the caller has not.
    pub fn finish(&self) -> Result<()> {
        let mut s = self.state();
        self.finish_locked(&mut s)
    }

    pub(super) fn finish_locked(&self, s: &mut State) -> Result<()> {
        if let Some(dp) = &self.all_reduce {
            let st = dp.finish()?;
            s.last_sync = st;
            s.stats.grad_buckets += st.buckets;
            s.stats.grad_buckets_during_backward += st.launched_during_backward;
            if let Some(e) = self.flat.entries.iter().find(|e| e.param.grad().is_none()) {
                return Err(self.missing_grad(e));
            }
            s.synced = true;
            return Ok(());
        }
        s.stats.grad_buckets_during_backward += s.inflight.len();
        s.sync.launched_during_backward = s.inflight.len();
        // Buckets not sent yet (gradients complete but never announced, or
        // never final) go now, each whole, in the fixed order.
        for members in self.buckets.iter() {
            if members.iter().all(|&i| s.packed[i]) {
                continue;
            }
            if let Some(&i) = members.iter().find(|&&i| self.flat.entries[i].param.grad().is_none()) {
                return Err(self.missing_grad(&self.flat.entries[i]));
            }
            s.open = members.to_vec();
            self.launch(s)?;
        }
        let scale = 1.0 / self.flat.layout.ranks as f64;
        let base = self.rank * self.flat.layout.shard_len;
        let mut pieces: Vec<(usize, Tensor)> = Vec::new();
        let mut spans = Vec::with_capacity(s.inflight.len());
        for b in std::mem::take(&mut s.inflight) {
            let started_wait = std::time::Instant::now();
            let (summed, stamped) = b.pending.wait_timed();
            let summed = summed?;
            let (end, exposed) = crate::data::wait_span(started_wait, stamped);
            s.sync.exposed += exposed;
            spans.push((b.launched, end));
            let mine: usize = b.rows.rows[self.rank].iter().map(|p| p.len).sum();
            let mean = ops::scale(&flat_view(&summed)?.narrow(0, b.my_start, mine)?, scale)?;
            drop(summed);
            let mut at = 0;
            for p in &b.rows.rows[self.rank] {
                pieces.push((self.flat.entries[p.entry].offset + p.start - base, mean.narrow(0, at, p.len)?));
                at += p.len;
            }
        }
        pieces.sort_by_key(|(o, _)| *o);
        let mut parts = Vec::with_capacity(pieces.len() + 1);
        let mut at = 0;
        for (o, t) in pieces {
            if o != at {
                return Err(Error::state_mismatch(
                    "Zero::finish",
                    format!(
                        "gradient pieces of shard {} do not tile it (gap at {at}, next piece at {o}); a parameter was reduced twice or not at all",
                        self.rank
                    ),
                ));
            }
            at += t.elem_count();
            parts.push(t);
        }
        s.sync.comm = crate::data::union_length(spans);
        s.last_sync = std::mem::take(&mut s.sync);
        let shard = self.flat.padded_concat(parts, self.flat.layout.shard_len)?;
        s.grad_shard = Some(self.sum_shared_over_experts(shard)?);
        s.packed.iter_mut().for_each(|p| *p = false);
        s.ready.iter_mut().for_each(|r| *r = false);
        Ok(())
    }

    /// With expert parallelism, completes this rank's averaged gradient
    /// shard (a mean over the data-parallel group): the pieces of
    /// parameters every expert-parallel rank holds are summed over the
    /// expert-parallel group (the shard has the same layout on each, since
    /// the ranks hold the same number of experts of the same shapes), and
    /// everything is divided by its size, so the shard is a mean over all
    /// dp × ep replicas.
    fn sum_shared_over_experts(&self, shard: Tensor) -> Result<Tensor> {
        let Some((ep, is_expert)) = &self.experts else { return Ok(shard) };
        if ep.size() == 1 {
            return Ok(shard);
        }
        let range = self.flat.layout.shard_range(self.rank);
        let pieces = self.flat.pieces_in(range.clone());
        let at = |p: &super::layout::Piece| self.flat.entries[p.entry].offset + p.start - range.start;
        let shared: Vec<Tensor> = pieces.iter().filter(|p| !is_expert[p.entry]).map(|p| shard.narrow(0, at(p), p.len)).collect::<Result<_>>()?;
        let summed = if shared.is_empty() { None } else { Some(ep.all_reduce_sum(&Tensor::concat_flat(&shared.iter().collect::<Vec<_>>())?)?) };
        drop(shared);
        let mut parts = Vec::with_capacity(pieces.len());
        let mut taken = 0;
        for p in &pieces {
            parts.push(match &summed {
                Some(summed) if !is_expert[p.entry] => {
                    taken += p.len;
                    summed.narrow(0, taken - p.len, p.len)?
                }
                _ => shard.narrow(0, at(p), p.len)?,
            });
        }
        let whole = self.flat.padded_concat(parts, range.len())?;
        ops::scale(&whole, 1.0 / ep.size() as f64)
    }

    pub(super) fn missing_grad(&self, e: &Entry) -> Error {
        Error::unsupported(
            "Zero::finish",
            format!(
                "parameter `{}` has no gradient this step; ZeRO updates every parameter from its averaged gradient, so every parameter must take part in the forward and backward on every rank (run the backward before the step, or leave unused parameters out of the model)",
                e.name
            ),
        )
    }

    /// Packs the open bucket (stages 2 and 3) and starts its reduce-scatter;
    /// drops the full gradients it packed.
    pub(super) fn launch(&self, s: &mut State) -> Result<()> {
        if s.open.is_empty() {
            return Ok(());
        }
        let ids = std::mem::take(&mut s.open);
        let rows = self.flat.rows(&ids);
        let grads: HashMap<usize, Tensor> = ids
            .iter()
            .map(|&i| {
                let e = &self.flat.entries[i];
                let g = e.param.grad().ok_or_else(|| self.missing_grad(e))?;
                let g = if g.dtype() == self.flat.dtype { g } else { g.to_dtype(self.flat.dtype)? };
                Ok((i, flat_view(&g)?))
            })
            .collect::<Result<_>>()?;
        // A reduce-scatter needs rows of equal width: when the bucket's
        // elements fall unevenly among the shards, the padding would cost
        // more than an all-reduce of the bucket (2(N-1)/N of its length per
        // rank, against (N-1)/N of N rows), so the bucket is all-reduced.
        let total: usize = rows.rows.iter().flatten().map(|p| p.len).sum();
        let scatter = rows.width * self.flat.layout.ranks <= 2 * total;
        let mut parts = Vec::new();
        let mut my_start = 0;
        for (r, row) in rows.rows.iter().enumerate() {
            let mut len = 0;
            for p in row {
                parts.push(grads[&p.entry].narrow(0, p.start, p.len)?);
                len += p.len;
            }
            if scatter && len < rows.width {
                parts.push(Tensor::zeros([rows.width - len], self.flat.dtype, &self.flat.device)?);
            }
            if !scatter && r < self.rank {
                my_start += len;
            }
        }
        let packed = Tensor::concat_flat(&parts.iter().collect::<Vec<_>>())?;
        drop(parts);
        drop(grads);
        for &i in &ids {
            self.flat.entries[i].param.take_grad();
            s.packed[i] = true;
        }
        let packed_bytes = packed.elem_count() * packed.dtype().size_in_bytes();
        // Stamped before the call, which may finish the collective (see DataParallel).
        let launched = std::time::Instant::now();
        let pending = if scatter { self.dp.reduce_scatter_sum_async(&packed, 0)? } else { self.dp.all_reduce_sum_async(&packed)? };
        s.stats.grad_buckets += 1;
        s.sync.buckets += 1;
        s.sync.bytes += packed_bytes;
        s.inflight.push(Bucket { rows, my_start, pending, launched });
        Ok(())
    }
}
