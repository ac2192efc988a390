//! `#[forward]` and the `forward_impl!` it reaches through the derive's
//! callback: parse the body into SSA, check it, expand `Module`.

mod check;
mod expand;
mod parse;

use crate::ast::Model;
use crate::ctxt::Ctxt;
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

/// `#[forward] impl Name { .. }` becomes `__derive_Module_of_Name! { impl .. }`.
pub fn attribute(item: syn::ItemImpl) -> TokenStream {
    let name = match &*item.self_ty {
        syn::Type::Path(p) if p.qself.is_none() => p.path.segments.last().map(|s| s.ident.clone()),
        _ => None,
    };
    let Some(name) = name else {
        return syn::Error::new_spanned(&item.self_ty, "`#[forward]` goes on `impl Model { fn forward(..) }` for a struct with `#[derive(Module)]`")
            .to_compile_error();
    };
    if let Some((_, tr, _)) = &item.trait_ {
        return syn::Error::new_spanned(tr, "`#[forward]` goes on an inherent impl (`impl Model { .. }`); it writes the `Module` impl itself").to_compile_error();
    }
    let callback = format_ident!("__derive_Module_of_{}", name);
    quote!(#callback! { #item })
}

/// Input: `{ struct } impl ..`, as assembled by the derive's callback.
pub struct Input {
    pub item: syn::DeriveInput,
    pub imp: syn::ItemImpl,
}

impl syn::parse::Parse for Input {
    fn parse(input: syn::parse::ParseStream) -> syn::Result<Self> {
        let content;
        syn::braced!(content in input);
        Ok(Input { item: content.parse()?, imp: input.parse()? })
    }
}

pub fn expand(input: Input) -> TokenStream {
    // The derive already reported problems with the struct's attributes;
    // here they only decide whether to expand or fall back.
    let struct_cx = Ctxt::new();
    let model = Model::from_item(&struct_cx, &input.item);
    if let Some(m) = &model {
        crate::check::check(&struct_cx, m);
    }
    let struct_ok = struct_cx.check().is_ok();

    let cx = Ctxt::new();
    let prog = parse::parse(&cx, &input.imp);
    let Some(model) = model else {
        let _ = cx.check();
        return TokenStream::new();
    };
    if !struct_ok {
        // The derive reported the struct's mistakes; a placeholder keeps the
        // model's uses elsewhere from adding errors of their own.
        let _ = cx.check();
        return expand::fallback(&model, prog.as_ref());
    }
    // Rules on the data flow only make sense over a body that parsed whole.
    if let (Some(p), false) = (&prog, cx.has_errors()) {
        check::check(&cx, &model, p);
    }
    match cx.check() {
        Ok(()) => expand::expand(&model, prog.as_ref().expect("no errors")),
        Err(e) => {
            let fallback = expand::fallback(&model, prog.as_ref());
            let e = e.to_compile_error();
            quote!(#e #fallback)
        }
    }
}
