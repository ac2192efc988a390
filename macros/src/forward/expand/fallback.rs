//! What a model that failed to expand still gets, so one mistake stays one error.

use super::*;

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
