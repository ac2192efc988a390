//! Laying out a forward's tokens over the paged cache: the one builder the
//! engine's steps and the draft model's rounds share, so the two layouts
//! cannot drift apart.

use crate::kv::BlockTable;
use std::ops::Range;
use tessera_core::ops::PagedBatch;

/// A forward's token ids, flattened into one row, and where each sits in the
/// paged cache; built one sequence at a time with [`push`](Self::push).
pub(crate) struct StepBatch {
    /// The token ids, in the order the forward runs them.
    pub ids: Vec<u32>,
    /// Each token's position, sequence and slot, and the sequences' block tables.
    pub batch: PagedBatch,
}

impl StepBatch {
    /// An empty step whose block tables are padded to the widest of `tables`
    /// (the tables of the sequences to be pushed), and at least one block wide.
    pub(crate) fn new<'a>(block_size: usize, tables: impl IntoIterator<Item = &'a BlockTable>) -> StepBatch {
        let width = tables.into_iter().map(|t| t.blocks().len()).max().unwrap_or(1).max(1);
        StepBatch { ids: Vec::new(), batch: PagedBatch { block_size, table_width: width, ..PagedBatch::default() } }
    }

    /// Adds the next sequence: its row of the block tables, and its tokens at
    /// `positions` (ids from `tokens`), whose slots `table` must hold.
    pub(crate) fn push(&mut self, table: &BlockTable, tokens: &[u32], positions: Range<usize>) {
        let b = &mut self.batch;
        let seq = b.seqs() as u32;
        let row = b.block_tables.len();
        b.block_tables.extend_from_slice(table.blocks());
        b.block_tables.resize(row + b.table_width, 0);
        for pos in positions {
            self.ids.push(tokens[pos]);
            b.positions.push(pos as u32);
            b.token_seq.push(seq);
            b.slots.push(table.slot(pos).expect("the table holds every known token").flat(b.block_size) as u32);
        }
    }
}
