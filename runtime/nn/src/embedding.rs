//! Token embedding, plain and vocab-parallel.

use crate::module::{Act, Activation, Cx, Describe, Module, Param, PartialSum, Plain, Replicated, Visitor, Vocab};
use tessera_core::ops;
use tessera_core::tensor::{DType, Init, Tensor};
use tessera_core::{Error, Result};

/// A table of `vocab` rows of `dim` values, looked up by `u32` token ids.
///
/// The table has the global shape `[vocab, dim]` and starts Normal(0, 0.02).
/// The input is an `Act<Replicated>` holding a `u32` tensor of ids of any
/// shape; the output has shape `[..ids, dim]`.
///
/// Roles:
///
/// * `Plain`: `Replicated → Replicated`.
/// * `Vocab`: `Replicated → PartialSum`; the table is split along the
///   vocabulary (dimension 0). Rank `r` of `n` holds rows
///   `[r·vocab/n, (r+1)·vocab/n)` and looks up zeros for ids outside them, so
///   the sum over the group is the full lookup.
///
/// Token ids have no gradient: the backward returns the ids themselves in
/// the input-gradient position, which callers ignore (generated code drops it).
///
/// ```
/// use tessera::module::{materialize, Act, Cx, Module};
/// use tessera::nn::Embedding;
/// use tessera::{Device, Tensor};
///
/// let dev = Device::cpu();
/// let cx = &mut Cx::new(dev.clone());
/// let tok = Embedding::new(10, 4)?;
/// materialize(&tok, cx)?;
/// let ids = Tensor::from_vec(vec![1u32, 7, 3], [1, 3], &dev)?;
/// let (h, _saved) = <Embedding as Module>::forward(&tok, cx, Act::new(ids))?;
/// assert_eq!(h.tensor().dims(), &[1, 3, 4]);
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Debug)]
pub struct Embedding {
    vocab: usize,
    dim: usize,
    weight: Param,
}

/// What an [`Embedding`] keeps for its backward: the token ids (4 bytes per token).
#[derive(Debug)]
pub struct EmbeddingSaved {
    ids: Tensor,
}

impl EmbeddingSaved {
    /// Bytes of activation memory held.
    pub fn bytes(&self) -> usize {
        super::bytes_of(&self.ids)
    }
}

impl Embedding {
    /// A table of `vocab` rows of `dim` values.
    pub fn new(vocab: usize, dim: usize) -> Result<Embedding> {
        if vocab == 0 || dim == 0 {
            return Err(Error::invalid("Embedding::new", format!("vocab ({vocab}) and dim ({dim}) must both be positive")));
        }
        if vocab > u32::MAX as usize {
            return Err(Error::invalid("Embedding::new", format!("a vocabulary of {vocab} does not fit u32 token ids; use at most {}", u32::MAX)));
        }
        Ok(Embedding { vocab, dim, weight: Param::new([vocab, dim], Init::Normal { mean: 0.0, std: 0.02 }) })
    }

    /// Number of rows (global).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Width of a row.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The table, `[vocab, dim]`.
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// Shares `p` as the table (see [`Linear::tie_weight`](super::Linear::tie_weight)).
    pub fn tie_weight(&mut self, p: &Param) -> Result<()> {
        let want = self.weight.global_shape();
        if p.global_shape() != want {
            return Err(Error::shape(
                "Embedding::tie_weight",
                format!("the parameter has global shape {} but the table is {want} ([vocab, dim]); tie only parameters of equal shape", p.global_shape()),
            ));
        }
        self.weight = p.clone();
        Ok(())
    }

    /// A lookup's costs: the ids kept, rows written forward and read
    /// backward; the table split over the group when `split`.
    fn describe_lookup(&self, d: &mut Describe, ids: Activation, split: bool) -> Result<Activation> {
        if split && !self.vocab.is_multiple_of(d.tp()) {
            return Err(Error::indivisible(
                "Embedding",
                format!(
                    "{} vocabulary rows cannot be split over a tensor-parallel group of {}; pad the vocabulary to a multiple of the degree",
                    self.vocab,
                    d.tp()
                ),
            ));
        }
        d.save(&ids);
        let y = d.output(self.dim * ids.width, ids.tokens);
        d.traffic(y.bytes(), y.bytes());
        Ok(y)
    }

    /// Looks up this rank's rows, which start at vocabulary row `start`.
    fn fwd(&self, cx: &Cx, ids: Tensor, sharded: bool) -> Result<(Tensor, EmbeddingSaved)> {
        let table = cx.param(&self.weight)?;
        let start = if sharded { cx.tp().rank() * table.dims()[0] } else { 0 };
        let y = ops::embedding_shard(&table, &ids, start, self.vocab)?;
        Ok((y, EmbeddingSaved { ids }))
    }

    fn bwd(&self, cx: &Cx, saved: EmbeddingSaved, dy: &Tensor, sharded: bool) -> Result<Tensor> {
        let rows = self.weight.local_shape().dims()[0];
        let start = if sharded { cx.tp().rank() * rows } else { 0 };
        let g = ops::embedding_backward(&saved.ids, dy, rows, start, self.vocab)?;
        cx.grad(&self.weight, g)?;
        Ok(saved.ids)
    }
}

impl Module<Plain> for Embedding {
    type In = Replicated;
    type Out = Replicated;
    type Saved = EmbeddingSaved;

    fn forward(&self, cx: &mut Cx, ids: Act<Replicated>) -> Result<(Act<Replicated>, EmbeddingSaved)> {
        let (y, s) = self.fwd(cx, ids.into_tensor(), false)?;
        Ok((Act::new(y), s))
    }

    /// Delivers the table's gradient; returns the ids (token ids have no gradient).
    fn backward(&self, cx: &mut Cx, saved: EmbeddingSaved, dy: Act<Replicated>) -> Result<Act<Replicated>> {
        Ok(Act::new(self.bwd(cx, saved, dy.tensor(), false)?))
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()> {
        v.param("weight", &self.weight, Some(0))
    }

    fn describe(&self, d: &mut Describe, ids: Activation) -> Result<Activation> {
        self.describe_lookup(d, ids, false)
    }
}

impl Module<Vocab> for Embedding {
    type In = Replicated;
    type Out = PartialSum;
    type Saved = EmbeddingSaved;

    /// Under sequence parallelism with [`Cx::with_tp_overlap`], the rows
    /// are looked up slice by slice of the tokens, each other rank's slice
    /// sent to it while the next is looked up and this rank's own last; the
    /// `all_reduce` the caller applies to the output sums this rank's slice
    /// (as for a row-parallel `Linear`).
    fn forward(&self, cx: &mut Cx, ids: Act<Replicated>) -> Result<(Act<PartialSum>, EmbeddingSaved)> {
        let ids = ids.into_tensor();
        let tp = cx.tp().size();
        if cx.tp_overlap().is_some() && cx.decode().is_none() && ids.rank() >= 2 && ids.dims()[1].is_multiple_of(tp) {
            let table = cx.param(&self.weight)?;
            let start = cx.tp().rank() * table.dims()[0];
            let sum = crate::module::overlap::map_scatter_sum(cx, &ids, |part| ops::embedding_shard(&table, part, start, self.vocab))?;
            let y = sum.summand()?;
            cx.start_reduction(crate::module::overlap::InFlight { value: y.clone(), sum });
            return Ok((Act::new(y), EmbeddingSaved { ids }));
        }
        let (y, s) = self.fwd(cx, ids, true)?;
        Ok((Act::new(y), s))
    }

    /// Delivers this rank's rows of the table gradient; returns the ids
    /// (token ids have no gradient).
    fn backward(&self, cx: &mut Cx, saved: EmbeddingSaved, dy: Act<PartialSum>) -> Result<Act<Replicated>> {
        Ok(Act::new(self.bwd(cx, saved, dy.tensor(), true)?))
    }

    /// Under sequence parallelism with [`Cx::with_tp_overlap`], `dy` is
    /// this rank's slice of the gradient of the reduced lookup: its rows are
    /// scatter-added into this rank's part of the table gradient while the
    /// other slices are gathered, then theirs, in rank order.
    fn backward_gathering(&self, cx: &mut Cx, saved: EmbeddingSaved, dy: Act<Replicated>) -> Result<Act<Replicated>> {
        let (tp, rank) = (cx.tp().size(), cx.tp().rank());
        let ids = &saved.ids;
        let len = dy.tensor().dims().get(1).copied().unwrap_or(0);
        let sliced = cx.tp_overlap().is_some() && cx.decode().is_none() && ids.rank() >= 2 && dy.tensor().rank() == ids.rank() + 1 && ids.dims()[1] == tp * len;
        if !sliced {
            let dy = crate::module::dsl::all_reduce_backward(cx, dy)?;
            return <Embedding as Module<Vocab>>::backward(self, cx, saved, dy);
        }
        let rows = self.weight.local_shape().dims()[0];
        let start = rank * rows;
        let dy = dy.into_tensor();
        let travelling = cx.tp().all_gather_async(&dy, 1)?;
        // The first layer of a language model: the replicated parameters'
        // gradients are complete, and their sum travels beside this one.
        cx.start_replicated_sums()?;
        let ids_of = |r: usize| ids.narrow(1, r * len, len).and_then(|t| t.contiguous());
        // Summed in f32 (or the gradient's f64) across the slices.
        let full = if dy.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
        let own = if dy.dtype() == full { dy.clone() } else { dy.to_dtype(full)? };
        let g = ops::embedding_backward(&ids_of(rank)?, &own, rows, start, self.vocab)?;
        let gathered = travelling.wait()?;
        for r in (0..tp).filter(|&r| r != rank) {
            ops::embedding_backward_accumulate(&g, &ids_of(r)?, &gathered.narrow(1, r * len, len)?, start, self.vocab)?;
        }
        cx.grad(&self.weight, g)?;
        Ok(Act::new(saved.ids))
    }

    fn visit_params(&self, v: &mut Visitor<'_>) -> Result<()> {
        v.param("weight", &self.weight, Some(0))
    }

    fn describe(&self, d: &mut Describe, ids: Activation) -> Result<Activation> {
        self.describe_lookup(d, ids, true)
    }
}
