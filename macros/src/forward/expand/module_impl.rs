//! The `Module` impl of a model: the forward and backward of its whole
//! program, the typed `Saved` struct, the parameter visitor, tying, the
//! precision region and the tensor-parallel checks.

use super::*;

impl<'a> Gen<'a> {
    /// The forward and backward bodies of a part of the program: `nodes`
    /// (in order) read the value of `entry` from the argument `__x` and
    /// produce `exit`. The whole model is one part; pipeline stages are three.
    pub(super) fn part(&self, part: &Part) -> PartCode {
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
        let slices = self.slice_receivers(part);
        let bwd: Vec<TokenStream> = part.nodes.iter().rev().map(|&i| self.backward_node(i, &nodes[i], &slices)).collect();
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

    /// Entering and leaving the model's `#[model(precision = ..)]` region.
    pub(super) fn model_precision(&self) -> (TokenStream, TokenStream, TokenStream, TokenStream, TokenStream) {
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
    pub(super) fn static_checks(&self) -> TokenStream {
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

    pub(super) fn module_impl(&self) -> TokenStream {
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
            gathering: false,
        };
        let saved = &whole.saved;
        let PartCode { saved_def, forward, backward } = self.part(&whole);
        // A model whose output is a call's that can run the backward of an
        // `all_reduce` itself hands that on to the call.
        let gathering = self.exit_gathers().then(|| {
            let backward = self.part(&Part { gathering: true, ..whole.clone() }).backward;
            quote! {
                #[allow(unused_mut, unused_variables, clippy::all)]
                fn backward_gathering(&self, __cx: &mut #p::Cx, __saved: #saved #ty_generics, __dy: #p::Act<#p::Replicated>) -> #p::Result<#p::Act<#in_l>> {
                    #backward
                }
            }
        });

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
        let describe = self.describe_body();

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
                    #p::backward_root(__cx, move |__cx: &mut #p::Cx| -> #p::Result<#p::Act<#in_l>> { #backward })
                }

                #gathering

                fn visit_params(&self, __v: &mut #p::Visitor<'_>) -> #p::Result<()> {
                    #(#visits)*
                    ::core::result::Result::Ok(())
                }

                fn check_tp(&self, __path: &str, __degree: usize, __problems: &mut ::std::vec::Vec<::std::string::String>) {
                    #static_checks
                    #(#checks)*
                }

                #[allow(unused_variables, clippy::all)]
                fn describe(&self, __d: &mut #p::Describe, __x: #p::Activation) -> #p::Result<#p::Activation> {
                    #describe
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
