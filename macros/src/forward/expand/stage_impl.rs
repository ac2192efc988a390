//! The `Staged` impl of a pipelined model: the program cut at its
//! `#[stage(split)]` field into the part before, the split layers and the
//! part after.

use super::*;

impl<'a> Gen<'a> {
    /// The node calling the `#[stage(split)]` field, if the model has one.
    pub(super) fn split_node(&self) -> Option<usize> {
        self.prog.nodes.iter().position(|n| self.field(n).is_some_and(|f| f.attrs.stage.is_some_and(|s| s.value == Stage::Split)))
    }

    /// Which part of the pipeline cut at node `split` runs field `f`: the
    /// split field itself, the part before it (the first stage), the part
    /// after it (the last stage), or both (every stage holds it).
    pub(super) fn stage_part(&self, f: &Field, split: usize) -> FieldPart {
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
    pub(super) fn stage_impl(&self) -> TokenStream {
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
            gathering: false,
        };
        let last = Part {
            saved: format_ident!("__TesseraSaved{}Last", ident),
            entry: split,
            nodes: (0..self.prog.nodes.len()).filter(|i| !before.contains(i) && *i != split).collect(),
            exit: self.prog.output,
            out_l: quote!(#out_l),
            check_output: false,
            exit_seq: None,
            gathering: false,
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
                    #p::backward_root(__cx, move |__cx: &mut #p::Cx| -> #p::Result<#p::Act<#in_l>> { #first_bwd })
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
                    #p::backward_root(__cx, move |__cx: &mut #p::Cx| -> #p::Result<#p::Act<#m::In>> {
                        #enter
                        let __r = (|__cx: &mut #p::Cx| -> #p::Result<#p::Act<#m::In>> {
                            let __gy = #p::dsl::relabel(#dy_cast);
                            #split_bwd
                            ::core::result::Result::Ok(#p::dsl::relabel(__dx))
                        })(__cx);
                        #exit_bwd
                    })
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn forward_last(&self, __cx: &mut #p::Cx, __x: #p::Act<#m::In>) -> #p::Result<(#p::Act<#out_l>, #sl #ty_generics)> {
                    let __x: #p::Act<#m::Out> = #p::dsl::relabel(__x);
                    #last_fwd
                }

                #[allow(unused_mut, unused_variables, clippy::all)]
                fn backward_last(&self, __cx: &mut #p::Cx, __saved: #sl #ty_generics, __dy: #p::Act<#out_l>) -> #p::Result<#p::Act<#m::In>> {
                    #p::backward_root(__cx, move |__cx: &mut #p::Cx| -> #p::Result<#p::Act<#m::In>> {
                        let __r: #p::Result<#p::Act<#m::Out>> = (|| { #last_bwd })();
                        __r.map(#p::dsl::relabel)
                    })
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
