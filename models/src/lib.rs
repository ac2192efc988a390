//! Reference models written with Tessera (GPT, Llama, Mixtral-style MoE).
//!
//! The models are written with the DSL of `tessera`'s macros; until those
//! exist this crate only re-exports the runtime so the workspace builds whole.

pub use tessera;
