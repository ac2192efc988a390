//! The flat vector: the model's distinct parameters laid end to end,
//! padded and cut into one shard per rank of the data-parallel group.

use std::ops::Range;
use tessera_core::tensor::{DType, Shape, Tensor};
use tessera_core::{Device, Result};
use tessera_nn::module::Param;

/// How the flattened parameters are cut into shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlatLayout {
    /// Ψ: elements of all distinct parameters (this rank's tensor-parallel shards).
    pub numel: usize,
    /// Ψ rounded up to a multiple of the group size (the zero padding at the tail).
    pub padded: usize,
    /// Elements per shard: `padded / ranks`.
    pub shard_len: usize,
    /// Ranks of the data-parallel group.
    pub ranks: usize,
}

impl FlatLayout {
    pub(super) fn new(numel: usize, ranks: usize) -> Self {
        let shard_len = numel.div_ceil(ranks);
        FlatLayout { numel, padded: shard_len * ranks, shard_len, ranks }
    }

    /// The elements of the flat vector that rank `rank` owns.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        rank * self.shard_len..(rank + 1) * self.shard_len
    }
}

/// One distinct parameter and its place in the flat vector.
pub(super) struct Entry {
    pub(super) name: String,
    pub(super) param: Param,
    pub(super) shape: Shape,
    pub(super) offset: usize,
    pub(super) len: usize,
}

/// The part of one parameter that lies in one shard.
#[derive(Clone, Copy, Debug)]
pub(super) struct Piece {
    pub(super) entry: usize,
    /// First element within the parameter.
    pub(super) start: usize,
    pub(super) len: usize,
}

/// A set of parameters exchanged together, split by the shard each piece lies in.
pub(super) struct Rows {
    pub(super) rows: Vec<Vec<Piece>>,
    /// Length every rank's row is padded to.
    pub(super) width: usize,
}

/// The flat vector of one engine: its layout, the parameters in it, and
/// the dtype and device of every tensor the engine makes of it.
pub(super) struct Flat {
    pub(super) layout: FlatLayout,
    pub(super) entries: Vec<Entry>,
    pub(super) dtype: DType,
    pub(super) device: Device,
}

impl Flat {
    /// Stages 1 and 2: makes every parameter's value a view of `flat`.
    pub(super) fn point_values_at(&self, flat: &Tensor) -> Result<()> {
        for e in &self.entries {
            e.param.set_value(flat.narrow(0, e.offset, e.len)?.reshape(e.shape.clone())?)?;
        }
        Ok(())
    }

    /// The pieces of the flat range `range` (within one shard), in order.
    pub(super) fn pieces_in(&self, range: Range<usize>) -> Vec<Piece> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let (a, b) = (e.offset.max(range.start), (e.offset + e.len).min(range.end));
                (a < b).then(|| Piece { entry: i, start: a - e.offset, len: b - a })
            })
            .collect()
    }

    /// Splits the parameters `ids` by the shard each of their elements lies in.
    pub(super) fn rows(&self, ids: &[usize]) -> Rows {
        let sl = self.layout.shard_len;
        let mut rows = vec![Vec::new(); self.layout.ranks];
        for &i in ids {
            let e = &self.entries[i];
            let end = e.offset + e.len;
            let mut at = e.offset;
            while at < end {
                let r = at / sl;
                let stop = ((r + 1) * sl).min(end);
                rows[r].push(Piece { entry: i, start: at - e.offset, len: stop - at });
                at = stop;
            }
        }
        let width = rows.iter().map(|r: &Vec<Piece>| r.iter().map(|p| p.len).sum::<usize>()).max().unwrap_or(0).max(1);
        Rows { rows, width }
    }

    /// `parts` joined and padded with zeros to `len` elements.
    pub(super) fn padded_concat(&self, mut parts: Vec<Tensor>, len: usize) -> Result<Tensor> {
        let have: usize = parts.iter().map(Tensor::elem_count).sum();
        if have < len {
            parts.push(Tensor::zeros([len - have], self.dtype, &self.device)?);
        }
        Tensor::concat_flat(&parts.iter().collect::<Vec<_>>())
    }
}

/// A contiguous tensor as one dimension (a view when it already is contiguous).
pub(super) fn flat_view(t: &Tensor) -> Result<Tensor> {
    t.contiguous()?.reshape([t.elem_count()])
}
