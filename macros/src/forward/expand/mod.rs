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

mod describe_impl;
mod fallback;
mod module_impl;
mod node;
mod stage_impl;

pub use fallback::fallback;
pub use stage_impl::before_split;

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

    /// Whether call node `i` may run the backward of the `all_reduce` that
    /// reads its output itself (`Module::backward_gathering`): a call,
    /// kept (not recomputed, which reruns the plain backward), whose output
    /// has no other use and that is not the pipeline's split field.
    fn gathers_for_all_reduce(&self, i: usize) -> bool {
        let n = &self.prog.nodes[i];
        n.uses == 1 && Some(i) != self.split_node() && self.field(n).is_some_and(|f| f.attrs.recompute.is_none())
    }

    /// The nodes of `part` whose backward receives the gradient of the
    /// `all_reduce` of their output instead of the `all_reduce`'s backward
    /// result: each call that [gathers](Self::gathers_for_all_reduce) for
    /// an `all_reduce` of the same part, and the exit of a gathering part.
    fn slice_receivers(&self, part: &Part) -> Vec<bool> {
        let mut r = vec![false; self.prog.nodes.len()];
        for &i in &part.nodes {
            let n = &self.prog.nodes[i];
            if matches!(n.op, Op::Func(Func::AllReduce)) && part.nodes.contains(&n.args[0]) && n.args[0] != part.exit && self.gathers_for_all_reduce(n.args[0])
            {
                r[n.args[0]] = true;
            }
        }
        if part.gathering {
            r[part.exit] = true;
        }
        r
    }

    /// Whether the whole model can run the backward of an `all_reduce` of
    /// its output itself: its output is such a call's.
    fn exit_gathers(&self) -> bool {
        let exit = self.prog.output;
        exit != 0 && self.gathers_for_all_reduce(exit)
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

    fn saved_struct_name(&self) -> syn::Ident {
        format_ident!("__TesseraSaved{}", self.m.ident)
    }

    /// The fields the forward calls, in declaration order, each visited once.
    fn used_fields(&self) -> Vec<&'a Field> {
        self.m.fields.iter().filter(|f| self.prog.nodes.iter().any(|n| matches!(&n.op, Op::Call(c) if *c == f.ident))).collect()
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
#[derive(Clone)]
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
    /// Whether the part's output gradient arrives as the gradient of the
    /// `all_reduce` the caller passed the output to, not yet through that
    /// `all_reduce`'s backward (the body of `Module::backward_gathering`).
    gathering: bool,
}

struct PartCode {
    saved_def: TokenStream,
    forward: TokenStream,
    backward: TokenStream,
}

/// The `Module` impl of a model and, when it is pipelined, its `Staged` impl.
pub fn expand(m: &Model, prog: &Program) -> TokenStream {
    let gen = Gen::new(m, prog);
    let imp = gen.module_impl();
    let stages = gen.stage_impl();
    quote! {
        #imp
        #stages
    }
}
