//! Training data: tokenizers, memory-mapped token shards, a deterministic
//! data-parallel sampler, and the bundled self-generated dataset.
//!
//! Its place: beside the model stack, on the tensor core alone. It owns the
//! tokenizers (and the `tokenizers` dependency), the token-shard format, the
//! sampler and the [`Batches`] trait the trainer draws from. Users reach it as
//! `tessera::data`.
//!
//! - [`Tokenizer`]: a byte-level BPE (trained here or loaded from a
//!   `tokenizer.json`) or a character tokenizer ([`CharTokenizer`]).
//! - [`ShardWriter`] / [`Dataset`]: token ids in binary shards plus an
//!   `index.json`, read back memory-mapped ([`shards`] has the format);
//!   [`prepare()`] turns text files into such a dataset, as `tessera prepare` does.
//! - [`Sampler`]: training windows `[B, T]` split over data-parallel ranks,
//!   shuffled per epoch by a seed, with a serialisable [`Cursor`] for exact
//!   resume and a way to pass over data that made training unstable.
//! - [`arith`]: three-digit addition, generated from a seed, with a held-out
//!   split and an exact-match evaluator.
//!
//! A training loop uses them like this:
//!
//! ```no_run
//! use tessera::data::{arith, Cursor, Dataset, Sampler};
//! use tessera::Device;
//! # fn main() -> tessera::Result<()> {
//! let task = arith::Task::new(0);
//! task.write_shards("data/arith", 1 << 24)?; // or `tessera prepare --bundled arith`
//! let data = Dataset::open("data/arith")?;
//! let (dp_rank, dp_size, global_batch) = (0, 1, 32);
//! let mut sampler = Sampler::new(&data, global_batch, arith::SEQ, dp_rank, dp_size, 7)?;
//! let (inputs, targets) = sampler.next_batch(&Device::cpu())?; // u32 [32, 52] each
//! // ... train; save `sampler.cursor().to_json()?` in the checkpoint's `extra`
//! let saved = sampler.cursor().to_json()?;
//! sampler.restore(Cursor::from_json(&saved)?)?; // on resume
//! // after a loss spike: sampler.exclude_last_batch()?, reload, sampler.rewind(cursor)?
//! let report = task.eval(100, |prompt| {
//!     Ok(vec![0; arith::ANSWER_LEN]) // greedy decoding of the model goes here
//! })?;
//! println!("exact match {:.1}%", 100.0 * report.accuracy);
//! # Ok(()) }
//! ```

pub mod arith;
mod batches;
mod prepare;
mod sampler;
pub mod shards;
mod tokenizer;

pub use batches::{AnswerTargets, Batches};
pub use prepare::{input_files, prepare, TokenizerSource};
pub use sampler::{Cursor, OrderSpan, Sampler, Window, WindowRange};
pub use shards::{Dataset, Index, ShardEntry, ShardWriter, TokenDType};
pub use tokenizer::{CharTokenizer, SpecialTokens, Tokenizer, END_OF_TEXT};
