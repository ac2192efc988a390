//! Procedural macros of Tessera's model DSL.
//!
//! The runtime crate `tessera` re-exports everything here; depend on
//! `tessera`, not on this crate. The DSL and every attribute are documented
//! on the re-exports, [`tessera::Module`](derive@Module) and
//! [`tessera::forward`](macro@forward).
//!
//! Organisation: `ast`/`attr` parse the user's struct into typed slots,
//! `check` validates it, `derive` and `forward` expand; nothing is emitted
//! before every error of an input has been collected.

mod ast;
mod attr;
mod check;
mod ctxt;
mod derive;
mod forward;
mod respan;
mod symbol;

use proc_macro::TokenStream;

/// Derives a model from a struct of layers (with `#[forward]`); the DSL and
/// every attribute are documented in the `tessera::guide` module.
#[proc_macro_derive(Module, attributes(shard, stage, recompute, precision, tied, model))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    derive::expand(input).into()
}

/// Generates `Module` (forward, backward, parameter visitor, stage entry
/// points) from a forward body; see the `tessera::guide` module.
#[proc_macro_attribute]
pub fn forward(args: TokenStream, input: TokenStream) -> TokenStream {
    if !args.is_empty() {
        let args = proc_macro2::TokenStream::from(args);
        return syn::Error::new_spanned(args, "`#[forward]` takes no arguments").to_compile_error().into();
    }
    let item = syn::parse_macro_input!(input as syn::ItemImpl);
    forward::attribute(item).into()
}

#[doc(hidden)]
#[proc_macro]
pub fn forward_impl(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as forward::Input);
    forward::expand(input).into()
}
