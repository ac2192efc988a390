//! Running a program as one rank of any communicator, and the in-process
//! communicator's results of it, which every other communicator must give.

use crate::outcome::{assert_same_bits, Outcome};
use crate::program::{input, Call};
use crate::threads::on_threads;
use tessera_core::{DType, Device, Tensor};
use tessera_dist::inproc::InProcess;
use tessera_dist::Communicator;

/// What the ranks feed a program's calls.
#[derive(Clone, Copy)]
enum Inputs {
    /// [`input`]'s values.
    Drawn,
    /// Their absolute values: a sum of these is `Σ|x|`, which bounds the
    /// rounding error of a sum in any order.
    Magnitudes,
}

/// Runs `program` on `comm` as rank `rank` of `n` and returns what every
/// call gave this rank (nothing for a barrier, a result per peer for an
/// all-to-all).
pub fn execute(comm: &dyn Communicator, program: &[Call], rank: usize, n: usize, dev: &Device) -> Vec<Vec<Outcome>> {
    execute_with(comm, program, rank, n, Inputs::Drawn, dev)
}

fn execute_with(comm: &dyn Communicator, program: &[Call], rank: usize, n: usize, inputs: Inputs, dev: &Device) -> Vec<Vec<Outcome>> {
    // Rank `rank`'s input of call `i`, as `inputs` says.
    let input_of = |rank: usize, i: usize, dims: &[usize], dtype: DType| {
        let t = input(rank, i, dims, dtype, dev);
        match inputs {
            Inputs::Drawn => t,
            Inputs::Magnitudes => {
                let v: Vec<f64> = t.to_f64_vec().unwrap().iter().map(|x| x.abs()).collect();
                Tensor::from_vec(v, dims, dev).unwrap().to_dtype(dtype).unwrap()
            }
        }
    };
    program
        .iter()
        .enumerate()
        .map(|(i, call)| match call {
            Call::AllReduce { dims, dtype, asynchronous } => {
                let x = input_of(rank, i, dims, *dtype);
                let y = if *asynchronous { comm.all_reduce_sum_async(&x).unwrap().wait() } else { comm.all_reduce_sum(&x) };
                vec![Outcome::of(&y.unwrap())]
            }
            Call::AllGather { dims, dim, dtype, asynchronous } => {
                let x = input_of(rank, i, dims, *dtype);
                let y = if *asynchronous { comm.all_gather_async(&x, *dim).unwrap().wait() } else { comm.all_gather(&x, *dim) };
                vec![Outcome::of(&y.unwrap())]
            }
            Call::ReduceScatter { dims, dim, dtype, asynchronous } => {
                let x = input_of(rank, i, dims, *dtype);
                let y = if *asynchronous { comm.reduce_scatter_sum_async(&x, *dim).unwrap().wait() } else { comm.reduce_scatter_sum(&x, *dim) };
                vec![Outcome::of(&y.unwrap())]
            }
            Call::Broadcast { dims, root, dtype } => vec![Outcome::of(&comm.broadcast(&input_of(rank, i, dims, *dtype), *root).unwrap())],
            Call::AllToAll { rows } => {
                let parts: Vec<Tensor> = (0..n).map(|to| input_of(rank * n + to, i, &[rows[rank][to], 2], DType::F32)).collect();
                comm.all_to_all(parts).unwrap().iter().map(Outcome::of).collect()
            }
            Call::SendRecv { len } => {
                // A ring: everyone sends first (sends never wait), then receives.
                let x = input_of(rank, i, &[*len], DType::BF16);
                comm.send(&x, (rank + 1) % n).unwrap();
                vec![Outcome::of(&comm.recv((rank + n - 1) % n).unwrap())]
            }
            Call::Barrier => {
                comm.barrier().unwrap();
                Vec::new()
            }
        })
        .collect()
}

/// What the in-process communicator gives every rank of `n` for `program`,
/// in rank order.
pub fn in_process(program: &[Call], n: usize) -> Vec<Vec<Vec<Outcome>>> {
    in_process_with(program, n, Inputs::Drawn)
}

/// What the in-process communicator gives every rank of `n` for `program`
/// when every input is replaced by its absolute value: for a sum, `Σ|x|`,
/// which bounds how far a sum in another order may be from the in-process one.
pub fn in_process_of_magnitudes(program: &[Call], n: usize) -> Vec<Vec<Vec<Outcome>>> {
    in_process_with(program, n, Inputs::Magnitudes)
}

fn in_process_with(program: &[Call], n: usize, inputs: Inputs) -> Vec<Vec<Vec<Outcome>>> {
    let world = InProcess::new(n).unwrap();
    on_threads(n, |r| {
        let dev = Device::cpu();
        let comm = world.communicator(r, &dev).unwrap();
        execute_with(&comm, program, r, n, inputs, &dev)
    })
}

/// Asserts that one rank's results of `program` are `want`, call by call and
/// bit for bit; the message names `what` and the call.
#[track_caller]
pub fn assert_same_results(program: &[Call], got: &[Vec<Outcome>], want: &[Vec<Outcome>], what: &str) {
    assert_eq!((got.len(), want.len()), (program.len(), program.len()), "{what}: one result per call");
    for (i, call) in program.iter().enumerate() {
        assert_same_bits(&got[i], &want[i], &format!("{what}, call {i}: {call:?}"));
    }
}

/// Asserts that every rank got from `program` what the in-process
/// communicator gives it, call by call and bit for bit. `got` holds the
/// results of every rank of the world in rank order; `what` names the case.
#[track_caller]
pub fn assert_in_process_bits(program: &[Call], got: &[Vec<Vec<Outcome>>], what: &str) {
    let want = in_process(program, got.len());
    for (r, (got, want)) in got.iter().zip(&want).enumerate() {
        assert_same_results(program, got, want, &format!("{what}, rank {r}"));
    }
}
