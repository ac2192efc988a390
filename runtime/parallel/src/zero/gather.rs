//! Stage 3: each sub-module's parameters gathered from their shards right
//! before it runs and freed right after, the next one prefetched while the
//! current one computes.

use super::layout::Rows;
use super::state::{Params, State};
use super::{Stage, Zero};
use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};
use tessera_dist::Pending;

impl Zero {
    /// Stage 3: gathers the parameters of the sub-module at `path` (owned
    /// by it directly; `""` for the model's root, whose parameters stay
    /// gathered anyway) for a run that no sub-module call announces, such as
    /// a layer called directly. Pair it with [`release_for`](Self::release_for).
    /// Other stages hold every parameter already, except with offload
    /// between an update and the first use, which this gathers.
    pub fn gather_for(&self, path: &str) -> Result<()> {
        if self.stage != Stage::Three {
            // With offload, values out of date since the last update are
            // gathered; otherwise every value is current.
            let all: Vec<usize>;
            let ids = match self.unit_of_path.get(path) {
                Some(&u) => &self.units[u].entries,
                None if path.is_empty() => {
                    all = (0..self.flat.entries.len()).collect();
                    &all
                }
                None => return Err(self.unknown_path(path)),
            };
            return self.refresh(ids);
        }
        if path.is_empty() {
            return self.acquire_entries(&(0..self.flat.entries.len()).collect::<Vec<_>>());
        }
        match self.unit_of_path.get(path) {
            Some(&u) => self.acquire(u),
            None => Err(self.unknown_path(path)),
        }
    }

    /// Stage 3: frees what [`gather_for`](Self::gather_for) gathered.
    pub fn release_for(&self, path: &str) -> Result<()> {
        if self.stage != Stage::Three {
            return Ok(());
        }
        if path.is_empty() {
            self.release_entries(&(0..self.flat.entries.len()).collect::<Vec<_>>());
            return Ok(());
        }
        match self.unit_of_path.get(path) {
            Some(&u) => {
                self.release_entries(&self.units[u].entries);
                Ok(())
            }
            None => Err(self.unknown_path(path)),
        }
    }

    fn unknown_path(&self, path: &str) -> Error {
        Error::invalid(
            "Zero::gather_for",
            format!("no sub-module at `{path}` owns parameters; pass one of {:?}, or \"\" for the whole model", self.gathered_paths()),
        )
    }

    /// This rank's row of a gather of `rows`, on the device: cut from the
    /// shard, or with offload from the host master copy once the update
    /// under way has passed it (and copied over in the held dtype).
    fn my_row(&self, s: &State, rows: &Rows) -> Result<Tensor> {
        let base = self.rank * self.flat.layout.shard_len;
        let mine = &rows.rows[self.rank];
        let at = |p: &super::layout::Piece| self.flat.entries[p.entry].offset + p.start - base;
        let shard = match &s.params {
            Params::Shard(shard) => shard,
            Params::Offloaded => {
                let master = s.master.as_ref().expect("offload keeps the master copy");
                if let Some(update) = &s.update {
                    update.wait_for(mine.iter().map(|p| at(p) + p.len).max().unwrap_or(0))?;
                }
                // Each piece copied out on its own (in the held dtype): the
                // worker may be writing further on in the same storage, and
                // one read lock at a time never waits on it twice. Joined
                // on the host, then one copy to the device.
                let mut parts: Vec<Tensor> = mine.iter().map(|p| master.narrow(0, at(p), p.len)?.to_dtype(self.flat.dtype)).collect::<Result<_>>()?;
                let have: usize = mine.iter().map(|p| p.len).sum();
                if have < rows.width {
                    parts.push(Tensor::zeros([rows.width - have], self.flat.dtype, master.device())?);
                }
                return Tensor::concat_flat(&parts.iter().collect::<Vec<_>>())?.to_device(&self.flat.device);
            }
            Params::Flat(_) => unreachable!("only stage 3 and offload gather rows"),
        };
        let parts: Vec<Tensor> = mine.iter().map(|p| shard.narrow(0, at(p), p.len)).collect::<Result<_>>()?;
        self.flat.padded_concat(parts, rows.width)
    }

    /// Stages 1 and 2 with offload: gathers those of `ids` whose values
    /// await the last update (each rank calls it at the same points, from
    /// the same hooks).
    fn refresh(&self, ids: &[usize]) -> Result<()> {
        let mut s = self.state();
        let stale: Vec<usize> = ids.iter().copied().filter(|&i| s.stale[i]).collect();
        if stale.is_empty() {
            return Ok(());
        }
        let gathered = self.gather_now(&s, &stale)?;
        self.install(&stale, gathered)?;
        for i in stale {
            s.stale[i] = false;
        }
        s.stats.gathers += 1;
        Ok(())
    }

    /// Stage 3: starts gathering the parameters `ids`.
    fn gather_async(&self, s: &State, ids: &[usize]) -> Result<Pending> {
        let rows = self.flat.rows(ids);
        let row = self.my_row(s, &rows)?;
        self.dp.all_gather_async(&row, 0)
    }

    /// Stage 3: gathers the parameters `ids` now.
    pub(super) fn gather_now(&self, s: &State, ids: &[usize]) -> Result<Tensor> {
        self.gather_async(s, ids)?.wait()
    }

    /// Stage 3: sets the values of `ids` from their gathered rows.
    pub(super) fn install(&self, ids: &[usize], gathered: Tensor) -> Result<()> {
        let rows = self.flat.rows(ids);
        for &i in ids {
            let mut parts = Vec::new();
            for (r, row) in rows.rows.iter().enumerate() {
                let mut at = r * rows.width;
                for p in row {
                    if p.entry == i {
                        parts.push(gathered.narrow(0, at, p.len)?);
                    }
                    at += p.len;
                }
            }
            let e = &self.flat.entries[i];
            let value = Tensor::concat_flat(&parts.iter().collect::<Vec<_>>())?.reshape(e.shape.clone())?;
            e.param.set_value(value)?;
        }
        Ok(())
    }

    /// Stage 3: gathers unit `u` (from its prefetch if one was started) and
    /// starts prefetching the unit expected next.
    fn acquire(&self, u: usize) -> Result<()> {
        let mut s = self.state();
        let ids = &self.units[u].entries;
        s.stats.gathers += 1;
        let prefetched = match s.prefetch.take() {
            Some((pu, pending)) if pu == u => {
                s.stats.prefetched += 1;
                Some(pending.wait()?)
            }
            Some((_, pending)) => {
                // Off the recorded order: the prefetch was issued on every
                // rank, so complete it, but use it no more this step.
                pending.wait()?;
                s.on_track = false;
                None
            }
            None => None,
        };
        let gathered = match prefetched {
            Some(g) => g,
            None => self.gather_now(&s, ids)?,
        };
        self.install(ids, gathered)?;
        for &i in ids {
            s.held[i] += 1;
        }
        if s.recording {
            s.order.push(u);
        } else if s.on_track && s.order.get(s.cursor) == Some(&u) {
            s.cursor += 1;
            if self.config.prefetch {
                if let Some(&next) = s.order.get(s.cursor) {
                    let pending = self.gather_async(&s, &self.units[next].entries)?;
                    s.prefetch = Some((next, pending));
                }
            }
        } else {
            s.on_track = false;
        }
        Ok(())
    }

    /// Stage 3: gathers the parameters `ids` for a run announced by the caller.
    fn acquire_entries(&self, ids: &[usize]) -> Result<()> {
        let mut s = self.state();
        if let Some((_, pending)) = s.prefetch.take() {
            pending.wait()?;
            s.on_track = false;
        }
        let gathered = self.gather_now(&s, ids)?;
        self.install(ids, gathered)?;
        for &i in ids {
            s.held[i] += 1;
        }
        Ok(())
    }

    /// Stage 3: one run no longer needs `ids`; frees those no run holds.
    fn release_entries(&self, ids: &[usize]) {
        let mut s = self.state();
        for &i in ids {
            s.held[i] = s.held[i].saturating_sub(1);
            if s.held[i] == 0 && !self.persistent.contains(&i) {
                self.flat.entries[i].param.free_value();
            }
        }
    }

    pub(super) fn on_enter(&self, path: &str) -> Result<()> {
        match self.unit_of_path.get(path) {
            Some(&u) if self.stage == Stage::Three => self.acquire(u),
            Some(&u) => self.refresh(&self.units[u].entries),
            None => Ok(()),
        }
    }

    pub(super) fn on_exit(&self, path: &str) {
        if let (Some(&u), Stage::Three) = (self.unit_of_path.get(path), self.stage) {
            self.release_entries(&self.units[u].entries);
        }
    }
}
