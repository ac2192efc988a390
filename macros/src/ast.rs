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
    /// The struct's type and const parameters and where-clause (a model
    /// generic over its block type, `Lm<B: Block>`).
    pub generics: syn::Generics,
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
        for lt in item.generics.lifetimes() {
            cx.error_spanned_by(lt, "a model owns its layers: lifetime parameters are not supported by `#[derive(Module)]`; make the model generic over layer types instead (`Lm<B: Block>`)");
        }
        let fields =
            named.named.iter().map(|f| Field { ident: f.ident.clone().expect("named"), ty: f.ty.clone(), attrs: FieldAttrs::parse(cx, &f.attrs) }).collect();
        Some(Model { ident: item.ident.clone(), vis: item.vis.clone(), attrs: ModelAttrs::parse(cx, &item.attrs), fields, generics: item.generics.clone() })
    }

    pub fn field(&self, name: &syn::Ident) -> Option<&Field> {
        self.fields.iter().find(|f| f.ident == *name)
    }
}
