//! Generates `Module` for a model: the forward over the SSA nodes with a
//! typed `Saved` struct, the backward as their reverse, the parameter
//! visitor and weight tying.

use super::parse::{Func, Node, Op, Program};
use crate::ast::{Field, Model};
use crate::attr::{Precision, Recompute, Stage};
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

    /// The bounds the generated code needs of the fields, each placed at the
    /// attribute that asks for it: if one fails, rustc reports it there, and
    /// the bodies (which assume it) add no follow-on errors.
    fn bounds(&self) -> TokenStream {
        let p = p();
        let mut b = Vec::new();
        let at = |span: proc_macro2::Span, ts: TokenStream| crate::respan::respan(ts, proc_macro2::Span::call_site().located_at(span));
        for f in self.used_fields() {
            let ty = &f.ty;
            if let Some(sh) = f.attrs.shard {
                let r = role(f);
                // The role fixes the layouts (for vocab, the input): stating
                // them lets the bodies use concrete layouts even when the
                // bound fails, so a wrong role is reported once, here.
                let layouts = match sh.value {
                    crate::attr::Shard::Column => quote!(In = #p::Replicated, Out = #p::SplitHidden),
                    crate::attr::Shard::Row => quote!(In = #p::SplitHidden, Out = #p::PartialSum),
                    crate::attr::Shard::Vocab => quote!(In = #p::Replicated),
                };
                b.push(at(sh.span, quote!(#ty: #p::Module<#r, #layouts>)));
            }
            if let Some(st) = f.attrs.stage.filter(|s| s.value == Stage::Split) {
                b.push(at(st.span, quote!(#ty: #p::Pipelined)));
            }
        }
        for f in &self.m.fields {
            let Some(partner) = &f.attrs.tied else { continue };
            let ty = &f.ty;
            b.push(at(partner.span(), quote!(#ty: #p::Tie)));
            if let Some(pf) = self.m.field(partner) {
                let pty = &pf.ty;
                b.push(at(partner.span(), quote!(#pty: #p::Tie)));
            }
        }
        if b.is_empty() {
            TokenStream::new()
        } else {
            quote!(where #(#b),*)
        }
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

    fn forward_node(&self, i: usize, n: &Node) -> TokenStream {
        let p = p();
        let (out, sv) = (v(i), s(i));
        // Resolve names as the generated code does, but report at the user's
        // expression: every token of a checked call carries this span, so the
        // error underlines the user's code and nothing of the macro's.
        let span = proc_macro2::Span::call_site().located_at(n.span);
        let ps = quote_spanned!(span=> ::tessera::__private);
        let args: Vec<syn::Ident> = n.args.iter().map(|&a| syn::Ident::new(&format!("__v{a}"), span)).collect();
        // Both layouts named explicitly: inference would otherwise equate them
        // from the bound and report a bare type mismatch instead of its message.
        let lts: Vec<TokenStream> = n.args.iter().map(|&a| crate::respan::respan(self.layouts[a].clone(), span)).collect();
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
                        quote_spanned!(span=> #ps::call_recompute::<#r, #ty, _>(&self.#fname, __cx, #name, #arg, #mode))
                    }
                    None => quote_spanned!(span=> #ps::call::<#r, #ty, _>(&self.#fname, __cx, #name, #arg)),
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
                {
                    let (ta, tb) = (&lts[0], &lts[1]);
                    quote_spanned!(span=> let #out = #ps::dsl::add::<#ta, #tb>(#a.clone(), #b.clone())?;)
                }
            }
            Op::Mul => {
                let (a, b) = (&args[0], &args[1]);
                {
                    let (ta, tb) = (&lts[0], &lts[1]);
                    quote_spanned!(span=> let (#out, #sv) = #ps::dsl::mul::<#ta, #tb>(#a.clone(), #b.clone())?;)
                }
            }
            Op::Func(func) => {
                let fname = format_ident!("{}", func.name());
                match func {
                    Func::Gelu | Func::Silu => {
                        let a = &args[0];
                        quote_spanned!(span=> let (#out, #sv) = #ps::dsl::#fname(#a.clone())?;)
                    }
                    Func::Swiglu => {
                        let (a, b) = (&args[0], &args[1]);
                        {
                        let (ta, tb) = (&lts[0], &lts[1]);
                        quote_spanned!(span=> let (#out, #sv) = #ps::dsl::swiglu::<#ta, #tb>(#a.clone(), #b.clone())?;)
                    }
                    }
                    Func::AllReduce | Func::ReduceScatter | Func::AllGather => {
                        let a = &args[0];
                        quote_spanned!(span=> let #out = #ps::dsl::#fname(__cx, #a.clone())?;)
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
                quote!(#p::dsl::accumulate(&mut #a, #p::dsl::relabel(#p::dsl::all_reduce_backward(__cx, __gy)?))?;)
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

    /// The forward and backward bodies of a part of the program: `nodes`
    /// (in order) read the value of `entry` from the argument `__x` and
    /// produce `exit`. The whole model is one part; pipeline stages are three.
    fn part(&self, part: &Part) -> PartCode {
        let p = p();
        let saved = &part.saved;
        let nodes = &self.prog.nodes;
        let fwd: Vec<TokenStream> = part.nodes.iter().map(|&i| self.forward_node(i, &nodes[i])).collect();
        let saved_fields: Vec<syn::Ident> = part.nodes.iter().filter(|&&i| self.saved_type(&nodes[i]).is_some()).map(|&i| s(i)).collect();
        let saved_types: Vec<TokenStream> = part.nodes.iter().filter_map(|&i| self.saved_type(&nodes[i])).collect();
        let exit = v(part.exit);
        let out_l = &part.out_l;
        let out = if part.check_output {
            let span = proc_macro2::Span::call_site().located_at(nodes[part.exit].span);
            let exit = syn::Ident::new(&format!("__v{}", part.exit), span);
            quote_spanned!(span=> ::tessera::__private::dsl::returns::<#out_l, _>(#exit))
        } else {
            quote!(#exit)
        };
        let slot_ids: Vec<usize> = std::iter::once(part.entry).chain(part.nodes.iter().copied()).collect();
        let slots = slot_ids.iter().map(|&i| {
            let gi = g(i);
            let l = &self.layouts[i];
            quote!(let mut #gi: ::core::option::Option<#p::Act<#l>> = ::core::option::Option::None;)
        });
        let bwd: Vec<TokenStream> = part.nodes.iter().rev().map(|&i| self.backward_node(i, &nodes[i])).collect();
        let (g_exit, v_entry, g_entry) = (g(part.exit), v(part.entry), g(part.entry));
        let (enter, exit_fwd, exit_bwd, in_cast, dy_cast) = self.model_precision();
        let ident = &self.m.ident;
        let input_name = self.prog.input.to_string();
        let vis = &self.m.vis;
        let bounds = self.bounds();
        let doc = format!("What part of `{ident}`'s forward keeps for its backward: one field per stored activation.");
        PartCode {
            saved_def: quote! {
                #[doc = #doc]
                #[doc(hidden)]
                #[allow(non_camel_case_types, dead_code)]
                #vis struct #saved #bounds { #(#saved_fields: #saved_types,)* }
            },
            forward: quote! {
                #enter
                let __r = (|__cx: &mut #p::Cx| -> #p::Result<(#p::Act<#out_l>, #saved)> {
                    let #v_entry = #in_cast;
                    #(#fwd)*
                    ::core::result::Result::Ok((#out, #saved { #(#saved_fields,)* }))
                })(__cx);
                #exit_fwd
            },
            backward: quote! {
                #enter
                let __r = (|__cx: &mut #p::Cx| {
                    let #saved { #(#saved_fields,)* } = __saved;
                    #(#slots)*
                    #p::dsl::accumulate(&mut #g_exit, #p::dsl::relabel(#dy_cast))?;
                    #(#bwd)*
                    #g_entry.ok_or_else(|| #p::Error::InvalidArgument {
                        op: "backward",
                        detail: ::std::format!("the output of `{}` does not depend on its input `{}`", ::core::stringify!(#ident), #input_name),
                    })
                })(__cx);
                #exit_bwd
            },
        }
    }

    /// Entering and leaving the model's `#[model(precision = ..)]` region.
    fn model_precision(&self) -> (TokenStream, TokenStream, TokenStream, TokenStream, TokenStream) {
        let p = p();
        match self.m.attrs.precision.map(|pr| dtype(pr.value)) {
            Some(d) => (
                quote!(let __outer = __cx.compute_dtype(); let __region = #p::dsl::region_dtype(__outer, #d); __cx.set_compute_dtype(__region);),
                quote!(__cx.set_compute_dtype(__outer); let (__y, __s) = __r?; Ok((#p::dsl::cast(__y, __outer)?, __s))),
                quote!(__cx.set_compute_dtype(__outer); #p::dsl::cast(__r?, __outer)),
                quote!(#p::dsl::cast(__x, __region)?),
                quote!(#p::dsl::cast(__dy, __region)?),
            ),
            None => (quote!(), quote!(__r), quote!(__r), quote!(__x), quote!(__dy)),
        }
    }

    fn module_impl(&self) -> TokenStream {
        let p = p();
        let ident = &self.m.ident;
        let in_l = &self.prog.in_layout;
        let out_l = &self.prog.out_layout;
        let bounds = self.bounds();
        let whole = Part {
            saved: self.saved_struct_name(),
            entry: 0,
            nodes: (1..self.prog.nodes.len()).collect(),
            exit: self.prog.output,
            out_l: quote!(#out_l),
            check_output: true,
        };
        let saved = &whole.saved;
        let PartCode { saved_def, forward, backward } = self.part(&whole);

        let used = self.used_fields();
        let split = self.split_node();
        let visits = used.iter().map(|f| {
            let fname = &f.ident;
            let name = fname.to_string();
            let r = role(f);
            let m = as_module(f);
            let visit = quote!(__v.child::<#r>(#name, |__v| #m::visit_params(&self.#fname, __v)));
            match split {
                // A pipelined model tells the visitor which stage each field is on.
                Some(split) => match self.stage_part(f, split) {
                    FieldPart::Split => quote!(__v.split_field(|__v| #visit)?;),
                    FieldPart::Part(part) => quote!(__v.stage_part(#p::StagePart::#part, |__v| #visit)?;),
                },
                None => quote!(#visit?;),
            }
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
            #saved_def

            #[automatically_derived]
            impl #p::Module for #ident #bounds {
                type In = #in_l;
                type Out = #out_l;
                type Saved = #saved;

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn forward(&self, __cx: &mut #p::Cx, __x: #p::Act<#in_l>) -> #p::Result<(#p::Act<#out_l>, #saved)> {
                    #forward
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn backward(&self, __cx: &mut #p::Cx, __saved: #saved, __dy: #p::Act<#out_l>) -> #p::Result<#p::Act<#in_l>> {
                    #backward
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

    /// The node calling the `#[stage(split)]` field, if the model has one.
    fn split_node(&self) -> Option<usize> {
        self.prog.nodes.iter().position(|n| self.field(n).is_some_and(|f| f.attrs.stage.is_some_and(|s| s.value == Stage::Split)))
    }

    /// Which part of the pipeline cut at node `split` runs field `f`: the
    /// split field itself, the part before it (the first stage), the part
    /// after it (the last stage), or both (every stage holds it).
    fn stage_part(&self, f: &Field, split: usize) -> FieldPart {
        let before = before_split(self.prog, split);
        let calls: Vec<usize> = self.prog.nodes.iter().enumerate().filter(|(_, n)| matches!(&n.op, Op::Call(c) if *c == f.ident)).map(|(i, _)| i).collect();
        if calls.contains(&split) {
            return FieldPart::Split;
        }
        let first = calls.iter().any(|i| before.contains(i));
        let last = calls.iter().any(|i| !before.contains(i));
        FieldPart::Part(match (first, last) {
            (true, false) => format_ident!("First"),
            (false, true) => format_ident!("Last"),
            _ => format_ident!("Whole"),
        })
    }

    /// Pipeline entry points when one field is `#[stage(split)]`: the part
    /// before the split field, a range of its layers, and the part after.
    fn stage_impl(&self) -> TokenStream {
        let Some(split) = self.split_node() else {
            return TokenStream::new();
        };
        let f = self.field(&self.prog.nodes[split]).expect("the split node calls a field");
        let p = p();
        let ident = &self.m.ident;
        let bounds = self.bounds();
        let (in_l, out_l) = (&self.prog.in_layout, &self.prog.out_layout);
        let ty = &f.ty;
        let fname = &f.ident;
        let name = fname.to_string();
        let m = quote!(<#ty as #p::Module<#p::Plain>>);
        let before = before_split(self.prog, split);
        let first = Part {
            saved: format_ident!("__TesseraSaved{}First", ident),
            entry: 0,
            nodes: before.iter().copied().filter(|&i| i != 0).collect(),
            exit: self.prog.nodes[split].args[0],
            out_l: quote!(#m::In),
            check_output: false,
        };
        let last = Part {
            saved: format_ident!("__TesseraSaved{}Last", ident),
            entry: split,
            nodes: (0..self.prog.nodes.len()).filter(|i| !before.contains(i) && *i != split).collect(),
            exit: self.prog.output,
            out_l: quote!(#out_l),
            check_output: false,
        };
        let (sf, sl) = (&first.saved, &last.saved);
        let first_code = self.part(&first);
        let last_code = self.part(&last);
        let (first_def, first_fwd, first_bwd) = (&first_code.saved_def, &first_code.forward, &first_code.backward);
        let (last_def, last_fwd, last_bwd) = (&last_code.saved_def, &last_code.forward, &last_code.backward);
        let recompute = match f.attrs.recompute.map(|r| r.value) {
            Some(Recompute::Full) => quote!(::core::option::Option::Some(#p::Recompute::Full)),
            Some(Recompute::Selective) => quote!(::core::option::Option::Some(#p::Recompute::Selective)),
            None => quote!(::core::option::Option::None),
        };
        let doc = format!(
            "Pipeline stages of `{ident}`, split at `{fname}`: the first stage runs `forward_first` and then its \
             range of `{fname}`'s layers, middle stages a range of layers, the last stage its range and then \
             `forward_last`. Run in order over all layers, they compute exactly the model's forward."
        );
        quote! {
            #first_def
            #last_def

            #[doc = #doc]
            #[automatically_derived]
            impl #p::Staged for #ident #bounds {
                type Boundary = #m::In;
                type FirstSaved = #sf;
                type SplitSaved = #m::Saved;
                type LastSaved = #sl;

                fn split_layers(&self) -> usize {
                    #p::Pipelined::layer_count(&self.#fname)
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn forward_first(&self, __cx: &mut #p::Cx, __x: #p::Act<#in_l>) -> #p::Result<(#p::Act<#m::In>, #sf)> {
                    #first_fwd
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn backward_first(&self, __cx: &mut #p::Cx, __saved: #sf, __dy: #p::Act<#m::In>) -> #p::Result<#p::Act<#in_l>> {
                    #first_bwd
                }

                fn forward_split(&self, __cx: &mut #p::Cx, layers: ::core::ops::Range<usize>, __x: #p::Act<#m::In>) -> #p::Result<(#p::Act<#m::In>, #m::Saved)> {
                    let (__y, __s) = #p::call_layers(&self.#fname, __cx, #name, layers, __x, #recompute)?;
                    ::core::result::Result::Ok((#p::dsl::relabel(__y), __s))
                }

                fn backward_split(&self, __cx: &mut #p::Cx, layers: ::core::ops::Range<usize>, __saved: #m::Saved, __dy: #p::Act<#m::In>) -> #p::Result<#p::Act<#m::In>> {
                    #p::call_layers_backward(&self.#fname, __cx, #name, layers, __saved, #p::dsl::relabel(__dy))
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn forward_last(&self, __cx: &mut #p::Cx, __x: #p::Act<#m::In>) -> #p::Result<(#p::Act<#out_l>, #sl)> {
                    let __x: #p::Act<#m::Out> = #p::dsl::relabel(__x);
                    #last_fwd
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn backward_last(&self, __cx: &mut #p::Cx, __saved: #sl, __dy: #p::Act<#out_l>) -> #p::Result<#p::Act<#m::In>> {
                    let __r: #p::Result<#p::Act<#m::Out>> = (|| { #last_bwd })();
                    __r.map(#p::dsl::relabel)
                }
            }
        }
    }
}

/// Where a field of a pipelined model runs (see [`Gen::stage_part`]).
enum FieldPart {
    /// The `#[stage(split)]` field: its layers are divided among the stages.
    Split,
    /// A `StagePart` variant: `First`, `Last` or `Whole`.
    Part(syn::Ident),
}

/// A part of the forward program (see [`Gen::part`]).
struct Part {
    saved: syn::Ident,
    entry: usize,
    nodes: Vec<usize>,
    exit: usize,
    out_l: TokenStream,
    /// Whether the exit is checked against the declared output layout.
    check_output: bool,
}

struct PartCode {
    saved_def: TokenStream,
    forward: TokenStream,
    backward: TokenStream,
}

/// The nodes the split call's input depends on (the input included), in order.
pub fn before_split(prog: &Program, split: usize) -> Vec<usize> {
    let mut keep = vec![false; prog.nodes.len()];
    let mut todo = vec![prog.nodes[split].args[0]];
    while let Some(i) = todo.pop() {
        if !keep[i] {
            keep[i] = true;
            todo.extend(&prog.nodes[i].args);
        }
    }
    keep.iter().enumerate().filter(|(_, &k)| k).map(|(i, _)| i).collect()
}

pub fn expand(m: &Model, prog: &Program) -> TokenStream {
    let gen = Gen::new(m, prog);
    let imp = gen.module_impl();
    let stages = gen.stage_impl();
    quote! {
        #imp
        #stages
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
