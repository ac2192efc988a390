//! Where a stored piece lies in its global tensor, and assembling any
//! wanted part of a tensor from the pieces that hold it.
//!
//! A [`Region`] is a box of the global tensor (a tensor-parallel shard, or
//! the whole tensor), optionally narrowed to a run of the box's elements in
//! row-major order (a ZeRO shard cuts the flattened local shard anywhere).
//! Every region is a set of runs of consecutive elements of the *global*
//! tensor in row-major order, so intersecting two regions of any kind is
//! intersecting two sorted lists of intervals: that is all resharding needs.

use serde::{Deserialize, Serialize};
use std::ops::Range;
use tessera_nn::module::Shard;

/// The elements of a global tensor that a piece holds: the box
/// `offsets .. offsets + shape`, or only elements `flat` of that box in
/// row-major order. A piece stores its elements in that order.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Region {
    /// The box's first index along every dimension.
    pub offsets: Vec<usize>,
    /// The box's extent along every dimension.
    pub shape: Vec<usize>,
    /// When set, only these elements of the box (row-major).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flat: Option<Range<usize>>,
}

/// A run of consecutive elements of the global tensor inside a region:
/// global elements `start .. start + len` are the region's elements `at ..`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub start: usize,
    pub len: usize,
    pub at: usize,
}

impl Region {
    /// The whole tensor of shape `global`.
    pub fn whole(global: &[usize]) -> Region {
        Region { offsets: vec![0; global.len()], shape: global.to_vec(), flat: None }
    }

    /// The box a tensor-parallel shard holds: the `rank`-th of `degree`
    /// equal slices of dimension `dim`, or the whole tensor.
    pub fn of_shard(global: &[usize], shard: Shard) -> Region {
        let mut r = Region::whole(global);
        if let Shard::Split { dim, rank, degree } = shard {
            let len = global[dim] / degree;
            r.offsets[dim] = rank * len;
            r.shape[dim] = len;
        }
        r
    }

    /// Elements `elements` of this region, in its order.
    pub fn narrowed(&self, elements: Range<usize>) -> Region {
        let base = self.flat.as_ref().map_or(0, |f| f.start);
        Region { offsets: self.offsets.clone(), shape: self.shape.clone(), flat: Some(base + elements.start..base + elements.end) }
    }

    /// Number of elements held.
    pub fn elem_count(&self) -> usize {
        match &self.flat {
            Some(f) => f.len(),
            None => self.shape.iter().product(),
        }
    }

    /// The shape a piece of this region is stored with: the box's, or one
    /// dimension for a run of its elements.
    pub fn stored_shape(&self) -> Vec<usize> {
        match &self.flat {
            Some(f) => vec![f.len()],
            None => self.shape.clone(),
        }
    }

    /// Whether the region lies inside a tensor of shape `global`; if not, why.
    pub fn check(&self, global: &[usize]) -> Result<(), String> {
        if self.offsets.len() != global.len() || self.shape.len() != global.len() {
            return Err(format!("a {}-dimensional box of a {}-dimensional tensor", self.shape.len(), global.len()));
        }
        if let Some(d) = (0..global.len()).find(|&d| self.offsets[d] + self.shape[d] > global[d]) {
            return Err(format!("dimension {d} spans {}..{}, beyond the tensor's {}", self.offsets[d], self.offsets[d] + self.shape[d], global[d]));
        }
        let boxed: usize = self.shape.iter().product();
        match &self.flat {
            Some(f) if f.start > f.end || f.end > boxed => Err(format!("elements {}..{} of a box of {boxed}", f.start, f.end)),
            _ => Ok(()),
        }
    }

    /// The region as runs of the global tensor (of shape `global`), in the
    /// region's element order. The region must [`check`](Self::check).
    pub(crate) fn runs(&self, global: &[usize]) -> Vec<Run> {
        let n = global.len();
        let boxed: usize = self.shape.iter().product();
        let mut runs: Vec<Run> = Vec::new();
        if boxed > 0 {
            let row = self.shape.last().copied().unwrap_or(1);
            let strides: Vec<usize> = (0..n).map(|d| global[d + 1..].iter().product()).collect();
            // Row-major walk over the box's rows (every dimension but the last).
            let mut index = vec![0usize; n.saturating_sub(1)];
            for at in (0..boxed).step_by(row) {
                let start = (0..n).map(|d| (self.offsets[d] + index.get(d).copied().unwrap_or(0)) * strides[d]).sum();
                match runs.last_mut() {
                    Some(last) if last.start + last.len == start => last.len += row,
                    _ => runs.push(Run { start, len: row, at }),
                }
                for d in (0..index.len()).rev() {
                    index[d] += 1;
                    if index[d] < self.shape[d] {
                        break;
                    }
                    index[d] = 0;
                }
            }
        }
        match &self.flat {
            None => runs,
            Some(f) => runs
                .into_iter()
                .filter_map(|r| {
                    let (a, b) = (r.at.max(f.start), (r.at + r.len).min(f.end));
                    (a < b).then(|| Run { start: r.start + (a - r.at), len: b - a, at: a - f.start })
                })
                .collect(),
        }
    }
}

/// The pieces of one tensor, as sorted runs, ready to copy from.
pub(crate) struct Sources<'a> {
    /// `(run, the piece's bytes)`, by ascending global start.
    runs: Vec<(Run, &'a [u8])>,
    elem: usize,
}

impl<'a> Sources<'a> {
    /// The runs of `pieces` (each region with its bytes) of a tensor of
    /// shape `global` with `elem`-byte elements; an error naming the first
    /// overlap when two pieces hold the same element.
    pub fn new(global: &[usize], pieces: impl IntoIterator<Item = (&'a Region, &'a [u8])>, elem: usize) -> Result<Self, String> {
        let mut runs: Vec<(Run, &'a [u8])> = Vec::new();
        for (region, bytes) in pieces {
            runs.extend(region.runs(global).into_iter().map(|r| (r, bytes)));
        }
        runs.sort_by_key(|(r, _)| r.start);
        if let Some(w) = runs.windows(2).find(|w| w[0].0.start + w[0].0.len > w[1].0.start) {
            return Err(format!("two stored pieces both hold global element {}", w[1].0.start));
        }
        Ok(Sources { runs, elem })
    }

    /// Copies every element of `target` (of the same tensor) the pieces hold
    /// into `out`, the target's bytes in its order; returns how many
    /// elements were copied.
    pub fn copy_into(&self, target: &[Run], out: &mut [u8]) -> usize {
        let e = self.elem;
        let mut copied = 0;
        for t in target {
            let end = t.start + t.len;
            let first = self.runs.partition_point(|(r, _)| r.start + r.len <= t.start);
            for (r, bytes) in self.runs[first..].iter().take_while(|(r, _)| r.start < end) {
                let (a, b) = (t.start.max(r.start), end.min(r.start + r.len));
                let src = (r.at + a - r.start) * e;
                let dst = (t.at + a - t.start) * e;
                out[dst..dst + (b - a) * e].copy_from_slice(&bytes[src..src + (b - a) * e]);
                copied += b - a;
            }
        }
        copied
    }
}

/// Whether two regions' runs share an element.
pub(crate) fn overlap(a: &[Run], b: &[Run]) -> bool {
    // Both lists are sorted by start: one merge pass.
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (x, y) = (a[i], b[j]);
        if x.start < y.start + y.len && y.start < x.start + x.len {
            return true;
        }
        if x.start + x.len <= y.start + y.len {
            i += 1;
        } else {
            j += 1;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The global indices a region holds, in its order, from its runs.
    fn indices(r: &Region, global: &[usize]) -> Vec<usize> {
        r.runs(global).iter().flat_map(|run| run.start..run.start + run.len).collect()
    }

    #[test]
    fn runs_walk_a_box_row_by_row_and_merge_whole_rows() {
        let global = [4, 6];
        let column_half = Region { offsets: vec![0, 3], shape: vec![4, 3], flat: None };
        assert_eq!(indices(&column_half, &global), [3, 4, 5, 9, 10, 11, 15, 16, 17, 21, 22, 23]);
        assert_eq!(column_half.runs(&global).len(), 4);
        let row_half = Region { offsets: vec![2, 0], shape: vec![2, 6], flat: None };
        assert_eq!(row_half.runs(&global), [Run { start: 12, len: 12, at: 0 }]);
        // Elements 2..7 of the column half: the end of row 0 to the start of row 2.
        let narrowed = column_half.narrowed(2..7);
        assert_eq!(indices(&narrowed, &global), [5, 9, 10, 11, 15]);
        assert_eq!(narrowed.narrowed(1..3).flat, Some(3..5));
    }

    #[test]
    fn pieces_of_one_layout_assemble_a_region_of_another() {
        let global = [4, 6];
        let value = |i: usize| i as u8;
        // Stored: two row-halves, the second cut into two flat runs.
        let stored = [
            Region { offsets: vec![0, 0], shape: vec![2, 6], flat: None },
            Region { offsets: vec![2, 0], shape: vec![2, 6], flat: Some(0..5) },
            Region { offsets: vec![2, 0], shape: vec![2, 6], flat: Some(5..12) },
        ];
        let bytes: Vec<Vec<u8>> = stored.iter().map(|r| indices(r, &global).into_iter().map(value).collect()).collect();
        let sources = Sources::new(&global, stored.iter().zip(&bytes).map(|(r, b)| (r, b.as_slice())), 1).unwrap();
        let want = Region { offsets: vec![1, 2], shape: vec![3, 2], flat: None };
        let mut out = vec![0u8; want.elem_count()];
        assert_eq!(sources.copy_into(&want.runs(&global), &mut out), 6);
        assert_eq!(out, indices(&want, &global).into_iter().map(value).collect::<Vec<_>>());
        let overlapping = [stored[0].clone(), Region { offsets: vec![1, 0], shape: vec![2, 6], flat: None }];
        assert!(Sources::new(&global, overlapping.iter().map(|r| (r, &[][..])), 1).is_err());
    }
}
