//! Compile-time checks of the model DSL, pinned with the compiler's own
//! output: every case under `ui/<category>/` is one mistake that must be
//! refused with the `.stderr` beside it, pointing at the user's code; every
//! case under `ui/pass/` must compile.
//!
//! After a deliberate change of a message, regenerate the expectations with
//! `TRYBUILD=overwrite cargo test -p tessera-tests --test ui` and read the
//! diff of the `.stderr` files.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    for category in ["layout", "attr", "stage", "precision", "mesh", "dsl", "derive", "multi"] {
        t.compile_fail(format!("ui/{category}/*.rs"));
    }
    t.pass("ui/pass/*.rs");
}
