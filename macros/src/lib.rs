//! Procedural macros of Tessera's model DSL.
//!
//! The runtime crate `tessera` re-exports everything defined here; depend on
//! `tessera`, not on this crate. The derive for modules and the forward
//! attribute are built on the tensor runtime and land in this crate next.
