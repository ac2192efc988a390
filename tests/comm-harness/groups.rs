//! Groups with the same members, used at once.

use tessera_core::Tensor;
use tessera_dist::{Communicator, Pending};

/// Starts an all-reduce of `x` on `a` and an all-gather of it (along
/// dimension 0) on `b`, both asynchronous, in opposite orders on even and odd
/// ranks: two groups with the same members each keep their own order, so
/// both must complete. Returns the all-reduce's result, then the all-gather's.
pub fn start_in_opposite_orders(a: &dyn Communicator, b: &dyn Communicator, x: &Tensor, rank: usize) -> (Pending, Pending) {
    if rank.is_multiple_of(2) {
        let sum = a.all_reduce_sum_async(x).unwrap();
        (sum, b.all_gather_async(x, 0).unwrap())
    } else {
        let gathered = b.all_gather_async(x, 0).unwrap();
        (a.all_reduce_sum_async(x).unwrap(), gathered)
    }
}
