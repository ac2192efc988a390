//! Weight gradients put aside: the split backward of zero-bubble pipelines.
//!
//! A backward computes two things: the gradient of its input, which the
//! layer before (and, across a pipeline, the stage before) waits for, and the
//! gradients of its weights, which nothing waits for until the optimizer
//! step. A zero-bubble schedule runs the first half where 1F1B runs the whole
//! backward and the second later, where the stage would otherwise idle.
//!
//! While [`Cx::defer_weight_grads`] is on, every weight gradient a layer
//! computes through [`Cx::weight_grad`] (the products `dW = dYᵀ·X` of
//! `Linear` and the experts, the router's) is put aside with what it reads,
//! instead of being computed; [`Cx::take_weight_grads`] hands them over as a
//! [`WeightGrads`], and [`WeightGrads::run`] computes and delivers them, in
//! the order the backward met them. The cheap gradients of norms and
//! embeddings are computed at once either way.

use super::Cx;
use std::fmt;
use tessera_core::Result;

/// One weight-gradient computation put aside: it computes the gradient and
/// delivers it with [`Cx::grad`].
pub(super) type Job = Box<dyn FnOnce(&Cx) -> Result<()> + Send>;

/// The weight gradients a backward's input half put aside, in the order it
/// met them: between [`Cx::defer_weight_grads`] and
/// [`Cx::take_weight_grads`], each layer's `dW` products (`Linear`, the
/// experts, the router) are put aside with what they read, for
/// [`run`](Self::run) to compute later, where a zero-bubble pipeline
/// schedule has a stage idle. Norms' and embeddings' gradients, cheap, are
/// computed at once.
#[derive(Default)]
pub struct WeightGrads {
    /// Each job with the [`Cx::set_token_slice`] setting of the layer that
    /// put it aside, which decides how its gradient is delivered.
    jobs: Vec<(bool, Job)>,
}

impl WeightGrads {
    pub(super) fn push(&mut self, token_slice: bool, job: Job) {
        self.jobs.push((token_slice, job));
    }

    /// How many computations were put aside.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Whether nothing was put aside (a backward with no weights).
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Computes every gradient put aside and delivers it to its parameter,
    /// as the backward would have.
    pub fn run(self, cx: &mut Cx) -> Result<()> {
        for (token_slice, job) in self.jobs {
            let was = cx.set_token_slice(token_slice);
            let done = job(cx);
            cx.set_token_slice(was);
            done?;
        }
        Ok(())
    }
}

impl fmt::Debug for WeightGrads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WeightGrads({} put aside)", self.jobs.len())
    }
}
