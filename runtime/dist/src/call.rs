//! A collective call as the ranks of a group compare it: which collective,
//! the arguments every rank must agree on, and the caller's tensor.
//!
//! Every host communicator checks at the first step of each collective that
//! all ranks made the same call, so that a mismatch is an error on every
//! rank instead of a hang or garbage. Each carries the call in its own
//! record (an in-process post, a TCP frame's header, a shared-memory call
//! area, a record of MPI words), but all of them describe it with the types
//! and codes here, and name it in errors the same way.

use std::fmt;
use tessera_core::tensor::{DType, Tensor};

/// Dimensions a call record carries at most (the process and MPI records
/// have fixed-size shape fields).
pub(crate) const MAX_DIMS: usize = 16;

/// The collective a rank called, with the arguments every rank must agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    AllReduce,
    AllGather {
        dim: usize,
    },
    ReduceScatter {
        dim: usize,
    },
    Broadcast {
        root: usize,
    },
    AllToAll,
    Barrier,
    /// A point-to-point message.
    Send,
}

impl Op {
    /// The method's name, as errors name it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce_sum",
            Op::AllGather { .. } => "all_gather",
            Op::ReduceScatter { .. } => "reduce_scatter_sum",
            Op::Broadcast { .. } => "broadcast",
            Op::AllToAll => "all_to_all",
            Op::Barrier => "barrier",
            Op::Send => "send",
        }
    }

    /// The operation's code and its argument (0 when it has none), as
    /// records carry them.
    pub(crate) fn code(self) -> (u8, u64) {
        match self {
            Op::AllReduce => (1, 0),
            Op::AllGather { dim } => (2, dim as u64),
            Op::ReduceScatter { dim } => (3, dim as u64),
            Op::Broadcast { root } => (4, root as u64),
            Op::AllToAll => (5, 0),
            Op::Barrier => (6, 0),
            Op::Send => (7, 0),
        }
    }

    /// The operation of `code` with argument `arg`; `None` for what no rank
    /// writes.
    pub(crate) fn from_code(code: u8, arg: u64) -> Option<Op> {
        let arg = usize::try_from(arg).ok()?;
        Some(match code {
            1 => Op::AllReduce,
            2 => Op::AllGather { dim: arg },
            3 => Op::ReduceScatter { dim: arg },
            4 => Op::Broadcast { root: arg },
            5 => Op::AllToAll,
            6 => Op::Barrier,
            7 => Op::Send,
            _ => return None,
        })
    }
}

/// A tensor's dtype and dimensions.
pub(crate) type Meta = (DType, Vec<usize>);

/// The dtype and dimensions of `t`.
pub(crate) fn meta(t: &Tensor) -> Meta {
    (t.dtype(), t.dims().to_vec())
}

/// A dtype's code in records (never 0, which records use for "none").
pub(crate) fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 1,
        DType::F64 => 2,
        DType::BF16 => 3,
        DType::F16 => 4,
        DType::I32 => 5,
        DType::U32 => 6,
    }
}

/// The dtype of `code`; `None` for a code no rank writes.
pub(crate) fn dtype_of_code(code: u8) -> Option<DType> {
    Some(match code {
        1 => DType::F32,
        2 => DType::F64,
        3 => DType::BF16,
        4 => DType::F16,
        5 => DType::I32,
        6 => DType::U32,
        _ => return None,
    })
}

/// A call as the ranks compare it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Call {
    pub op: Op,
    /// The caller's tensor, where every rank's must agree (`None` for the
    /// calls without one, and for all-to-all, whose parts may differ).
    pub meta: Option<Meta>,
}

impl Call {
    /// `op` on the tensor `t`.
    pub(crate) fn on(op: Op, t: &Tensor) -> Call {
        Call { op, meta: Some(meta(t)) }
    }

    /// `op`, without a tensor every rank's must agree with.
    pub(crate) fn bare(op: Op) -> Call {
        Call { op, meta: None }
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.op.name())?;
        match self.op {
            Op::AllGather { dim } | Op::ReduceScatter { dim } => write!(f, "(dim {dim})")?,
            Op::Broadcast { root } => write!(f, "(root {root})")?,
            _ => {}
        }
        if let Some((dtype, dims)) = &self.meta {
            write!(f, " of {dtype:?}{dims:?}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_refuse_the_unknown() {
        let ops = [Op::AllReduce, Op::AllGather { dim: 2 }, Op::ReduceScatter { dim: 1 }, Op::Broadcast { root: 3 }, Op::AllToAll, Op::Barrier, Op::Send];
        for op in ops {
            let (code, arg) = op.code();
            assert_eq!(Op::from_code(code, arg), Some(op));
        }
        assert_eq!(Op::from_code(0, 0), None);
        assert_eq!(Op::from_code(8, 0), None);
        for d in [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::U32] {
            assert_eq!(dtype_of_code(dtype_code(d)), Some(d));
        }
        assert_eq!(dtype_of_code(0), None);
        assert_eq!(dtype_of_code(7), None);
    }

    #[test]
    fn calls_are_described_with_their_arguments() {
        let c = Call { op: Op::AllGather { dim: 1 }, meta: Some((DType::BF16, vec![2, 3])) };
        assert_eq!(c.to_string(), "all_gather(dim 1) of BF16[2, 3]");
        assert_eq!(Call::bare(Op::Barrier).to_string(), "barrier");
    }
}
