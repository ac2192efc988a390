//! `#[derive(Module)]`: validates the struct's attributes and hands the
//! struct to the `#[forward]` expansion through a callback macro.
//!
//! A derive sees only the struct and an attribute on an `impl` sees only the
//! impl. The derive therefore emits a `macro_rules!` holding the struct and
//! imports it under the struct's own name in the macro namespace (`use
//! __tessera_model_Name as Name;`), so that wherever the struct's name
//! resolves (its module, another module that imports it, a path to it), the
//! `#[forward]` attribute can invoke `Name! { impl .. }`: the macro rule
//! forwards both the struct and the impl to `forward_impl!`, one procedural
//! macro that sees field types, field attributes and the forward body
//! together. That is what lets it name each sub-module's `Saved` type, apply
//! `#[recompute]`/`#[precision]`/`#[tied]` per call, and check pipeline
//! stages against the data flow, while layout mismatches are still reported
//! by rustc on the user's own expressions.

use crate::ast::Model;
use crate::check;
use crate::ctxt::Ctxt;
use crate::respan::respan;
use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote};

pub fn expand(input: syn::DeriveInput) -> TokenStream {
    let cx = Ctxt::new();
    let model = Model::from_item(&cx, &input);
    if let Some(m) = &model {
        check::check(&cx, m);
    }
    let callback = callback_macro(&input);
    let assertions = model.as_ref().map(assertions).unwrap_or_default();
    let consts = model.as_ref().map(static_dims).unwrap_or_default();
    let errors = cx.check().err().map(|e| e.to_compile_error());
    quote! {
        #callback
        #assertions
        #consts
        #errors
    }
}

/// The macro through which `#[forward]` reaches the struct's definition,
/// imported under the struct's name (macros and types live in separate
/// namespaces, so the name resolves to the struct as a type and to this
/// macro as a macro), and the marker `#[forward]` checks to say in words
/// that the derive is missing.
fn callback_macro(input: &syn::DeriveInput) -> TokenStream {
    let ident = &input.ident;
    let name = format_ident!("__tessera_model_{}", ident);
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    quote! {
        #[doc(hidden)]
        #[allow(unused_macros)]
        macro_rules! #name {
            ($($body:tt)*) => {
                ::tessera::__private::forward_impl! { { #input } $($body)* }
            };
        }
        #[doc(hidden)]
        #[allow(unused_imports)]
        pub(crate) use #name as #ident;

        #[automatically_derived]
        impl #impl_generics ::tessera::__private::Derived for #ident #ty_generics #where_clause {}
    }
}

/// Trait-bound checks spanned on the attributes, so rustc's error (worded by
/// the traits' `on_unimplemented`) lands on the user's attribute.
fn assertions(m: &Model) -> TokenStream {
    let p = quote!(::tessera::__private);
    let ident = &m.ident;
    let mut checks = Vec::new();
    // Every token of an assertion carries the attribute's location, so
    // rustc's error underlines the attribute that asked for the bound.
    let at = |span: Span, ts: TokenStream| respan(ts, Span::call_site().located_at(span));
    // The bounds the generated code relies on (a layer's role, a split
    // field being pipelined, tied layers having a weight) are where-clauses
    // of the `#[forward]` expansion, placed at the attributes; what only the
    // attribute promises is asserted here.
    for f in &m.fields {
        let ty = &f.ty;
        if let Some(r) = f.attrs.recompute {
            checks.push(at(r.span, quote!(#p::assert_recomputable::<#ty>();)));
            if r.value == crate::attr::Recompute::Selective {
                checks.push(at(r.span, quote!(#p::assert_selective::<#ty>();)));
            }
        }
    }
    // A model may contain attention anywhere below it: selective recompute
    // is accepted on it (and checked again on the layers it names).
    let (impl_generics, ty_generics, where_clause) = m.generics.split_for_impl();
    let recomputable = quote! {
        #[automatically_derived]
        impl #impl_generics #p::Recomputable for #ident #ty_generics #where_clause {}
        #[automatically_derived]
        impl #impl_generics #p::SelectiveRecomputable for #ident #ty_generics #where_clause {}
    };
    quote! {
        #recomputable
        const _: () = {
            #[allow(dead_code)]
            fn __tessera_assertions #impl_generics () #where_clause {
                #(#checks)*
            }
        };
    }
}

/// `#[model(tp = N, dims(..))]` as associated constants, so constructors
/// build the layers from the very numbers the compiler checked.
fn static_dims(m: &Model) -> TokenStream {
    let ident = &m.ident;
    let tp = m.attrs.tp.map(|tp| {
        let n = tp.value as usize;
        quote! {
            /// The static tensor-parallel degree declared by `#[model(tp = ..)]`.
            pub const TP: usize = #n;
        }
    });
    let dims = m.attrs.dims.iter().map(|(name, n)| {
        let c = format_ident!("{}", name.to_string().to_uppercase());
        let v = n.value as usize;
        let doc = format!("The dimension `{name}` declared by `#[model(dims(..))]`.");
        quote! {
            #[doc = #doc]
            pub const #c: usize = #v;
        }
    });
    if tp.is_none() && m.attrs.dims.is_empty() {
        return TokenStream::new();
    }
    let (impl_generics, ty_generics, where_clause) = m.generics.split_for_impl();
    quote! {
        #[automatically_derived]
        impl #impl_generics #ident #ty_generics #where_clause {
            #tp
            #(#dims)*
        }
    }
}
