//! What the driver tests share: a model that fails on cue.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use tessera::module::{self, Cx};
use tessera_models::gpt2::Gpt2;

/// GPT-2 whose next forward fails or panics when the test says so.
pub struct Flaky {
    pub inner: Gpt2,
    /// 0: run; 1: fail the next forward; 2: panic in it.
    pub mode: Arc<AtomicU8>,
}

impl module::Module for Flaky {
    type In = module::Replicated;
    type Out = module::SplitHidden;
    type Saved = <Gpt2 as module::Module>::Saved;

    fn forward(&self, cx: &mut Cx, x: module::Act<Self::In>) -> tessera::Result<(module::Act<Self::Out>, Self::Saved)> {
        match self.mode.swap(0, Ordering::AcqRel) {
            1 => Err(tessera::Error::invalid("Flaky::forward", "an injected failure")),
            2 => panic!("an injected panic"),
            _ => self.inner.forward(cx, x),
        }
    }

    fn backward(&self, cx: &mut Cx, saved: Self::Saved, dy: module::Act<Self::Out>) -> tessera::Result<module::Act<Self::In>> {
        self.inner.backward(cx, saved, dy)
    }

    fn visit_params(&self, v: &mut module::Visitor<'_>) -> tessera::Result<()> {
        self.inner.visit_params(v)
    }
}
