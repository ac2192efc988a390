//! Errors a caller can act on: each failure is a variant to match, and one
//! the operating system caused keeps its `io::Error` as the source (and in
//! the message, which is what travels between ranks).

use std::error::Error as _;
use std::io::ErrorKind;
use tessera::ckpt::Checkpointer;
use tessera::data::Dataset;
use tessera::observe::MetricsLog;
use tessera::testing::Scratch;
use tessera::Error;

/// The `io::Error` under `e`, if any.
fn io_source(e: &Error) -> Option<&std::io::Error> {
    e.source().and_then(|s| s.downcast_ref::<std::io::Error>())
}

/// A path whose parent is a regular file, which no one can create.
fn under_a_file(scratch: &Scratch, name: &str) -> std::path::PathBuf {
    let file = scratch.path().join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    file.join(name)
}

#[test]
fn a_file_that_cannot_be_created_keeps_the_operating_systems_error() {
    let scratch = Scratch::new("errors-io");
    let e = MetricsLog::create(under_a_file(&scratch, "metrics.jsonl")).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e:?}");
    let source = io_source(&e).expect("the io::Error is the source");
    assert_eq!(source.kind(), ErrorKind::NotADirectory);
    assert!(e.to_string().contains(&source.to_string()), "the message repeats the cause: {e}");
}

#[test]
fn a_checkpoint_root_that_cannot_be_created_keeps_the_operating_systems_error() {
    let scratch = Scratch::new("errors-ckpt");
    let e = Checkpointer::new(under_a_file(&scratch, "ckpt"), 2).unwrap_err();
    assert!(matches!(e, Error::CheckpointIo { .. }), "{e:?}");
    assert_eq!(io_source(&e).map(std::io::Error::kind), Some(ErrorKind::NotADirectory), "{e}");
    assert!(e.to_string().contains("cannot create the checkpoint root"), "{e}");
}

#[test]
fn a_missing_dataset_keeps_the_operating_systems_error() {
    let scratch = Scratch::new("errors-data");
    let e = Dataset::open(scratch.path().join("no-such-dataset")).unwrap_err();
    assert!(matches!(e, Error::DataFileIo { .. }), "{e:?}");
    assert_eq!(io_source(&e).map(std::io::Error::kind), Some(ErrorKind::NotFound), "{e}");
    assert!(e.to_string().contains("tessera prepare"), "the message says how to fix it: {e}");
}

#[test]
fn a_context_keeps_the_error_it_wraps() {
    let inner = Error::shape("matmul", "[2, 3] @ [4, 5]");
    let e = inner.context("layer `mlp.up`");
    assert!(matches!(e.root(), Error::Shape { op: "matmul", .. }), "{e:?}");
    assert_eq!(e.to_string(), "layer `mlp.up`: matmul: shape mismatch: [2, 3] @ [4, 5]");
    assert!(e.source().is_some_and(|s| s.to_string() == "matmul: shape mismatch: [2, 3] @ [4, 5]"));
    // Contexts nest; the root is still the first cause.
    let e = e.context("step 3");
    assert!(matches!(e.root(), Error::Shape { .. }), "{e:?}");
}

#[test]
fn a_mesh_that_does_not_fit_and_a_rank_outside_it_are_told_apart() {
    use tessera::dist::mesh::Mesh;
    let e = Mesh::parse("dp2,tp3", 4, 4).unwrap_err();
    assert!(matches!(e, Error::Topology { .. }), "{e:?}");
    let mesh = Mesh::parse("dp2,tp2", 4, 4).unwrap();
    let e = mesh.coords(7).unwrap_err();
    assert!(matches!(e, Error::NoSuchRank { .. }), "{e:?}");
}
