//! Generates `Module` for a model: the forward over the SSA nodes with a
//! typed `Saved` struct, the backward as their reverse, the parameter
//! visitor and weight tying.

use super::parse::{Func, Node, Op, Program};
use crate::ast::{Field, Model};
use crate::attr::{Precision, Recompute};
use proc_macro2::TokenStream;
use quote::{format_ident, quote, quote_spanned};

fn p() -> TokenStream {
    quote!(::tessera::__private)
}

fn v(i: usize) -> syn::Ident {
    format_ident!("__v{}", i)
}
fn g(i: usize) -> syn::Ident {
    format_ident!("__g{}", i)
}
fn s(i: usize) -> syn::Ident {
    format_ident!("__s{}", i)
}

fn role(f: &Field) -> TokenStream {
    let p = p();
    let r = format_ident!("{}", f.attrs.shard.map(|s| s.value.role()).unwrap_or("Plain"));
    quote!(#p::#r)
}

/// `<Ty as Module<Role>>`, the sub-module as its parent uses it.
fn as_module(f: &Field) -> TokenStream {
    let p = p();
    let ty = &f.ty;
    let r = role(f);
    quote!(<#ty as #p::Module<#r>>)
}

fn dtype(pr: Precision) -> TokenStream {
    let p = p();
    let d = format_ident!("{}", pr.dtype());
    quote!(#p::DType::#d)
}

struct Gen<'a> {
    m: &'a Model,
    prog: &'a Program,
    /// The layout type of every node's value.
    layouts: Vec<TokenStream>,
}

impl<'a> Gen<'a> {
    fn new(m: &'a Model, prog: &'a Program) -> Self {
        let p = p();
        let mut layouts: Vec<TokenStream> = Vec::new();
        for n in &prog.nodes {
            let l = match &n.op {
                Op::Input => {
                    let t = &prog.in_layout;
                    quote!(#t)
                }
                Op::Call(f) => {
                    let m = as_module(m.field(f).expect("checked"));
                    quote!(#m::Out)
                }
                Op::Func(Func::AllReduce | Func::AllGather) => quote!(#p::Replicated),
                Op::Func(Func::ReduceScatter) => quote!(#p::SplitSeq),
                Op::Add | Op::Mul | Op::Func(_) => layouts[n.args[0]].clone(),
            };
            layouts.push(l);
        }
        Gen { m, prog, layouts }
    }

    fn field(&self, n: &Node) -> Option<&'a Field> {
        match &n.op {
            Op::Call(f) => self.m.field(f),
            _ => None,
        }
    }

    /// The type of what node `n` keeps for the backward, if anything.
    fn saved_type(&self, n: &Node) -> Option<TokenStream> {
        let p = p();
        match &n.op {
            Op::Call(_) => {
                let f = self.field(n).expect("checked");
                let m = as_module(f);
                Some(if f.attrs.recompute.is_some() { quote!(#p::Kept<#m::Saved, #m::In>) } else { quote!(#m::Saved) })
            }
            Op::Mul | Op::Func(Func::Gelu | Func::Silu | Func::Swiglu) => Some(quote!(#p::dsl::Inputs)),
            _ => None,
        }
    }

    fn saved_struct_name(&self) -> syn::Ident {
        format_ident!("__TesseraSaved{}", self.m.ident)
    }

    fn saved_struct(&self) -> TokenStream {
        let name = self.saved_struct_name();
        let vis = &self.m.vis;
        let fields = self.prog.nodes.iter().enumerate().filter_map(|(i, n)| {
            let t = self.saved_type(n)?;
            let s = s(i);
            Some(quote!(#s: #t))
        });
        let doc = format!("What `{}`'s forward keeps for its backward: one field per stored activation.", self.m.ident);
        quote! {
            #[doc = #doc]
            #[doc(hidden)]
            #[allow(non_camel_case_types, dead_code)]
            #vis struct #name { #(#fields,)* }
        }
    }

    fn forward_node(&self, i: usize, n: &Node) -> TokenStream {
        let p = p();
        let (out, sv) = (v(i), s(i));
        let args: Vec<syn::Ident> = n.args.iter().map(|&a| v(a)).collect();
        // Resolve names as the generated code does, but report at the user's expression.
        let span = proc_macro2::Span::call_site().located_at(n.span);
        match &n.op {
            Op::Input => unreachable!("the input is bound by the signature"),
            Op::Call(fname) => {
                let f = self.field(n).expect("checked");
                let ty = &f.ty;
                let r = role(f);
                let name = fname.to_string();
                let a = &args[0];
                let arg = match f.attrs.precision {
                    Some(_) => quote!(#p::dsl::cast(#a.clone(), __region)?),
                    None => quote!(#a.clone()),
                };
                let call = match f.attrs.recompute {
                    Some(rc) => {
                        let mode = match rc.value {
                            Recompute::Full => quote!(#p::Recompute::Full),
                            Recompute::Selective => quote!(#p::Recompute::Selective),
                        };
                        quote_spanned!(span=> #p::call_recompute::<#r, #ty, _>(&self.#fname, __cx, #name, #arg, #mode))
                    }
                    None => quote_spanned!(span=> #p::call::<#r, #ty, _>(&self.#fname, __cx, #name, #arg)),
                };
                match f.attrs.precision {
                    Some(pr) => {
                        let d = dtype(pr.value);
                        quote! {
                            let (#out, #sv) = {
                                let __outer = __cx.compute_dtype();
                                let __region = #p::dsl::region_dtype(__outer, #d);
                                __cx.set_compute_dtype(__region);
                                let __r = #call;
                                __cx.set_compute_dtype(__outer);
                                let (__y, __s) = __r?;
                                (#p::dsl::cast(__y, __outer)?, __s)
                            };
                        }
                    }
                    None => quote!(let (#out, #sv) = #call?;),
                }
            }
            Op::Add => {
                let (a, b) = (&args[0], &args[1]);
                quote_spanned!(span=> let #out = #p::dsl::add(#a.clone(), #b.clone())?;)
            }
            Op::Mul => {
                let (a, b) = (&args[0], &args[1]);
                quote_spanned!(span=> let (#out, #sv) = #p::dsl::mul(#a.clone(), #b.clone())?;)
            }
            Op::Func(func) => {
                let fname = format_ident!("{}", func.name());
                match func {
                    Func::Gelu | Func::Silu => {
                        let a = &args[0];
                        quote_spanned!(span=> let (#out, #sv) = #p::dsl::#fname(#a.clone())?;)
                    }
                    Func::Swiglu => {
                        let (a, b) = (&args[0], &args[1]);
                        quote_spanned!(span=> let (#out, #sv) = #p::dsl::swiglu(#a.clone(), #b.clone())?;)
                    }
                    Func::AllReduce | Func::ReduceScatter | Func::AllGather => {
                        let a = &args[0];
                        quote_spanned!(span=> let #out = #p::dsl::#fname(__cx, #a.clone())?;)
                    }
                }
            }
        }
    }

    fn backward_node(&self, i: usize, n: &Node) -> TokenStream {
        let p = p();
        let (gy, sv) = (g(i), s(i));
        let ga: Vec<syn::Ident> = n.args.iter().map(|&a| g(a)).collect();
        let la: Vec<&TokenStream> = n.args.iter().map(|&a| &self.layouts[a]).collect();
        let body = match &n.op {
            Op::Input => return TokenStream::new(),
            Op::Call(fname) => {
                let f = self.field(n).expect("checked");
                let ty = &f.ty;
                let r = role(f);
                let name = fname.to_string();
                let call = if f.attrs.recompute.is_some() {
                    quote!(#p::call_recompute_backward::<#r, #ty>(&self.#fname, __cx, #name, #sv, __gy))
                } else {
                    quote!(#p::call_backward::<#r, #ty>(&self.#fname, __cx, #name, #sv, __gy))
                };
                let a = &ga[0];
                match f.attrs.precision {
                    Some(pr) => {
                        let d = dtype(pr.value);
                        quote! {
                            let __outer = __cx.compute_dtype();
                            let __region = #p::dsl::region_dtype(__outer, #d);
                            __cx.set_compute_dtype(__region);
                            let __gy = #p::dsl::cast(__gy, __region)?;
                            let __r = #call;
                            __cx.set_compute_dtype(__outer);
                            #p::dsl::accumulate(&mut #a, #p::dsl::relabel(#p::dsl::cast(__r?, __outer)?))?;
                        }
                    }
                    None => quote!(#p::dsl::accumulate(&mut #a, #p::dsl::relabel(#call?))?;),
                }
            }
            Op::Add => {
                let (a, b, ta, tb) = (&ga[0], &ga[1], la[0], la[1]);
                quote! {
                    let (__da, __db) = #p::dsl::add_backward::<#ta, #tb>(__gy);
                    #p::dsl::accumulate(&mut #a, __da)?;
                    #p::dsl::accumulate(&mut #b, __db)?;
                }
            }
            Op::Mul | Op::Func(Func::Swiglu) => {
                let (a, b, ta, tb) = (&ga[0], &ga[1], la[0], la[1]);
                let f = if matches!(n.op, Op::Mul) { format_ident!("mul_backward") } else { format_ident!("swiglu_backward") };
                quote! {
                    let (__da, __db) = #p::dsl::#f::<#ta, #tb>(#sv, __gy)?;
                    #p::dsl::accumulate(&mut #a, __da)?;
                    #p::dsl::accumulate(&mut #b, __db)?;
                }
            }
            Op::Func(func @ (Func::Gelu | Func::Silu)) => {
                let f = format_ident!("{}_backward", func.name());
                let a = &ga[0];
                quote!(#p::dsl::accumulate(&mut #a, #p::dsl::#f(#sv, __gy)?)?;)
            }
            Op::Func(Func::AllReduce) => {
                let a = &ga[0];
                quote!(#p::dsl::accumulate(&mut #a, #p::dsl::relabel(#p::dsl::all_reduce_backward(__gy)))?;)
            }
            Op::Func(func @ (Func::ReduceScatter | Func::AllGather)) => {
                let f = format_ident!("{}_backward", func.name());
                let a = &ga[0];
                quote!(#p::dsl::accumulate(&mut #a, #p::dsl::relabel(#p::dsl::#f(__cx, __gy)?))?;)
            }
        };
        quote! {
            if let ::core::option::Option::Some(__gy) = #gy.take() {
                #body
            }
        }
    }

    /// The fields the forward calls, in declaration order, each visited once.
    fn used_fields(&self) -> Vec<&'a Field> {
        self.m
            .fields
            .iter()
            .filter(|f| self.prog.nodes.iter().any(|n| matches!(&n.op, Op::Call(c) if *c == f.ident)))
            .collect()
    }

    fn module_impl(&self) -> TokenStream {
        let p = p();
        let ident = &self.m.ident;
        let in_l = &self.prog.in_layout;
        let out_l = &self.prog.out_layout;
        let saved = self.saved_struct_name();
        let nodes = &self.prog.nodes;

        let fwd: Vec<TokenStream> = nodes.iter().enumerate().skip(1).map(|(i, n)| self.forward_node(i, n)).collect();
        let saved_fields: Vec<syn::Ident> = nodes.iter().enumerate().filter(|(_, n)| self.saved_type(n).is_some()).map(|(i, _)| s(i)).collect();
        let out_node = v(self.prog.output);
        let out_span = proc_macro2::Span::call_site().located_at(self.prog.nodes[self.prog.output].span);
        let out = quote_spanned!(out_span=> #p::dsl::returns::<#out_l, _>(#out_node));
        let slots = nodes.iter().enumerate().map(|(i, _)| {
            let gi = g(i);
            let l = &self.layouts[i];
            quote!(let mut #gi: ::core::option::Option<#p::Act<#l>> = ::core::option::Option::None;)
        });
        let bwd: Vec<TokenStream> = nodes.iter().enumerate().rev().map(|(i, n)| self.backward_node(i, n)).collect();
        let g_out = g(self.prog.output);
        let (v0, g0) = (v(0), g(0));

        let model_dtype = self.m.attrs.precision.map(|pr| dtype(pr.value));
        let (enter, exit_fwd, exit_bwd) = match &model_dtype {
            Some(d) => (
                quote!(let __outer = __cx.compute_dtype(); let __region = #p::dsl::region_dtype(__outer, #d); __cx.set_compute_dtype(__region);),
                quote!(__cx.set_compute_dtype(__outer); let (__y, __s) = __r?; Ok((#p::dsl::cast(__y, __outer)?, __s))),
                quote!(__cx.set_compute_dtype(__outer); #p::dsl::cast(__r?, __outer)),
            ),
            None => (quote!(), quote!(__r), quote!(__r)),
        };
        let (in_cast, dy_cast) = match &model_dtype {
            Some(_) => (quote!(#p::dsl::cast(__x, __region)?), quote!(#p::dsl::cast(__dy, __region)?)),
            None => (quote!(__x), quote!(__dy)),
        };
        let input_name = self.prog.input.to_string();

        let used = self.used_fields();
        let visits = used.iter().map(|f| {
            let fname = &f.ident;
            let name = fname.to_string();
            let r = role(f);
            let m = as_module(f);
            quote!(__v.child::<#r>(#name, |__v| #m::visit_params(&self.#fname, __v))?;)
        });
        let ties = self.m.fields.iter().filter_map(|f| {
            let partner = f.attrs.tied.as_ref()?;
            let fname = &f.ident;
            Some(quote! {
                let __w = #p::Tie::weight(&self.#partner).clone();
                #p::Tie::tie_weight(&mut self.#fname, &__w)?;
            })
        });
        let checks = used.iter().map(|f| {
            let fname = &f.ident;
            let name = fname.to_string();
            let m = as_module(f);
            quote!(#m::check_tp(&self.#fname, &#p::join_path(__path, #name), __degree, __problems);)
        });
        let child_ties = used.iter().map(|f| {
            let fname = &f.ident;
            let m = as_module(f);
            quote!(#m::tie_params(&mut self.#fname)?;)
        });

        quote! {
            #[automatically_derived]
            impl #p::Module for #ident {
                type In = #in_l;
                type Out = #out_l;
                type Saved = #saved;

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn forward(&self, __cx: &mut #p::Cx, __x: #p::Act<#in_l>) -> #p::Result<(#p::Act<#out_l>, #saved)> {
                    #enter
                    let __r = (|__cx: &mut #p::Cx| -> #p::Result<(#p::Act<_>, #saved)> {
                        let #v0 = #in_cast;
                        #(#fwd)*
                        ::core::result::Result::Ok((#out, #saved { #(#saved_fields,)* }))
                    })(__cx);
                    #exit_fwd
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn backward(&self, __cx: &mut #p::Cx, __saved: #saved, __dy: #p::Act<#out_l>) -> #p::Result<#p::Act<#in_l>> {
                    #enter
                    let __r = (|__cx: &mut #p::Cx| -> #p::Result<#p::Act<#in_l>> {
                        let #saved { #(#saved_fields,)* } = __saved;
                        #(#slots)*
                        #p::dsl::accumulate(&mut #g_out, #dy_cast)?;
                        #(#bwd)*
                        #g0.ok_or_else(|| #p::Error::InvalidArgument {
                            op: "backward",
                            detail: ::std::format!("the output of `{}` does not depend on its input `{}`", ::core::stringify!(#ident), #input_name),
                        })
                    })(__cx);
                    #exit_bwd
                }

                fn visit_params(&self, __v: &mut #p::Visitor<'_>) -> #p::Result<()> {
                    #(#visits)*
                    ::core::result::Result::Ok(())
                }

                fn check_tp(&self, __path: &str, __degree: usize, __problems: &mut ::std::vec::Vec<::std::string::String>) {
                    #(#checks)*
                }

                fn tie_params(&mut self) -> #p::Result<()> {
                    #(#ties)*
                    #(#child_ties)*
                    ::core::result::Result::Ok(())
                }
            }
        }
    }
}

pub fn expand(m: &Model, prog: &Program) -> TokenStream {
    let gen = Gen::new(m, prog);
    let saved = gen.saved_struct();
    let imp = gen.module_impl();
    quote! {
        #saved
        #imp
    }
}

/// After an error: a `Module` impl with the declared layouts and no body, so
/// one mistake does not cascade into errors wherever the model is used.
pub fn fallback(m: &Model, prog: Option<&Program>) -> TokenStream {
    let Some(prog) = prog else { return TokenStream::new() };
    let p = p();
    let ident = &m.ident;
    let (in_l, out_l) = (&prog.in_layout, &prog.out_layout);
    quote! {
        #[automatically_derived]
        impl #p::Module for #ident {
            type In = #in_l;
            type Out = #out_l;
            type Saved = ();
            fn forward(&self, _: &mut #p::Cx, _: #p::Act<#in_l>) -> #p::Result<(#p::Act<#out_l>, ())> {
                ::core::unreachable!("this model did not compile")
            }
            fn backward(&self, _: &mut #p::Cx, _: (), _: #p::Act<#out_l>) -> #p::Result<#p::Act<#in_l>> {
                ::core::unreachable!("this model did not compile")
            }
            fn visit_params(&self, _: &mut #p::Visitor<'_>) -> #p::Result<()> {
                ::core::unreachable!("this model did not compile")
            }
        }
    }
}
