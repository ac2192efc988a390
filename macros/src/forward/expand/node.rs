//! One SSA node of the forward body: its forward code (a layer call, a
//! collective or an elementwise function, in its precision and recompute
//! region, with the sequence-parallel conversions it needs) and the reverse
//! code of its backward.

use super::*;

impl<'a> Gen<'a> {
    /// The type of what node `n` keeps for the backward, if anything.
    pub(super) fn saved_type(&self, n: &Node) -> Option<TokenStream> {
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

    /// Runs `call` (which reads `__c`, the input, and evaluates to the
    /// sub-module's `Result<(output, saved)>`) inside field `f`'s precision
    /// region; binds `(out, saved)`.
    pub(super) fn forward_in_region(&self, f: &Field, out: &TokenStream, call: TokenStream) -> TokenStream {
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
    pub(super) fn backward_in_region(&self, f: &Field, call: TokenStream) -> TokenStream {
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

    pub(super) fn forward_node(&self, i: usize, n: &Node) -> TokenStream {
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

    /// The backward of node `i`. A node marked in `slices` receives the
    /// gradient of the `all_reduce` of its output, whose backward it runs
    /// itself ([`Self::slice_receivers`]).
    pub(super) fn backward_node(&self, i: usize, n: &Node, slices: &[bool]) -> TokenStream {
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
        let gathering = slices[i];
        let body = match &n.op {
            Op::Input => return TokenStream::new(),
            Op::Call(fname) if role_layouts(f_of(self, n)).is_some() => {
                let f = f_of(self, n);
                let (in_l, _) = role_layouts(f).expect("sharded");
                let name = fname.to_string();
                let sharded = sharded_call(
                    f,
                    quote!(#p::LayerRef::Shared(&self.#fname)),
                    quote!(#p::ShardedOp::Backward { cx: __cx, name: #name, saved: #sv, dy: __gy.into_tensor(), from: #(#qa)*, gathering: #gathering }),
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
                let call = if gathering {
                    quote!(#p::call_backward_gathering::<#r, #ty>(&self.#fname, __cx, #name, #sv, #p::dsl::relabel(__gy)))
                } else if f.attrs.recompute.is_some() {
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
            Op::Func(Func::AllReduce) if slices[n.args[0]] => {
                // The call that made the reduced value runs this backward.
                let a = &ga[0];
                quote!(#p::dsl::accumulate(&mut #a, #p::dsl::relabel(__gy))?;)
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
}
