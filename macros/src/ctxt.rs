//! Collects every error of one macro input so the user sees them all in one build.

use std::cell::RefCell;
use std::fmt::Display;

/// An error sink that must be emptied with [`Ctxt::check`] before it drops.
#[derive(Default)]
pub struct Ctxt {
    errors: RefCell<Option<Vec<syn::Error>>>,
}

impl Ctxt {
    pub fn new() -> Self {
        Ctxt { errors: RefCell::new(Some(Vec::new())) }
    }

    /// Records an error at the span of `tokens`.
    pub fn error_spanned_by<T: quote::ToTokens, M: Display>(&self, tokens: T, message: M) {
        self.push(syn::Error::new_spanned(tokens.into_token_stream(), message));
    }

    /// Records an error at `span`.
    pub fn error_at<M: Display>(&self, span: proc_macro2::Span, message: M) {
        self.push(syn::Error::new(span, message));
    }

    /// Records a parser's error.
    pub fn syn_error(&self, err: syn::Error) {
        self.push(err);
    }

    fn push(&self, err: syn::Error) {
        self.errors.borrow_mut().as_mut().expect("Ctxt used after check").push(err);
    }

    /// Whether any error was recorded so far.
    pub fn has_errors(&self) -> bool {
        self.errors.borrow().as_ref().is_some_and(|e| !e.is_empty())
    }

    /// Ends the collection: all errors combined into one, or `Ok`.
    pub fn check(self) -> syn::Result<()> {
        let mut errors = self.errors.borrow_mut().take().expect("Ctxt checked twice").into_iter();
        let Some(mut combined) = errors.next() else { return Ok(()) };
        for e in errors {
            combined.combine(e);
        }
        Err(combined)
    }
}

impl Drop for Ctxt {
    fn drop(&mut self) {
        if !std::thread::panicking() && self.errors.borrow().is_some() {
            panic!("forgot to check for errors");
        }
    }
}
