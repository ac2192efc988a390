//! The deterministic, data-parallel training sampler.
//!
//! The dataset is cut into *windows*: window `k` of a shard is its tokens
//! `k*T ..= k*T + T` (`T + 1` tokens: `T` inputs, and the same shifted by one as
//! next-token targets). Windows never cross a shard boundary; a shard's last
//! `< T` tokens are not used.
//!
//! Each epoch visits every window once, in an order drawn from `(seed, epoch)`
//! by a Fisher–Yates shuffle over Philox random numbers (the same on every
//! platform and run). Consecutive runs of `global_batch` windows of that order
//! form the global batches; data-parallel rank `r` of `dp` takes rows
//! `r*B/dp .. (r+1)*B/dp` of each, so the ranks' parts are disjoint and
//! together are exactly the batch a single rank would see. An epoch's last
//! incomplete batch is dropped.
//!
//! Where the sampler stands is a [`Cursor`] (epoch, position in the epoch's
//! order, excluded windows), small and serialisable: save it in a
//! checkpoint's `extra` JSON and [`Sampler::restore`] it to see exactly the
//! batches the uninterrupted run would have seen. The position counts windows,
//! not batches, and does not depend on `dp`, so a run can resume on another
//! number of ranks.
//!
//! Data that made training unstable can be passed over: [`Sampler::skip_batches`]
//! steps past the next batches, and [`Sampler::exclude`] /
//! [`Sampler::exclude_last_batch`] / [`Sampler::exclude_since`] remove
//! windows for the rest of the run (in every later epoch too). All are
//! recorded in the cursor.

use super::Dataset;
use serde::{Deserialize, Serialize};
use tessera_core::{Device, RngKey, Tensor};
use tessera_core::{Error, Result};

/// One window: `shard` and its window number there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Window {
    /// The shard.
    pub shard: usize,
    /// The window's number in the shard: it starts at token `index * T`.
    pub index: u64,
}

/// The windows `start..end` of one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowRange {
    /// The shard.
    pub shard: usize,
    /// The first window of the range.
    pub start: u64,
    /// One past the last window of the range.
    pub end: u64,
}

impl WindowRange {
    /// Every window of `shard`.
    pub fn whole_shard(shard: usize) -> Self {
        Self { shard, start: 0, end: u64::MAX }
    }

    /// Whether `w` is in the range.
    pub fn contains(&self, w: Window) -> bool {
        w.shard == self.shard && (self.start..self.end).contains(&w.index)
    }
}

/// Positions `start..end` of epoch `epoch`'s window order: the windows a
/// stretch of training drew (see [`Sampler::exclude_since`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderSpan {
    /// The epoch whose order is meant.
    pub epoch: u64,
    /// The first position.
    pub start: u64,
    /// One past the last position.
    pub end: u64,
}

/// Where a [`Sampler`] stands: everything needed to continue exactly.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    /// The seed of the shuffle (checked on restore).
    pub seed: u64,
    /// How many windows an epoch has (checked on restore: another dataset or
    /// sequence length gives another count).
    pub windows: u64,
    /// The current epoch.
    pub epoch: u64,
    /// How many windows of this epoch's order have been consumed.
    pub position: u64,
    /// How many global batches were skipped with [`Sampler::skip_batches`].
    pub skipped_batches: u64,
    /// Windows never served again.
    pub excluded: Vec<WindowRange>,
    /// Global batches served so far, over every epoch.
    #[serde(default)]
    pub served: u64,
    /// The windows drawn in these stretches are never served again either.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub excluded_spans: Vec<OrderSpan>,
}

impl Cursor {
    /// The cursor as JSON, e.g. for a checkpoint's `extra` value.
    pub fn to_json(&self) -> Result<serde_json::Value> {
        serde_json::to_value(self).map_err(|e| Error::Data(format!("serialising a sampler cursor: {e}")))
    }

    /// A cursor from the JSON [`Cursor::to_json`] wrote.
    pub fn from_json(value: &serde_json::Value) -> Result<Self> {
        Cursor::deserialize(value).map_err(|e| Error::Data(format!("not a sampler cursor ({e}); pass the value `Cursor::to_json` wrote")))
    }
}

/// Training batches from a [`Dataset`], split over data-parallel ranks, resumable.
pub struct Sampler {
    data: Dataset,
    seq: usize,
    global_batch: usize,
    rank: usize,
    rows: usize,
    /// `first_window[s]` is the global number of shard `s`'s window 0; one more entry holds the total.
    first_window: Vec<u64>,
    /// The window order of epoch `order_epoch` (global window numbers).
    order: Vec<u64>,
    order_epoch: Option<u64>,
    cursor: Cursor,
    last: Vec<Window>,
    /// The global window numbers `cursor.excluded_spans` cover.
    span_windows: std::collections::HashSet<u64>,
}

impl Sampler {
    /// A sampler of `global_batch` windows of `seq` tokens per step, of which
    /// rank `dp_rank` of `dp_size` gets `global_batch / dp_size`, shuffled by `seed`.
    pub fn new(data: &Dataset, global_batch: usize, seq: usize, dp_rank: usize, dp_size: usize, seed: u64) -> Result<Self> {
        if seq == 0 || global_batch == 0 {
            return Err(Error::Data(format!("a batch of {global_batch} sequences of {seq} tokens is empty; both must be positive")));
        }
        if dp_size == 0 || dp_rank >= dp_size {
            return Err(Error::Data(format!("data-parallel rank {dp_rank} of {dp_size} does not exist; the rank must be below a positive size")));
        }
        if !global_batch.is_multiple_of(dp_size) {
            return Err(Error::Data(format!(
                "a global batch of {global_batch} sequences does not split evenly over {dp_size} data-parallel ranks; use a multiple of {dp_size}"
            )));
        }
        let mut first_window = Vec::with_capacity(data.shard_count() + 1);
        let mut total = 0u64;
        for shard in 0..data.shard_count() {
            first_window.push(total);
            total += data.shard_tokens(shard).saturating_sub(1) / seq as u64;
        }
        first_window.push(total);
        if total < global_batch as u64 {
            return Err(Error::Data(format!(
                "the dataset in `{}` holds {total} windows of {} tokens, fewer than one global batch of {global_batch}; lower the batch or the sequence length, or add data",
                data.dir().display(),
                seq + 1
            )));
        }
        let cursor = Cursor { seed, windows: total, epoch: 0, position: 0, skipped_batches: 0, excluded: Vec::new(), served: 0, excluded_spans: Vec::new() };
        Ok(Self {
            data: data.clone(),
            seq,
            global_batch,
            rank: dp_rank,
            rows: global_batch / dp_size,
            first_window,
            order: Vec::new(),
            order_epoch: None,
            cursor,
            last: Vec::new(),
            span_windows: Default::default(),
        })
    }

    /// This rank's next batch: input ids and next-token targets, both `u32` of shape `[rows, seq]`.
    pub fn next_batch(&mut self, device: &Device) -> Result<(Tensor, Tensor)> {
        let (inputs, targets) = self.next_ids()?;
        Ok((Tensor::from_vec(inputs, [self.rows, self.seq], device)?, Tensor::from_vec(targets, [self.rows, self.seq], device)?))
    }

    /// [`Sampler::next_batch`] on the host: row-major ids and targets, `rows * seq` each.
    pub fn next_ids(&mut self) -> Result<(Vec<u32>, Vec<u32>)> {
        let before = self.cursor.clone();
        let windows = self.next_windows()?;
        let (inputs, targets) = match self.read(&windows[self.rank * self.rows..(self.rank + 1) * self.rows]) {
            Ok(batch) => batch,
            Err(e) => {
                self.cursor = before;
                return Err(e);
            }
        };
        self.last = windows;
        self.cursor.served += 1;
        Ok((inputs, targets))
    }

    /// Steps past the next `n` global batches without reading them.
    pub fn skip_batches(&mut self, n: u64) -> Result<()> {
        for _ in 0..n {
            self.next_windows()?;
            self.cursor.skipped_batches += 1;
        }
        Ok(())
    }

    /// Never serves the windows of `range` again (in this epoch or later ones).
    pub fn exclude(&mut self, range: WindowRange) -> Result<()> {
        if range.shard >= self.data.shard_count() || range.start >= range.end {
            return Err(Error::Data(format!(
                "cannot exclude windows {}..{} of shard {}: the dataset has {} shards and a range must not be empty",
                range.start,
                range.end,
                range.shard,
                self.data.shard_count()
            )));
        }
        if self.cursor.excluded.contains(&range) {
            return Ok(());
        }
        let mut excluded = self.cursor.excluded.clone();
        excluded.push(range);
        let left = self.available(&excluded);
        if left < self.global_batch as u64 {
            return Err(Error::Data(format!(
                "excluding windows {}..{} of shard {} would leave {left} windows, fewer than one global batch of {}; exclude less data",
                range.start, range.end, range.shard, self.global_batch
            )));
        }
        self.cursor.excluded = excluded;
        Ok(())
    }

    /// Never serves again the windows drawn since `since` (a cursor of this
    /// sampler from earlier in the run), and keeps its place: the rollback
    /// after a loss spike, which returns the model to the checkpoint that
    /// saved `since` and passes over the data trained on since, in this
    /// epoch and every later one. Counts the batches passed over as skipped.
    pub fn exclude_since(&mut self, since: &Cursor) -> Result<()> {
        self.check(since)?;
        let (from, to) = ((since.epoch, since.position), (self.cursor.epoch, self.cursor.position));
        if from > to {
            return Err(Error::Data(format!(
                "cannot exclude the data since epoch {} position {}: the sampler stands before it, at epoch {} position {}",
                from.0, from.1, to.0, to.1
            )));
        }
        let windows = self.cursor.windows;
        let mut spans = Vec::new();
        for epoch in from.0..=to.0 {
            let start = if epoch == from.0 { from.1 } else { 0 };
            let end = if epoch == to.0 { to.1 } else { windows };
            if start < end {
                spans.push(OrderSpan { epoch, start, end });
            }
        }
        let mut all = self.cursor.excluded_spans.clone();
        all.extend(spans.into_iter().filter(|s| !self.cursor.excluded_spans.contains(s)));
        let covered = self.windows_of(&all);
        let left = self.available_with(&self.cursor.excluded, &covered);
        if left < self.global_batch as u64 {
            return Err(Error::Data(format!(
                "passing over the data drawn since epoch {} position {} for good would leave {left} windows, fewer than one global batch of {}; add data, or checkpoint more often so that a rollback passes over less",
                from.0, from.1, self.global_batch
            )));
        }
        self.cursor.skipped_batches += self.cursor.served.saturating_sub(since.served);
        self.cursor.excluded_spans = all;
        self.span_windows = covered;
        Ok(())
    }

    /// Excludes every window of the last global batch (all ranks' rows): the
    /// data behind a loss spike, once the spike is seen.
    pub fn exclude_last_batch(&mut self) -> Result<()> {
        for w in self.last.clone() {
            self.exclude(WindowRange { shard: w.shard, start: w.index, end: w.index + 1 })?;
        }
        Ok(())
    }

    /// The windows of the last global batch [`Sampler::next_batch`] returned, rank 0's rows first.
    pub fn last_batch(&self) -> &[Window] {
        &self.last
    }

    /// Where the sampler stands.
    pub fn cursor(&self) -> Cursor {
        self.cursor.clone()
    }

    /// Continues from `cursor` exactly: the batches that follow are those the
    /// run that saved it saw next.
    pub fn restore(&mut self, cursor: Cursor) -> Result<()> {
        self.check(&cursor)?;
        self.span_windows = self.windows_of(&cursor.excluded_spans);
        self.cursor = cursor;
        self.last.clear();
        Ok(())
    }

    /// Goes back to `cursor`'s position while keeping the windows excluded
    /// and the skip count since: the rollback after a loss spike (exclude the
    /// bad batch, reload the last healthy checkpoint, rewind to its cursor).
    pub fn rewind(&mut self, cursor: Cursor) -> Result<()> {
        self.check(&cursor)?;
        let mut excluded = cursor.excluded.clone();
        excluded.extend(self.cursor.excluded.iter().filter(|r| !cursor.excluded.contains(r)));
        let mut spans = cursor.excluded_spans.clone();
        spans.extend(self.cursor.excluded_spans.iter().filter(|s| !cursor.excluded_spans.contains(s)));
        self.span_windows = self.windows_of(&spans);
        self.cursor = Cursor { excluded, excluded_spans: spans, skipped_batches: self.cursor.skipped_batches.max(cursor.skipped_batches), ..cursor };
        self.last.clear();
        Ok(())
    }

    /// How many windows an epoch has (before exclusions).
    pub fn windows_per_epoch(&self) -> u64 {
        self.cursor.windows
    }

    /// How many rows of each global batch this rank gets.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Tokens per row.
    pub fn seq(&self) -> usize {
        self.seq
    }

    fn check(&self, cursor: &Cursor) -> Result<()> {
        if cursor.seed != self.cursor.seed || cursor.windows != self.cursor.windows {
            return Err(Error::Data(format!(
                "the cursor was saved by a sampler with seed {} over {} windows, this one has seed {} and {} windows; resume with the same dataset, sequence length and seed",
                cursor.seed, cursor.windows, self.cursor.seed, self.cursor.windows
            )));
        }
        if cursor.position > cursor.windows {
            return Err(Error::Data(format!("the cursor's position {} is past the epoch's {} windows; it is damaged", cursor.position, cursor.windows)));
        }
        if let Some(r) = cursor.excluded.iter().find(|r| r.shard >= self.data.shard_count()) {
            return Err(Error::Data(format!(
                "the cursor excludes shard {}, but the dataset has {} shards; resume with the same dataset",
                r.shard,
                self.data.shard_count()
            )));
        }
        if let Some(s) = cursor.excluded_spans.iter().find(|s| s.start > s.end || s.end > cursor.windows) {
            return Err(Error::Data(format!(
                "the cursor excludes positions {}..{} of epoch {}, outside its {} windows; it is damaged",
                s.start, s.end, s.epoch, cursor.windows
            )));
        }
        Ok(())
    }

    /// The next global batch's windows; advances the cursor (to the next epoch when this one runs out).
    fn next_windows(&mut self) -> Result<Vec<Window>> {
        let total = self.cursor.windows;
        let mut fresh_epoch = self.cursor.position == 0;
        loop {
            self.ensure_order();
            let mut picked = Vec::with_capacity(self.global_batch);
            let mut position = self.cursor.position;
            while picked.len() < self.global_batch && position < total {
                let global = self.order[position as usize];
                let w = self.window(global);
                position += 1;
                if !self.span_windows.contains(&global) && !self.cursor.excluded.iter().any(|r| r.contains(w)) {
                    picked.push(w);
                }
            }
            if picked.len() == self.global_batch {
                self.cursor.position = position;
                return Ok(picked);
            }
            if fresh_epoch {
                return Err(Error::Data(format!("fewer than {} windows are left after exclusions; exclude less data", self.global_batch)));
            }
            self.cursor.epoch += 1;
            self.cursor.position = 0;
            fresh_epoch = true;
        }
    }

    /// Shuffles the window order of the cursor's epoch, unless it is at hand.
    fn ensure_order(&mut self) {
        if self.order_epoch == Some(self.cursor.epoch) {
            return;
        }
        self.order = order_of(self.cursor.seed, self.cursor.epoch, self.cursor.windows);
        self.order_epoch = Some(self.cursor.epoch);
    }

    /// The global window numbers at the positions `spans` cover.
    fn windows_of(&self, spans: &[OrderSpan]) -> std::collections::HashSet<u64> {
        let mut out = std::collections::HashSet::new();
        let mut epochs: Vec<u64> = spans.iter().map(|s| s.epoch).collect();
        epochs.sort_unstable();
        epochs.dedup();
        for epoch in epochs {
            let order = if self.order_epoch == Some(epoch) {
                std::borrow::Cow::Borrowed(&self.order)
            } else {
                std::borrow::Cow::Owned(order_of(self.cursor.seed, epoch, self.cursor.windows))
            };
            for s in spans.iter().filter(|s| s.epoch == epoch) {
                out.extend(order[s.start as usize..s.end.min(self.cursor.windows) as usize].iter().copied());
            }
        }
        out
    }

    fn window(&self, global: u64) -> Window {
        let shard = self.first_window.partition_point(|&first| first <= global) - 1;
        Window { shard, index: global - self.first_window[shard] }
    }

    /// How many windows are not in `excluded` nor among the span windows.
    fn available(&self, excluded: &[WindowRange]) -> u64 {
        self.available_with(excluded, &self.span_windows)
    }

    /// How many windows are not in `excluded` nor in `spans`.
    fn available_with(&self, excluded: &[WindowRange], spans: &std::collections::HashSet<u64>) -> u64 {
        let in_ranges = |g: u64| {
            let w = self.window(g);
            excluded.iter().any(|r| r.contains(w))
        };
        let mut left = self.cursor.windows - spans.iter().filter(|&&g| !in_ranges(g)).count() as u64;
        for shard in 0..self.data.shard_count() {
            let count = self.first_window[shard + 1] - self.first_window[shard];
            let mut ranges: Vec<(u64, u64)> = excluded.iter().filter(|r| r.shard == shard).map(|r| (r.start.min(count), r.end.min(count))).collect();
            ranges.sort_unstable();
            let mut covered_to = 0;
            for (start, end) in ranges {
                let start = start.max(covered_to);
                if end > start {
                    left -= end - start;
                    covered_to = end;
                }
            }
        }
        left
    }

    fn read(&self, windows: &[Window]) -> Result<(Vec<u32>, Vec<u32>)> {
        let mut inputs = Vec::with_capacity(windows.len() * self.seq);
        let mut targets = Vec::with_capacity(windows.len() * self.seq);
        let mut buf = vec![0u32; self.seq + 1];
        for w in windows {
            self.data.read(w.shard, w.index * self.seq as u64, &mut buf)?;
            inputs.extend_from_slice(&buf[..self.seq]);
            targets.extend_from_slice(&buf[1..]);
        }
        Ok((inputs, targets))
    }
}

/// The window order of `epoch`: a Fisher–Yates shuffle of `0..windows`
/// driven by Philox keyed by `(seed, epoch)`.
fn order_of(seed: u64, epoch: u64, windows: u64) -> Vec<u64> {
    let key = RngKey::new(seed, epoch);
    let mut order: Vec<u64> = (0..windows).collect();
    for i in (1..order.len()).rev() {
        let bits = (key.bits_at(2 * i as u64) as u64) << 32 | key.bits_at(2 * i as u64 + 1) as u64;
        // A 64-bit draw scaled to 0..=i (Lemire's multiply-shift).
        let j = ((bits as u128 * (i as u128 + 1)) >> 64) as usize;
        order.swap(i, j);
    }
    order
}
