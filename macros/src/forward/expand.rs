//! Generates `Module` for a model: the forward over the SSA nodes with a
//! typed `Saved` struct, the backward as their reverse, the parameter
//! visitor, weight tying, and the sequence-parallel form of every value.
//!
//! Every value has a layout type (`layouts`), checked by rustc, and, as a
//! constant of type `Seq` computed in the generated code (`__q{i}`), the form
//! a `Replicated` value takes under sequence parallelism: whole or this
//! rank's slice of the sequence. Where a value's form differs from what its
//! consumer takes, the generated code converts it (`seq_convert`) and the
//! backward converts the gradient back; both are no-ops without sequence
//! parallelism and for other layouts.

use super::parse::{Func, Node, Op, Program};
use crate::ast::{Field, Model};
use crate::attr::{Precision, Recompute, Stage};
use proc_macro2::{Span, TokenStream};
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
fn q(i: usize) -> syn::Ident {
    format_ident!("__q{}", i)
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

/// The layouts a column- or row-parallel field takes and returns, which its
/// role fixes; `None` for other fields.
fn role_layouts(f: &Field) -> Option<(TokenStream, TokenStream)> {
    let p = p();
    match f.attrs.shard.map(|s| s.value) {
        Some(crate::attr::Shard::Column) => Some((quote!(#p::Replicated), quote!(#p::SplitHidden))),
        Some(crate::attr::Shard::Row) => Some((quote!(#p::SplitHidden), quote!(#p::PartialSum))),
        _ => None,
    }
}

/// `sharded::<Role, Ty, In, Out>(layer, op)`: the one function through
/// which the generated code reaches a column- or row-parallel field (see the
/// runtime's `module::sharded`). Every token of every such call is placed at
/// the field's `#[shard]` attribute, so a layer without the role gives the
/// same error at the same place from each call, which rustc shows once.
fn sharded_call(f: &Field, layer: TokenStream, op: TokenStream) -> TokenStream {
    let p = p();
    let (ty, r) = (&f.ty, role(f));
    let (i, o) = role_layouts(f).expect("a column- or row-parallel field");
    let span = f.attrs.shard.expect("sharded").span;
    at(span, quote!(#p::sharded::<#r, #ty, #i, #o>(#layer, #op)))
}

/// The field a call node calls.
fn f_of<'a>(g: &Gen<'a>, n: &Node) -> &'a Field {
    g.field(n).expect("a call node calls a field")
}

/// `ts` with every token located at `span` (resolved as the macro's own).
fn at(span: Span, ts: TokenStream) -> TokenStream {
    crate::respan::respan(ts, Span::call_site().located_at(span))
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
                    let f = m.field(f).expect("checked");
                    match role_layouts(f) {
                        Some((_, out)) => out,
                        None => {
                            let m = as_module(f);
                            quote!(#m::Out)
                        }
                    }
                }
                Op::Func(Func::AllReduce | Func::AllGather) => quote!(#p::Replicated),
                Op::Func(Func::ReduceScatter) => quote!(#p::SplitSeq),
                Op::Add | Op::Mul | Op::Func(_) => layouts[n.args[0]].clone(),
            };
            layouts.push(l);
        }
        Gen { m, prog, layouts }
    }

    /// The where-clause of every generated item: the struct's own predicates
    /// and the bounds the generated code needs of the fields, each placed at
    /// the attribute (or field type) that asks for it: if one fails, rustc
    /// reports it there, and the bodies (which assume it) add no follow-on errors.
    ///
    /// The `Tie` bound of `#[tied]` is not here but on the call that ties
    /// the weights (a body): a layer without a weight is then one error at
    /// the attribute, not one wherever the model is used.
    fn where_clause(&self) -> TokenStream {
        let p = p();
        let mut b: Vec<TokenStream> = self.prog.generics.where_clause.iter().flat_map(|w| w.predicates.iter()).map(|pr| quote!(#pr)).collect();
        for f in self.used_fields() {
            let ty = &f.ty;
            // A bound on a type built from the impl's parameters (`Stack<B>`)
            // would hide its impl: rustc would take the bound as the only
            // fact about it and stop seeing `In = Replicated`. Such a field is
            // checked where it is used instead.
            if self.mentions_params(ty) {
                continue;
            }
            if let Some(sh) = f.attrs.shard.filter(|_| role_layouts(f).is_none()) {
                let r = role(f);
                // The role fixes the layouts (for vocab, the input): stating
                // them lets the bodies use concrete layouts even when the
                // bound fails, so a wrong role is reported once, here.
                // (Column- and row-parallel fields go through `sharded`.)
                let layouts = quote!(In = #p::Replicated);
                let _ = sh.value;
                b.push(at(sh.span, quote!(#ty: #p::Module<#r, #layouts>)));
            }
            if let Some(st) = f.attrs.stage.filter(|s| s.value == Stage::Split) {
                b.push(at(st.span, quote!(#ty: #p::Pipelined)));
            }
        }
        if b.is_empty() {
            TokenStream::new()
        } else {
            quote!(where #(#b),*)
        }
    }

    /// `impl<..>` generics and the model as a type, as the `#[forward]` impl
    /// writes them (a generic model's bounds live there).
    fn generics(&self) -> (TokenStream, TokenStream) {
        let (impl_generics, _, _) = self.prog.generics.split_for_impl();
        let self_ty = &self.prog.self_ty;
        (quote!(#impl_generics), quote!(#self_ty))
    }

    /// Whether `ty` names one of the `#[forward]` impl's type parameters.
    fn mentions_params(&self, ty: &syn::Type) -> bool {
        fn idents(ts: TokenStream, out: &mut Vec<String>) {
            for t in ts {
                match t {
                    proc_macro2::TokenTree::Ident(i) => out.push(i.to_string()),
                    proc_macro2::TokenTree::Group(g) => idents(g.stream(), out),
                    _ => {}
                }
            }
        }
        let mut names = Vec::new();
        idents(quote!(#ty), &mut names);
        self.prog.generics.type_params().any(|p| names.contains(&p.ident.to_string()))
    }

    /// `<T, ..>`: the impl's parameters as arguments (for the saved structs).
    fn ty_generics(&self) -> TokenStream {
        let (_, ty_generics, _) = self.prog.generics.split_for_impl();
        quote!(#ty_generics)
    }

    fn field(&self, n: &Node) -> Option<&'a Field> {
        match &n.op {
            Op::Call(f) => self.m.field(f),
            _ => None,
        }
    }

    /// `let __q{i}: Seq = ..;` for every node: the form each value has under
    /// sequence parallelism, from the input's ([`Self::seq_in`]) forward.
    fn seq_states(&self) -> Vec<TokenStream> {
        let p = p();
        self.prog
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let qi = q(i);
                let e = match &n.op {
                    Op::Input => quote!(<Self as #p::Module>::SEQ_IN),
                    Op::Call(_) => {
                        let f = self.field(n).expect("checked");
                        match role_layouts(f) {
                            // Its output is not `Replicated`: no form to track.
                            Some(_) => quote!(#p::Seq::Whole),
                            None => {
                                let m = as_module(f);
                                quote!(#m::SEQ_OUT)
                            }
                        }
                    }
                    Op::Add | Op::Mul | Op::Func(Func::Swiglu) => {
                        let (a, b) = (q(n.args[0]), q(n.args[1]));
                        quote!(#p::Seq::join(#a, #b))
                    }
                    Op::Func(Func::Gelu | Func::Silu) => {
                        let a = q(n.args[0]);
                        quote!(#a)
                    }
                    // Under sequence parallelism `all_reduce` reduce-scatters.
                    Op::Func(Func::AllReduce | Func::ReduceScatter) => quote!(#p::Seq::Split),
                    Op::Func(Func::AllGather) => quote!(#p::Seq::Whole),
                };
                quote!(#[allow(unused_variables)] let #qi: #p::Seq = #e;)
            })
            .collect()
    }

    /// The model's `SEQ_IN`: the input whole when any layer reading it takes
    /// it whole (token ids for an embedding), else split.
    fn seq_in(&self) -> TokenStream {
        let p = p();
        let takes: Vec<TokenStream> = self
            .prog
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Call(_)) && n.args.contains(&0))
            .map(|n| {
                let f = self.field(n).expect("checked");
                match role_layouts(f) {
                    // A column-parallel layer takes the slice and gathers it.
                    Some(_) => quote!(#p::Seq::Split),
                    None => {
                        let m = as_module(f);
                        quote!(#m::SEQ_IN)
                    }
                }
            })
            .collect();
        quote!(#p::Seq::for_all(&[#(#takes),*]))
    }

    /// The type of what node `n` keeps for the backward, if anything.
    fn saved_type(&self, n: &Node) -> Option<TokenStream> {
        let p = p();
        match &n.op {
            Op::Call(_) => {
                let f = self.field(n).expect("checked");
                if role_layouts(f).is_some() {
                    return Some(quote!(#p::Erased));
                }
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

    /// Runs `call` (which reads `__c`, the input, and evaluates to the
    /// sub-module's `Result<(output, saved)>`) inside field `f`'s precision
    /// region; binds `(out, saved)`.
    fn forward_in_region(&self, f: &Field, out: &TokenStream, call: TokenStream) -> TokenStream {
        let p = p();
        match f.attrs.precision {
            Some(pr) => {
                let d = dtype(pr.value);
                quote! {
                    let #out = {
                        let __outer = __cx.compute_dtype();
                        let __region = #p::dsl::region_dtype(__outer, #d);
                        let __c = #p::dsl::cast(__c, __region)?;
                        __cx.set_compute_dtype(__region);
                        let __r = #call;
                        __cx.set_compute_dtype(__outer);
                        let (__y, __s) = __r?;
                        (#p::dsl::cast(__y, __outer)?, __s)
                    };
                }
            }
            None => quote!(let #out = #call?;),
        }
    }

    /// Runs `call` (which reads `__gy` and evaluates to `Result<input
    /// gradient>`) inside field `f`'s precision region; binds `__dx`.
    fn backward_in_region(&self, f: &Field, call: TokenStream) -> TokenStream {
        let p = p();
        match f.attrs.precision {
            Some(pr) => {
                let d = dtype(pr.value);
                quote! {
                    let __dx = {
                        let __outer = __cx.compute_dtype();
                        let __region = #p::dsl::region_dtype(__outer, #d);
                        __cx.set_compute_dtype(__region);
                        let __gy = #p::dsl::cast(__gy, __region)?;
                        let __r = #call;
                        __cx.set_compute_dtype(__outer);
                        #p::dsl::cast(__r?, __outer)?
                    };
                }
            }
            None => quote!(let __dx = #call?;),
        }
    }

    fn forward_node(&self, i: usize, n: &Node) -> TokenStream {
        let p = p();
        let (out, sv, qi) = (v(i), s(i), q(i));
        // Resolve names as the generated code does, but report at the user's
        // expression: every token of a checked call carries this span, so the
        // error underlines the user's code and nothing of the macro's.
        let span = Span::call_site().located_at(n.span);
        let ps = quote_spanned!(span=> ::tessera::__private);
        let args: Vec<syn::Ident> = n.args.iter().map(|&a| syn::Ident::new(&format!("__v{a}"), span)).collect();
        let qa: Vec<syn::Ident> = n.args.iter().map(|&a| q(a)).collect();
        // Both layouts named explicitly: inference would otherwise equate them
        // from the bound and report a bare type mismatch instead of its message.
        let lts: Vec<TokenStream> = n.args.iter().map(|&a| crate::respan::respan(self.layouts[a].clone(), span)).collect();
        // The operands of an elementwise node in the node's own form.
        let operands = |k: usize| -> TokenStream {
            let names: Vec<syn::Ident> = (0..k).map(|j| syn::Ident::new(&format!("__o{j}"), span)).collect();
            let converts = names.iter().zip(&args).zip(&qa).map(|((o, a), qa)| quote!(let #o = #p::seq_convert(__cx, #a.clone(), #qa, #qi)?;));
            quote!(#(#converts)*)
        };
        let o: Vec<syn::Ident> = (0..2).map(|j| syn::Ident::new(&format!("__o{j}"), span)).collect();
        match &n.op {
            Op::Input => unreachable!("the input is bound by the signature"),
            Op::Call(fname) if role_layouts(f_of(self, n)).is_some() => {
                let f = f_of(self, n);
                let (in_l, out_l) = role_layouts(f).expect("sharded");
                let name = fname.to_string();
                let (a, qa, la) = (&args[0], &qa[0], &lts[0]);
                let mode = match f.attrs.recompute.map(|r| r.value) {
                    Some(Recompute::Full) => quote!(::core::option::Option::Some(#p::Recompute::Full)),
                    Some(Recompute::Selective) => quote!(::core::option::Option::Some(#p::Recompute::Selective)),
                    None => quote!(::core::option::Option::None),
                };
                let sharded = sharded_call(
                    f,
                    quote!(#p::LayerRef::Shared(&self.#fname)),
                    quote!(#p::ShardedOp::Forward { cx: __cx, name: #name, x: __c.into_tensor(), from: #qa, recompute: #mode }),
                );
                let call = quote!(#sharded.map(|__o| __o.into_forward::<#out_l>()));
                let bind = self.forward_in_region(f, &quote!((#out, #sv)), call);
                // The layout check stays on the user's expression.
                let fed = quote_spanned!(span=> #ps::fed::<#in_l, #la>(#a.clone()));
                quote! {
                    let __c = #fed;
                    #bind
                }
            }
            Op::Call(fname) => {
                let f = self.field(n).expect("checked");
                let (ty, r, m) = (&f.ty, role(f), as_module(f));
                let name = fname.to_string();
                let (a, qa) = (&args[0], &qa[0]);
                let c = syn::Ident::new("__c", span);
                let call = match f.attrs.recompute {
                    Some(rc) => {
                        let mode = match rc.value {
                            Recompute::Full => quote!(#p::Recompute::Full),
                            Recompute::Selective => quote!(#p::Recompute::Selective),
                        };
                        quote_spanned!(span=> #ps::call_recompute::<#r, #ty, _>(&self.#fname, __cx, #name, #c, #mode))
                    }
                    None => quote_spanned!(span=> #ps::call::<#r, #ty, _>(&self.#fname, __cx, #name, #c)),
                };
                let bind = self.forward_in_region(f, &quote!((#out, #sv)), call);
                quote! {
                    let __c = #p::seq_convert(__cx, #a.clone(), #qa, #m::SEQ_IN)?;
                    #bind
                }
            }
            Op::Add => {
                let (ta, tb) = (&lts[0], &lts[1]);
                let conv = operands(2);
                let (o0, o1) = (&o[0], &o[1]);
                let add = quote_spanned!(span=> let #out = #ps::dsl::add::<#ta, #tb>(#o0, #o1)?;);
                quote!(#conv #add)
            }
            Op::Mul => {
                let (ta, tb) = (&lts[0], &lts[1]);
                let conv = operands(2);
                let (o0, o1) = (&o[0], &o[1]);
                let mul = quote_spanned!(span=> let (#out, #sv) = #ps::dsl::mul::<#ta, #tb>(#o0, #o1)?;);
                quote!(#conv #mul)
            }
            Op::Func(func) => {
                let fname = format_ident!("{}", func.name());
                match func {
                    Func::Gelu | Func::Silu => {
                        let (a, ta) = (&args[0], &lts[0]);
                        quote_spanned!(span=> let (#out, #sv) = #ps::dsl::#fname::<#ta>(#a.clone())?;)
                    }
                    Func::Swiglu => {
                        let (ta, tb) = (&lts[0], &lts[1]);
                        let conv = operands(2);
                        let (o0, o1) = (&o[0], &o[1]);
                        let call = quote_spanned!(span=> let (#out, #sv) = #ps::dsl::swiglu::<#ta, #tb>(#o0, #o1)?;);
                        quote!(#conv #call)
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
        let (gy, sv, qi) = (g(i), s(i), q(i));
        let ga: Vec<syn::Ident> = n.args.iter().map(|&a| g(a)).collect();
        let qa: Vec<syn::Ident> = n.args.iter().map(|&a| q(a)).collect();
        let la: Vec<&TokenStream> = n.args.iter().map(|&a| &self.layouts[a]).collect();
        // Each operand's gradient, back in the operand's own form.
        let back = |j: usize, d: TokenStream| {
            let (gj, qj) = (&ga[j], &qa[j]);
            quote!(#p::dsl::accumulate(&mut #gj, #p::seq_convert_backward(__cx, #d, #qj, #qi)?)?;)
        };
        let body = match &n.op {
            Op::Input => return TokenStream::new(),
            Op::Call(fname) if role_layouts(f_of(self, n)).is_some() => {
                let f = f_of(self, n);
                let (in_l, _) = role_layouts(f).expect("sharded");
                let name = fname.to_string();
                let sharded = sharded_call(
                    f,
                    quote!(#p::LayerRef::Shared(&self.#fname)),
                    quote!(#p::ShardedOp::Backward { cx: __cx, name: #name, saved: #sv, dy: __gy.into_tensor(), from: #(#qa)* }),
                );
                let call = quote!(#sharded.map(|__o| __o.into_backward::<#in_l>()));
                let bind = self.backward_in_region(f, call);
                let a = &ga[0];
                quote! {
                    #bind
                    #p::dsl::accumulate(&mut #a, #p::dsl::relabel(__dx))?;
                }
            }
            Op::Call(fname) => {
                let f = self.field(n).expect("checked");
                let (ty, r, m) = (&f.ty, role(f), as_module(f));
                let name = fname.to_string();
                let call = if f.attrs.recompute.is_some() {
                    quote!(#p::call_recompute_backward::<#r, #ty>(&self.#fname, __cx, #name, #sv, __gy))
                } else {
                    quote!(#p::call_backward::<#r, #ty>(&self.#fname, __cx, #name, #sv, __gy))
                };
                let bind = self.backward_in_region(f, call);
                let (a, qa) = (&ga[0], &qa[0]);
                quote! {
                    #bind
                    #p::dsl::accumulate(&mut #a, #p::seq_convert_backward(__cx, #p::dsl::relabel(__dx), #qa, #m::SEQ_IN)?)?;
                }
            }
            Op::Add => {
                let (ta, tb) = (la[0], la[1]);
                let (b0, b1) = (back(0, quote!(__da)), back(1, quote!(__db)));
                quote! {
                    let (__da, __db) = #p::dsl::add_backward::<#ta, #tb>(__gy);
                    #b0
                    #b1
                }
            }
            Op::Mul | Op::Func(Func::Swiglu) => {
                let (ta, tb) = (la[0], la[1]);
                let f = if matches!(n.op, Op::Mul) { format_ident!("mul_backward") } else { format_ident!("swiglu_backward") };
                let (b0, b1) = (back(0, quote!(__da)), back(1, quote!(__db)));
                quote! {
                    let (__da, __db) = #p::dsl::#f::<#ta, #tb>(#sv, __gy)?;
                    #b0
                    #b1
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
        let states = self.seq_states();
        let fwd: Vec<TokenStream> = part.nodes.iter().map(|&i| self.forward_node(i, &nodes[i])).collect();
        let saved_fields: Vec<syn::Ident> = part.nodes.iter().filter(|&&i| self.saved_type(&nodes[i]).is_some()).map(|&i| s(i)).collect();
        let saved_types: Vec<TokenStream> = part.nodes.iter().filter_map(|&i| self.saved_type(&nodes[i])).collect();
        let (exit, q_exit) = (v(part.exit), q(part.exit));
        let out_l = &part.out_l;
        let out = if part.check_output {
            let span = Span::call_site().located_at(nodes[part.exit].span);
            let exit = syn::Ident::new(&format!("__v{}", part.exit), span);
            quote_spanned!(span=> ::tessera::__private::dsl::returns::<#out_l, _>(#exit))
        } else {
            quote!(#exit)
        };
        // A part that ends at the pipeline cut hands its value over in the
        // form the split field takes.
        let (out, dy_seq) = match &part.exit_seq {
            Some(to) => (quote!(#p::seq_convert(__cx, #out, #q_exit, #to)?), Some(to)),
            None => (out, None),
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
        let dy = match dy_seq {
            Some(to) => quote!(#p::seq_convert_backward(__cx, #p::dsl::relabel(#dy_cast), #q_exit, #to)?),
            None => quote!(#p::dsl::relabel(#dy_cast)),
        };
        let ident = &self.m.ident;
        let input_name = self.prog.input.to_string();
        let vis = &self.m.vis;
        let (impl_generics, self_ty) = self.generics();
        let ty_generics = self.ty_generics();
        let bounds = self.where_clause();
        let doc = format!("What part of `{ident}`'s forward keeps for its backward: one field per stored activation.");
        PartCode {
            saved_def: quote! {
                #[doc = #doc]
                #[doc(hidden)]
                #[allow(non_camel_case_types, dead_code)]
                #vis struct #saved #impl_generics #bounds {
                    #(#saved_fields: #saved_types,)*
                    __marker: ::core::marker::PhantomData<fn() -> #self_ty>,
                }
            },
            forward: quote! {
                #enter
                let __r = (|__cx: &mut #p::Cx| -> #p::Result<(#p::Act<#out_l>, #saved #ty_generics)> {
                    #(#states)*
                    let #v_entry = #in_cast;
                    #(#fwd)*
                    ::core::result::Result::Ok((#out, #saved { #(#saved_fields,)* __marker: ::core::marker::PhantomData }))
                })(__cx);
                #exit_fwd
            },
            backward: quote! {
                #enter
                let __r = (|__cx: &mut #p::Cx| {
                    let #saved { #(#saved_fields,)* .. } = __saved;
                    #(#states)*
                    #(#slots)*
                    #p::dsl::accumulate(&mut #g_exit, #dy)?;
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
    /// The sequence-parallel form the exit value is handed over in, when it
    /// is not its own (the part before the pipeline cut).
    exit_seq: Option<TokenStream>,
}

struct PartCode {
    saved_def: TokenStream,
    forward: TokenStream,
    backward: TokenStream,
}

impl<'a> Gen<'a> {
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

    /// Checks of `#[model(tp = N, dims(..))]` against the group the model
    /// is built for (the compile-time check covers only the declared `N`).
    fn static_checks(&self) -> TokenStream {
        let ident = self.m.ident.to_string();
        let here = quote!(if __path.is_empty() { #ident.to_string() } else { __path.to_string() });
        let tp = self.m.attrs.tp.map(|tp| {
            let n = tp.value as usize;
            quote! {
                if __degree != #n {
                    __problems.push(::std::format!(
                        "`{}` declares `#[model(tp = {})]` but is built for a tensor-parallel group of {}; build it on a group of {} ranks or change the attribute",
                        #here, #n, __degree, #n
                    ));
                }
            }
        });
        let dims = self.m.attrs.dims.iter().map(|(name, n)| {
            let (name, v) = (name.to_string(), n.value as usize);
            quote! {
                if #v % __degree != 0 {
                    __problems.push(::std::format!(
                        "`{}` declares `{} = {}` in `#[model(dims(..))]`, which the tensor-parallel degree {} does not divide",
                        #here, #name, #v, __degree
                    ));
                }
            }
        });
        quote!(#tp #(#dims)*)
    }

    fn module_impl(&self) -> TokenStream {
        let p = p();
        let ident = &self.m.ident;
        let in_l = &self.prog.in_layout;
        let out_l = &self.prog.out_layout;
        let bounds = self.where_clause();
        let (impl_generics, self_ty) = self.generics();
        let ty_generics = self.ty_generics();
        let whole = Part {
            saved: self.saved_struct_name(),
            entry: 0,
            nodes: (1..self.prog.nodes.len()).collect(),
            exit: self.prog.output,
            out_l: quote!(#out_l),
            check_output: true,
            exit_seq: None,
        };
        let saved = &whole.saved;
        let PartCode { saved_def, forward, backward } = self.part(&whole);

        let used = self.used_fields();
        let split = self.split_node();
        let visits = used.iter().map(|f| {
            let fname = &f.ident;
            let name = fname.to_string();
            let r = role(f);
            let visit = match role_layouts(f) {
                Some(_) => {
                    let sharded = sharded_call(f, quote!(#p::LayerRef::Shared(&self.#fname)), quote!(#p::ShardedOp::Visit(__v)));
                    quote!(__v.child::<#r>(#name, |__v| #sharded.map(|_| ())))
                }
                None => {
                    let m = as_module(f);
                    quote!(__v.child::<#r>(#name, |__v| #m::visit_params(&self.#fname, __v)))
                }
            };
            match split {
                // A pipelined model tells the visitor which stage each field is on.
                Some(split) => match self.stage_part(f, split) {
                    FieldPart::Split => quote!(__v.split_field(|__v| #visit)?;),
                    FieldPart::Part(part) => quote!(__v.stage_part(#p::StagePart::#part, |__v| #visit)?;),
                },
                None => quote!(#visit?;),
            }
        });
        let model = ident.to_string();
        // The `Tie` bounds are checked on this call, placed at `#[tied(..)]`.
        let ties = self.m.fields.iter().filter_map(|f| {
            let partner = f.attrs.tied.as_ref()?;
            let fname = &f.ident;
            let (field, with) = (fname.to_string(), partner.to_string());
            let tie = at(partner.span(), quote!(#p::dsl::tie(&mut self.#fname, &self.#partner, #model, #field, #with)));
            Some(quote!(#tie?;))
        });
        let checks = used.iter().map(|f| {
            let fname = &f.ident;
            let name = fname.to_string();
            match role_layouts(f) {
                Some(_) => {
                    let sharded = sharded_call(
                        f,
                        quote!(#p::LayerRef::Shared(&self.#fname)),
                        quote!(#p::ShardedOp::CheckTp { path: &#p::join_path(__path, #name), degree: __degree, problems: __problems }),
                    );
                    quote!(let _ = #sharded;)
                }
                None => {
                    let m = as_module(f);
                    quote!(#m::check_tp(&self.#fname, &#p::join_path(__path, #name), __degree, __problems);)
                }
            }
        });
        let static_checks = self.static_checks();
        let child_ties = used.iter().map(|f| {
            let fname = &f.ident;
            match role_layouts(f) {
                Some(_) => {
                    let sharded = sharded_call(f, quote!(#p::LayerRef::Unique(&mut self.#fname)), quote!(#p::ShardedOp::TieParams));
                    quote!(#sharded?;)
                }
                None => {
                    let m = as_module(f);
                    quote!(#m::tie_params(&mut self.#fname)?;)
                }
            }
        });
        let states = self.seq_states();
        let q_out = q(self.prog.output);
        let seq_in = self.seq_in();

        quote! {
            #saved_def

            #[automatically_derived]
            impl #impl_generics #p::Module for #self_ty #bounds {
                type In = #in_l;
                type Out = #out_l;
                type Saved = #saved #ty_generics;

                const SEQ_IN: #p::Seq = #seq_in;
                #[allow(unused_variables)]
                const SEQ_OUT: #p::Seq = { #(#states)* #q_out };

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn forward(&self, __cx: &mut #p::Cx, __x: #p::Act<#in_l>) -> #p::Result<(#p::Act<#out_l>, #saved #ty_generics)> {
                    #forward
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn backward(&self, __cx: &mut #p::Cx, __saved: #saved #ty_generics, __dy: #p::Act<#out_l>) -> #p::Result<#p::Act<#in_l>> {
                    #backward
                }

                fn visit_params(&self, __v: &mut #p::Visitor<'_>) -> #p::Result<()> {
                    #(#visits)*
                    ::core::result::Result::Ok(())
                }

                fn check_tp(&self, __path: &str, __degree: usize, __problems: &mut ::std::vec::Vec<::std::string::String>) {
                    #static_checks
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
    /// Each honours the model's and the split field's precision and hands
    /// values over in the form (whole or split sequence) the split field takes,
    /// so the stages run in order compute exactly the model's forward.
    fn stage_impl(&self) -> TokenStream {
        let Some(split) = self.split_node() else {
            return TokenStream::new();
        };
        let f = self.field(&self.prog.nodes[split]).expect("the split node calls a field");
        let p = p();
        let ident = &self.m.ident;
        let bounds = self.where_clause();
        let (impl_generics, self_ty) = self.generics();
        let ty_generics = self.ty_generics();
        let (in_l, out_l) = (&self.prog.in_layout, &self.prog.out_layout);
        let fname = &f.ident;
        let name = fname.to_string();
        let m = as_module(f);
        let before = before_split(self.prog, split);
        let first = Part {
            saved: format_ident!("__TesseraSaved{}First", ident),
            entry: 0,
            nodes: before.iter().copied().filter(|&i| i != 0).collect(),
            exit: self.prog.nodes[split].args[0],
            out_l: quote!(#m::In),
            check_output: false,
            exit_seq: Some(quote!(#m::SEQ_IN)),
        };
        let last = Part {
            saved: format_ident!("__TesseraSaved{}Last", ident),
            entry: split,
            nodes: (0..self.prog.nodes.len()).filter(|i| !before.contains(i) && *i != split).collect(),
            exit: self.prog.output,
            out_l: quote!(#out_l),
            check_output: false,
            exit_seq: None,
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
        // The split field runs in the model's region and then its own.
        let (enter, exit_fwd, exit_bwd, in_cast, dy_cast) = self.model_precision();
        let split_fwd = self.forward_in_region(f, &quote!((__y, __s)), quote!(#p::call_layers(&self.#fname, __cx, #name, layers, __c, #recompute)));
        let split_bwd = self.backward_in_region(f, quote!(#p::call_layers_backward(&self.#fname, __cx, #name, layers, __saved, __gy)));
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
            impl #impl_generics #p::Staged for #self_ty #bounds {
                type Boundary = #m::In;
                type FirstSaved = #sf #ty_generics;
                type SplitSaved = #m::Saved;
                type LastSaved = #sl #ty_generics;

                fn split_layers(&self) -> usize {
                    #p::Pipelined::layer_count(&self.#fname)
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn forward_first(&self, __cx: &mut #p::Cx, __x: #p::Act<#in_l>) -> #p::Result<(#p::Act<#m::In>, #sf #ty_generics)> {
                    #first_fwd
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn backward_first(&self, __cx: &mut #p::Cx, __saved: #sf #ty_generics, __dy: #p::Act<#m::In>) -> #p::Result<#p::Act<#in_l>> {
                    #first_bwd
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn forward_split(&self, __cx: &mut #p::Cx, layers: ::core::ops::Range<usize>, __x: #p::Act<#m::In>) -> #p::Result<(#p::Act<#m::In>, #m::Saved)> {
                    #enter
                    let __r = (|__cx: &mut #p::Cx| -> #p::Result<(#p::Act<#m::In>, #m::Saved)> {
                        let __c = #in_cast;
                        #split_fwd
                        ::core::result::Result::Ok((#p::dsl::relabel(__y), __s))
                    })(__cx);
                    #exit_fwd
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn backward_split(&self, __cx: &mut #p::Cx, layers: ::core::ops::Range<usize>, __saved: #m::Saved, __dy: #p::Act<#m::In>) -> #p::Result<#p::Act<#m::In>> {
                    #enter
                    let __r = (|__cx: &mut #p::Cx| -> #p::Result<#p::Act<#m::In>> {
                        let __gy = #p::dsl::relabel(#dy_cast);
                        #split_bwd
                        ::core::result::Result::Ok(#p::dsl::relabel(__dx))
                    })(__cx);
                    #exit_bwd
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn forward_last(&self, __cx: &mut #p::Cx, __x: #p::Act<#m::In>) -> #p::Result<(#p::Act<#out_l>, #sl #ty_generics)> {
                    let __x: #p::Act<#m::Out> = #p::dsl::relabel(__x);
                    #last_fwd
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn backward_last(&self, __cx: &mut #p::Cx, __saved: #sl #ty_generics, __dy: #p::Act<#out_l>) -> #p::Result<#p::Act<#m::In>> {
                    let __r: #p::Result<#p::Act<#m::Out>> = (|| { #last_bwd })();
                    __r.map(#p::dsl::relabel)
                }
            }
        }
    }
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
pub fn fallback(_m: &Model, prog: Option<&Program>) -> TokenStream {
    let Some(prog) = prog else { return TokenStream::new() };
    let p = p();
    let self_ty = &prog.self_ty;
    let (impl_generics, _, where_clause) = prog.generics.split_for_impl();
    let (in_l, out_l) = (&prog.in_layout, &prog.out_layout);
    quote! {
        #[automatically_derived]
        impl #impl_generics #p::Module for #self_ty #where_clause {
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
