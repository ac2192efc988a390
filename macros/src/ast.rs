//! The user's model struct as the macros see it.

use crate::attr::{FieldAttrs, ModelAttrs};
use crate::ctxt::Ctxt;

pub struct Field {
    pub ident: syn::Ident,
    pub ty: syn::Type,
    pub attrs: FieldAttrs,
}

pub struct Model {
    pub ident: syn::Ident,
    pub vis: syn::Visibility,
    pub attrs: ModelAttrs,
    pub fields: Vec<Field>,
    /// Whether the struct has no generic parameters (generic models are refused).
    pub generics_empty: bool,
}

impl Model {
    /// Reads a struct with named fields; reports anything else.
    pub fn from_item(cx: &Ctxt, item: &syn::DeriveInput) -> Option<Model> {
        let syn::Data::Struct(data) = &item.data else {
            cx.error_spanned_by(&item.ident, "`#[derive(Module)]` needs a struct whose fields are its layers; implement `Module` by hand for enums and unions");
            return None;
        };
        let syn::Fields::Named(named) = &data.fields else {
            cx.error_spanned_by(&item.ident, "`#[derive(Module)]` needs named fields: their names become the parameters' dotted paths");
            return None;
        };
        if !item.generics.params.is_empty() {
            cx.error_spanned_by(&item.generics, "generic models are not supported by `#[derive(Module)]`; use concrete layer types (a `Stack<Block>` field repeats a block)");
        }
        let fields = named
            .named
            .iter()
            .map(|f| Field { ident: f.ident.clone().expect("named"), ty: f.ty.clone(), attrs: FieldAttrs::parse(cx, &f.attrs) })
            .collect();
        Some(Model {
            ident: item.ident.clone(),
            vis: item.vis.clone(),
            attrs: ModelAttrs::parse(cx, &item.attrs),
            fields,
            generics_empty: item.generics.params.is_empty(),
        })
    }

    pub fn field(&self, name: &syn::Ident) -> Option<&Field> {
        self.fields.iter().find(|f| f.ident == *name)
    }
}
