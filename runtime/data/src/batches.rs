//! The source of training microbatches a trainer draws from, the sampler as
//! one, and the bundled task's answer-only targets.

use super::{arith, Cursor, Sampler};
use serde_json::Value;
use tessera_core::Result;
use tessera_core::{Device, Tensor};

/// A stream of training microbatches for one data replica.
///
/// Implementations must be deterministic: the batches after
/// [`restore`](Self::restore)`(c)` are the ones that followed when
/// [`cursor`](Self::cursor) returned `c`, and the cursor is the same on
/// every replica after the same number of draws (it addresses the global
/// data order), so any replica's cursor restores all of them.
pub trait Batches: Send {
    /// The next `(inputs, targets)`, each `[micro_batch, seq_len]` of `u32` token ids.
    fn next_batch(&mut self, device: &Device) -> Result<(Tensor, Tensor)>;
    /// Where the stream stands.
    fn cursor(&self) -> Value;
    /// Goes back (or forward) to a cursor.
    fn restore(&mut self, cursor: &Value) -> Result<()>;
    /// Passes over everything drawn since `since` (a cursor this stream
    /// returned earlier) for good: the stream keeps its place, and never
    /// serves that data again, in this epoch or a later one; the exclusion
    /// is part of its cursor. The trainer calls it when it rolls back to the
    /// checkpoint that saved `since`.
    ///
    /// The default only keeps the place: a stream that cannot exclude data
    /// serves it again when it comes round (the [`Sampler`](Sampler)
    /// excludes it).
    fn exclude_since(&mut self, since: &Value) -> Result<()> {
        let _ = since;
        Ok(())
    }
    /// A target id that contributes no loss (positions not to learn), if the
    /// stream uses one.
    fn ignore_index(&self) -> Option<u32> {
        None
    }
}

impl Batches for Sampler {
    fn next_batch(&mut self, device: &Device) -> Result<(Tensor, Tensor)> {
        Sampler::next_batch(self, device)
    }

    fn cursor(&self) -> serde_json::Value {
        // A cursor is plain numbers and lists; it always serialises.
        Sampler::cursor(self).to_json().unwrap_or(serde_json::Value::Null)
    }

    fn restore(&mut self, cursor: &serde_json::Value) -> Result<()> {
        Sampler::restore(self, Cursor::from_json(cursor)?)
    }

    fn exclude_since(&mut self, since: &serde_json::Value) -> Result<()> {
        Sampler::exclude_since(self, &Cursor::from_json(since)?)
    }
}

/// The bundled addition task's batches with loss on the answers only.
///
/// The operand digits of a problem are random: predicting them teaches
/// nothing and their gradients are pure noise, which keeps a small model on
/// its loss plateau for many steps. With `AnswerTargets` every target but
/// the answer digits and the newline after them is [`IGNORE`](Self::IGNORE),
/// so the loss (and its gradient) is exactly that of the answers. Windows of
/// the bundled shards start at a line start, so a target's place in its
/// line is its position modulo [`arith::LINE_LEN`].
pub struct AnswerTargets(pub Sampler);

impl AnswerTargets {
    /// The ignored target id.
    pub const IGNORE: u32 = u32::MAX;
}

impl Batches for AnswerTargets {
    fn next_batch(&mut self, device: &Device) -> Result<(Tensor, Tensor)> {
        let (rows, seq) = (self.0.rows(), self.0.seq());
        let (inputs, mut targets) = self.0.next_ids()?;
        for (i, t) in targets.iter_mut().enumerate() {
            // Input position p of a line predicts character p + 1: the answer
            // is predicted from the `=` (p = PROMPT_LEN - 1) up to its newline.
            let p = (i % seq) % arith::LINE_LEN;
            if !(arith::PROMPT_LEN - 1..arith::PROMPT_LEN - 1 + arith::ANSWER_LEN).contains(&p) {
                *t = Self::IGNORE;
            }
        }
        Ok((Tensor::from_vec(inputs, [rows, seq], device)?, Tensor::from_vec(targets, [rows, seq], device)?))
    }

    fn cursor(&self) -> serde_json::Value {
        Batches::cursor(&self.0)
    }

    fn restore(&mut self, cursor: &serde_json::Value) -> Result<()> {
        Batches::restore(&mut self.0, cursor)
    }

    fn exclude_since(&mut self, since: &serde_json::Value) -> Result<()> {
        Batches::exclude_since(&mut self.0, since)
    }

    fn ignore_index(&self) -> Option<u32> {
        Some(Self::IGNORE)
    }
}
