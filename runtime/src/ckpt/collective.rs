//! The few collectives a save or load needs over the whole mesh, composed
//! from the per-axis groups of [`Cx::groups`]: a reduction over tp, then
//! ep, dp and pp covers every rank once, because the groups of the four
//! axes tile the mesh.

use crate::error::Result;
use crate::module::Cx;
use crate::tensor::Tensor;

/// On every rank: how many ranks of the mesh passed `failed = true`.
pub(crate) fn count_failures(cx: &Cx, failed: bool) -> Result<usize> {
    let g = cx.groups();
    let mut t = Tensor::from_vec(vec![f64::from(u8::from(failed))], [1], cx.device())?;
    for group in [&g.tp, &g.ep, &g.dp, &g.pp] {
        t = group.all_reduce_sum(&t)?;
    }
    Ok(t.to_scalar()?.round() as usize)
}

/// Rank 0's `value`, on every rank of the mesh.
pub(crate) fn broadcast(cx: &Cx, value: u32) -> Result<u32> {
    let g = cx.groups();
    let mut t = Tensor::from_vec(vec![value], [1], cx.device())?;
    // Outward from rank 0: first along pp (to every coordinate-0 rank of
    // the other axes), then dp, ep and tp.
    for group in [&g.pp, &g.dp, &g.ep, &g.tp] {
        t = group.broadcast(&t, 0)?;
    }
    Ok(t.to_vec::<u32>()?[0])
}
