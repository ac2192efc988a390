//! What the tests of Tessera's communicators share.
//!
//! Every communicator (in-process threads, TCP between processes, shared
//! memory, MPI) must give every rank the same bits as the in-process one for
//! the same calls. The tests check that on generated programs of collectives:
//! [`ProgramSpace::generate`] draws a program from a seed, [`execute`] runs it
//! as one rank of any communicator, [`in_process`] runs it on the in-process
//! communicator, and [`assert_in_process_bits`] compares the two call by call.
//! The tests of each communicator add what only it can do or get wrong.

mod failures;
mod groups;
mod outcome;
mod program;
mod reference;
mod threads;

pub use failures::{assert_mismatched_calls_are_errors, names_lost_rank};
pub use groups::start_in_opposite_orders;
pub use outcome::{assert_same_bits, Outcome};
pub use program::{input, Call, ProgramSpace};
pub use reference::{assert_in_process_bits, assert_same_results, execute, in_process, in_process_of_magnitudes};
pub use threads::on_threads;
