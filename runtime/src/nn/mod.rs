//! Primitive layers with hand-written backward passes.
