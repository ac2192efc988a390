//! Tessera's inference engine: what turns a trained or imported model into a
//! generator.
//!
//! It is being built in pieces; docs/serving.md says what exists.

pub mod kv;
