//! How a communicator's failures must look, whatever carries its messages.

use crate::program::input;
use tessera_core::{DType, Device, Error};
use tessera_dist::Communicator;

/// Calls that differ across the `n` ranks of `comm` (this one is `rank`):
/// another collective, shape or root is an error on every rank, a shape one
/// rank cannot split or a wrong number of all-to-all parts is that rank's
/// own error (the others' is a mismatch), a root outside the group is
/// every rank's, and afterwards the group still works.
pub fn assert_mismatched_calls_are_errors(comm: &dyn Communicator, rank: usize, n: usize, dev: &Device) {
    let x = input(rank, 0, &[6, 4], DType::F32, dev);
    let e = if rank == 0 { comm.all_reduce_sum(&x) } else { comm.all_gather(&x, 0) }.unwrap_err();
    assert!(matches!(e, Error::CollectiveMismatch { .. }), "{e}");
    assert!(e.to_string().contains("all_reduce_sum") && e.to_string().contains("all_gather"), "{e}");
    let y = input(rank, 0, &[6, 4 + rank], DType::F32, dev);
    assert!(matches!(comm.all_reduce_sum(&y), Err(Error::CollectiveMismatch { .. })));
    assert!(matches!(comm.broadcast(&x, rank), Err(Error::CollectiveMismatch { .. })));
    let w = input(rank, 0, &[if rank == 0 { n + 1 } else { n }, 2], DType::F32, dev);
    match (rank, comm.reduce_scatter_sum(&w, 0)) {
        (0, Err(Error::Shape { .. })) => {}
        (r, Err(Error::CollectiveMismatch { .. })) if r > 0 => {}
        (r, other) => panic!("rank {r}: unexpected {other:?}"),
    }
    // A root outside the group is every rank's own error; a wrong number
    // of all-to-all parts on one rank is its own error, and the others learn
    // that it passed invalid arguments.
    assert!(matches!(comm.broadcast(&x, n), Err(Error::NoSuchRank { .. })));
    let parts: Vec<_> = (0..if rank == 0 { n + 1 } else { n }).map(|j| input(rank, j, &[2], DType::F32, dev)).collect();
    match (rank, comm.all_to_all(parts)) {
        (0, Err(e)) if e.to_string().contains("parts given") => {}
        (r, Err(Error::CollectiveMismatch { detail, .. })) if r > 0 && detail.contains("invalid arguments") => {}
        (r, other) => panic!("rank {r}: unexpected {other:?}"),
    }
    let s = comm.all_reduce_sum(&x).unwrap();
    assert_eq!(s.dims(), &[6, 4]);
}

/// Whether `e`, the error of a call that waited for rank `lost`, names that
/// rank, whoever noticed the loss first: the failure itself, or a timeout.
pub fn names_lost_rank(e: &Error, lost: usize) -> bool {
    match e {
        Error::PeerFailed { rank, .. } => *rank == lost,
        Error::Timeout { detail, .. } => detail.contains(&format!("rank {lost}")),
        _ => false,
    }
}
