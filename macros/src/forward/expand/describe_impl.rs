//! `Module::describe` of a model: its forward program walked without
//! tensors, reporting every layer's costs (see the runtime's
//! `module::describe`). Each node does what its forward does: the same
//! sub-module calls with the same recompute, the same sequence-parallel
//! conversions and precision regions, the same collectives.

use super::*;

impl<'a> Gen<'a> {
    /// The description of node `i`: binds `__v{i}` to its output activation.
    fn describe_node(&self, i: usize, n: &Node) -> TokenStream {
        let p = p();
        let (out, qi) = (v(i), q(i));
        let args: Vec<syn::Ident> = n.args.iter().map(|&a| v(a)).collect();
        let qa: Vec<syn::Ident> = n.args.iter().map(|&a| q(a)).collect();
        let la: Vec<&TokenStream> = n.args.iter().map(|&a| &self.layouts[a]).collect();
        // The operands of an elementwise node, in the node's own form.
        let operands = || {
            let (a, b, qa0, qa1, la0, la1) = (&args[0], &args[1], &qa[0], &qa[1], la[0], la[1]);
            quote! {
                let __o0 = __d.seq_convert::<#la0>(#a, #qa0, #qi);
                let __o1 = __d.seq_convert::<#la1>(#b, #qa1, #qi);
            }
        };
        let body = match &n.op {
            Op::Input => unreachable!("the input is bound by the signature"),
            Op::Call(fname) => {
                let f = f_of(self, n);
                let name = fname.to_string();
                let (a, qa) = (&args[0], &qa[0]);
                let mode = match f.attrs.recompute.map(|r| r.value) {
                    Some(Recompute::Full) => quote!(::core::option::Option::Some(#p::Recompute::Full)),
                    Some(Recompute::Selective) => quote!(::core::option::Option::Some(#p::Recompute::Selective)),
                    None => quote!(::core::option::Option::None),
                };
                let call = match role_layouts(f) {
                    Some(_) => {
                        let sharded = sharded_call(
                            f,
                            quote!(#p::LayerRef::Shared(&self.#fname)),
                            quote!(#p::ShardedOp::Describe { d: __d, name: #name, x: __c, from: #qa, recompute: #mode }),
                        );
                        quote!(#sharded.map(|__o| __o.into_described()))
                    }
                    None => {
                        let (ty, r, m) = (&f.ty, role(f), as_module(f));
                        quote!({
                            let __c = __d.seq_convert::<<#ty as #p::Module<#r>>::In>(__c, #qa, #m::SEQ_IN);
                            #p::describe_call::<#r, #ty>(&self.#fname, __d, #name, __c, #mode)
                        })
                    }
                };
                let call = match f.attrs.precision {
                    Some(pr) => {
                        let d = dtype(pr.value);
                        quote!({
                            let __outer = __d.compute_dtype();
                            let __region = #p::dsl::region_dtype(__outer, #d);
                            let __c = __d.cast(__c, __region);
                            __d.set_compute_dtype(__region);
                            let __r = #call;
                            __d.set_compute_dtype(__outer);
                            __r.map(|__y| __d.cast(__y, __outer))
                        })
                    }
                    None => call,
                };
                quote!({ let __c = #a; #call }?)
            }
            Op::Add => {
                let conv = operands();
                quote!({ #conv __d.add(__o0, __o1)? })
            }
            Op::Mul => {
                let conv = operands();
                quote!({ #conv __d.product(__o0, __o1)? })
            }
            Op::Func(Func::Swiglu) => {
                let conv = operands();
                quote!({ #conv __d.swiglu(__o0, __o1)? })
            }
            Op::Func(Func::Gelu | Func::Silu) => {
                let a = &args[0];
                quote!(__d.activation(#a))
            }
            Op::Func(func @ (Func::AllReduce | Func::ReduceScatter | Func::AllGather)) => {
                let (a, fname) = (&args[0], format_ident!("{}", func.name()));
                quote!(__d.#fname(#a))
            }
        };
        // A pipelined model says which stage runs each node.
        let placed = match self.split_node() {
            Some(split) if split == i => quote!(__d.split_field(|__d| ::core::result::Result::Ok(#body))?),
            Some(split) => {
                let part = if before_split(self.prog, split).contains(&i) { format_ident!("First") } else { format_ident!("Last") };
                quote!(__d.stage_part(#p::StagePart::#part, |__d| ::core::result::Result::Ok(#body))?)
            }
            None => body,
        };
        // A value read more than once sums its gradients in the backward.
        let uses = n.uses;
        quote!(let #out = #placed; __d.reused(&#out, #uses);)
    }

    /// The body of `Module::describe`: the nodes in order, in the model's
    /// precision region, ending in the output's form.
    pub(super) fn describe_body(&self) -> TokenStream {
        let p = p();
        let states = self.seq_states();
        let nodes: Vec<TokenStream> = (1..self.prog.nodes.len()).map(|i| self.describe_node(i, &self.prog.nodes[i])).collect();
        let out = v(self.prog.output);
        match self.m.attrs.precision.map(|pr| dtype(pr.value)) {
            Some(d) => quote! {
                #(#states)*
                let __outer = __d.compute_dtype();
                let __region = #p::dsl::region_dtype(__outer, #d);
                __d.set_compute_dtype(__region);
                let __v0 = __d.cast(__x, __region);
                let __r = (|| -> #p::Result<#p::Activation> {
                    #(#nodes)*
                    ::core::result::Result::Ok(#out)
                })();
                __d.set_compute_dtype(__outer);
                __r.map(|__y| __d.cast(__y, __outer))
            },
            None => quote! {
                #(#states)*
                let __v0 = __x;
                #(#nodes)*
                ::core::result::Result::Ok(#out)
            },
        }
    }
}
