//! Training data: tokenizers, memory-mapped token shards, a deterministic
//! data-parallel sampler, and the bundled self-generated dataset.
