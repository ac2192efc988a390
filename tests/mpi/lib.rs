//! Nothing but the `mpi` test (see `mpi.rs`), which needs the `mpi` feature
//! and an MPI installation; this library only gives the package a target
//! that builds without them.
