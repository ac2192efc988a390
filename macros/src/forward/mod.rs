//! `#[forward]` and the `forward_impl!` it reaches through the derive's
//! callback: parse the body into SSA, check it, expand `Module`.

mod check;
mod expand;
mod parse;

use crate::ast::Model;
use crate::ctxt::Ctxt;
use proc_macro2::TokenStream;
use quote::quote;

/// `#[forward] impl Name { .. }` becomes `Name! { impl .. }`: the macro the
/// derive imported under the struct's name (see `derive.rs`), reached by the
/// same path as the type, so the impl may sit in any module that can name
/// the struct. A check placed at the type says in words when the struct has
/// no `#[derive(Module)]`.
pub fn attribute(item: syn::ItemImpl) -> TokenStream {
    let path = match &*item.self_ty {
        syn::Type::Path(p) if p.qself.is_none() && !p.path.segments.is_empty() => Some(p.path.clone()),
        _ => None,
    };
    let Some(mut path) = path else {
        return syn::Error::new_spanned(&item.self_ty, "`#[forward]` goes on `impl Model { fn forward(..) }` for a struct with `#[derive(Module)]`")
            .to_compile_error();
    };
    if let Some((_, tr, _)) = &item.trait_ {
        return syn::Error::new_spanned(tr, "`#[forward]` goes on an inherent impl (`impl Model { .. }`); it writes the `Module` impl itself")
            .to_compile_error();
    }
    path.segments.last_mut().expect("non-empty").arguments = syn::PathArguments::None;
    let self_ty = &item.self_ty;
    let span = syn::spanned::Spanned::span(self_ty);
    let (impl_generics, _, where_clause) = item.generics.split_for_impl();
    let check = crate::respan::respan(
        quote! {
            ::tessera::__private::assert_derived::<#self_ty>();
        },
        proc_macro2::Span::call_site().located_at(span),
    );
    quote! {
        const _: () = {
            #[allow(dead_code)]
            fn __tessera_forward_needs_derive #impl_generics () #where_clause {
                #check
            }
        };
        #path! { #item }
    }
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
