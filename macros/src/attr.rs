//! Typed attribute slots for fields (`#[shard]`, `#[stage]`, `#[recompute]`,
//! `#[precision]`, `#[tied]`) and models (`#[model(..)]`).

use crate::ctxt::Ctxt;
use crate::symbol::*;
use proc_macro2::Span;
use syn::meta::ParseNestedMeta;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shard {
    Column,
    Row,
    Vocab,
}

impl Shard {
    pub fn role(self) -> &'static str {
        match self {
            Shard::Column => "Column",
            Shard::Row => "Row",
            Shard::Vocab => "Vocab",
        }
    }
    pub fn word(self) -> &'static str {
        match self {
            Shard::Column => COLUMN,
            Shard::Row => ROW,
            Shard::Vocab => VOCAB,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    First,
    Split,
    Last,
}

impl Stage {
    pub fn word(self) -> &'static str {
        match self {
            Stage::First => FIRST,
            Stage::Split => SPLIT,
            Stage::Last => LAST,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    Full,
    Selective,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
    F16,
}

impl Precision {
    pub fn dtype(self) -> &'static str {
        match self {
            Precision::F32 => "F32",
            Precision::Bf16 => "BF16",
            Precision::F16 => "F16",
        }
    }
}

/// A value read from an attribute, with the span to report problems at.
#[derive(Clone, Copy, Debug)]
pub struct Spanned<T> {
    pub value: T,
    pub span: Span,
}

/// One attribute slot: reports a second occurrence as a duplicate.
struct Slot<T> {
    name: &'static str,
    value: Option<Spanned<T>>,
}

impl<T: Copy + PartialEq> Slot<T> {
    fn new(name: &'static str) -> Self {
        Slot { name, value: None }
    }

    fn set(&mut self, cx: &Ctxt, span: Span, value: T, conflict: impl FnOnce(T, T) -> Option<String>) {
        match self.value {
            None => self.value = Some(Spanned { value, span }),
            Some(old) if old.value == value => cx.error_at(span, format!("duplicate `{}` attribute", self.name)),
            Some(old) => match conflict(old.value, value) {
                Some(msg) => cx.error_at(span, msg),
                None => cx.error_at(span, format!("duplicate `{}` attribute", self.name)),
            },
        }
    }
}

/// The DSL attributes of one field.
#[derive(Clone, Default)]
pub struct FieldAttrs {
    pub shard: Option<Spanned<Shard>>,
    pub stage: Option<Spanned<Stage>>,
    pub recompute: Option<Spanned<Recompute>>,
    pub precision: Option<Spanned<Precision>>,
    pub tied: Option<syn::Ident>,
}

fn word(meta: &ParseNestedMeta) -> Option<String> {
    meta.path.get_ident().map(|i| i.to_string())
}

impl FieldAttrs {
    pub fn parse(cx: &Ctxt, attrs: &[syn::Attribute]) -> FieldAttrs {
        let mut shard = Slot::new(SHARD);
        let mut stage = Slot::new(STAGE);
        let mut recompute = Slot::new(RECOMPUTE);
        let mut precision = Slot::new(PRECISION);
        let mut tied: Option<syn::Ident> = None;
        for attr in attrs {
            let Some(name) = attr.path().get_ident().map(|i| i.to_string()) else { continue };
            let span = attr.path().get_ident().map(|i| i.span()).unwrap_or_else(Span::call_site);
            match name.as_str() {
                SHARD => {
                    if matches!(attr.meta, syn::Meta::Path(_)) {
                        cx.error_spanned_by(attr, "`#[shard]` needs a kind: `#[shard(column)]`, `#[shard(row)]` or `#[shard(vocab)]`");
                        continue;
                    }
                    let r = attr.parse_nested_meta(|meta| {
                        let kind = match word(&meta).as_deref() {
                            Some(COLUMN) => Shard::Column,
                            Some(ROW) => Shard::Row,
                            Some(VOCAB) => Shard::Vocab,
                            _ => return Err(meta.error(format!("unknown shard kind `{}`: expected `column`, `row` or `vocab`", path_str(&meta.path)))),
                        };
                        shard.set(cx, meta.path.span_of(), kind, |a, b| {
                            Some(format!(
                                "conflicting `shard` attributes: this layer is already `{}`-parallel and cannot also be `{}`-parallel; keep one",
                                a.word(),
                                b.word()
                            ))
                        });
                        Ok(())
                    });
                    if let Err(e) = r {
                        cx.syn_error(e);
                    }
                }
                STAGE => {
                    let r = attr.parse_nested_meta(|meta| {
                        let s = match word(&meta).as_deref() {
                            Some(FIRST) => Stage::First,
                            Some(SPLIT) => Stage::Split,
                            Some(LAST) => Stage::Last,
                            _ => return Err(meta.error(format!("unknown stage `{}`: expected `first`, `split` or `last`", path_str(&meta.path)))),
                        };
                        stage.set(cx, meta.path.span_of(), s, |a, b| {
                            Some(format!("conflicting `stage` attributes: `{}` and `{}`; a field belongs to one pipeline stage", a.word(), b.word()))
                        });
                        Ok(())
                    });
                    if matches!(attr.meta, syn::Meta::Path(_)) {
                        cx.error_spanned_by(attr, "`#[stage]` needs a stage: `#[stage(first)]`, `#[stage(split)]` or `#[stage(last)]`");
                    } else if let Err(e) = r {
                        cx.syn_error(e);
                    }
                }
                RECOMPUTE => {
                    if matches!(attr.meta, syn::Meta::Path(_)) {
                        recompute.set(cx, span, Recompute::Full, |_, _| None);
                        continue;
                    }
                    let r = attr.parse_nested_meta(|meta| {
                        let r = match word(&meta).as_deref() {
                            Some(SELECTIVE) => Recompute::Selective,
                            Some(FULL) => Recompute::Full,
                            _ => {
                                return Err(meta.error(format!(
                                    "unknown recompute mode `{}`: write `#[recompute]` (full) or `#[recompute(selective)]`",
                                    path_str(&meta.path)
                                )))
                            }
                        };
                        recompute.set(cx, meta.path.span_of(), r, |_, _| Some("conflicting `recompute` attributes: choose full or selective".into()));
                        Ok(())
                    });
                    if let Err(e) = r {
                        cx.syn_error(e);
                    }
                }
                PRECISION => {
                    let r = attr.parse_nested_meta(|meta| {
                        let p = parse_precision(&meta)?;
                        precision.set(cx, meta.path.span_of(), p, |_, _| Some("conflicting `precision` attributes: a field computes in one precision".into()));
                        Ok(())
                    });
                    if matches!(attr.meta, syn::Meta::Path(_)) {
                        cx.error_spanned_by(attr, "`#[precision]` needs a dtype: `#[precision(f32)]`, `#[precision(bf16)]` or `#[precision(f16)]`");
                    } else if let Err(e) = r {
                        cx.syn_error(e);
                    }
                }
                TIED => match attr.parse_args::<syn::Ident>() {
                    Ok(id) if tied.is_some() => cx.error_spanned_by(&id, "duplicate `tied` attribute"),
                    Ok(id) => tied = Some(id),
                    Err(_) => cx.error_spanned_by(attr, "`#[tied(..)]` names the field whose weight this layer shares, e.g. `#[tied(tok)]`"),
                },
                _ => {}
            }
        }
        FieldAttrs { shard: shard.value, stage: stage.value, recompute: recompute.value, precision: precision.value, tied }
    }
}

fn parse_precision(meta: &ParseNestedMeta) -> syn::Result<Precision> {
    match word(meta).as_deref() {
        Some(F32) => Ok(Precision::F32),
        Some(BF16) => Ok(Precision::Bf16),
        Some(F16) => Ok(Precision::F16),
        _ => Err(meta.error(format!("unknown precision `{}`: expected `f32`, `bf16` or `f16`", path_str(&meta.path)))),
    }
}

fn path_str(p: &syn::Path) -> String {
    quote::quote!(#p).to_string().replace(' ', "")
}

trait SpanOf {
    fn span_of(&self) -> Span;
}
impl SpanOf for syn::Path {
    fn span_of(&self) -> Span {
        syn::spanned::Spanned::span(self)
    }
}

/// `#[model(..)]` on the struct.
#[derive(Default)]
pub struct ModelAttrs {
    pub precision: Option<Spanned<Precision>>,
    pub loss_scaling: Option<Spanned<bool>>,
    /// A static tensor-parallel degree, `tp = N`.
    pub tp: Option<Spanned<u64>>,
    /// Const dimensions, `dims(name = N, ..)`, checked against `tp`.
    pub dims: Vec<(syn::Ident, Spanned<u64>)>,
}

impl ModelAttrs {
    pub fn parse(cx: &Ctxt, attrs: &[syn::Attribute]) -> ModelAttrs {
        let mut precision = Slot::new(PRECISION);
        let mut loss_scaling = Slot::new(LOSS_SCALING);
        let mut tp = Slot::new(TP);
        let mut dims: Vec<(syn::Ident, Spanned<u64>)> = Vec::new();
        for attr in attrs.iter().filter(|a| a.path().is_ident(MODEL)) {
            let r = attr.parse_nested_meta(|meta| {
                let span = meta.path.span_of();
                match word(&meta).as_deref() {
                    Some(PRECISION) => {
                        let v: syn::Ident = meta.value()?.call(syn::ext::IdentExt::parse_any)?;
                        let p = match v.to_string().as_str() {
                            F32 => Precision::F32,
                            BF16 => Precision::Bf16,
                            F16 => Precision::F16,
                            other => return Err(syn::Error::new(v.span(), format!("unknown precision `{other}`: expected `f32`, `bf16` or `f16`"))),
                        };
                        precision.set(cx, span, p, |_, _| None);
                    }
                    Some(LOSS_SCALING) => {
                        let v: syn::Ident = meta.value()?.call(syn::ext::IdentExt::parse_any)?;
                        let on = match v.to_string().as_str() {
                            DYNAMIC => true,
                            NONE => false,
                            other => return Err(syn::Error::new(v.span(), format!("unknown loss scaling `{other}`: expected `dynamic` or `none`"))),
                        };
                        loss_scaling.set(cx, span, on, |_, _| None);
                    }
                    Some(TP) => {
                        let v: syn::LitInt = meta
                            .value()?
                            .parse()
                            .map_err(|e: syn::Error| syn::Error::new(e.span(), "`tp` takes the tensor-parallel degree as an integer, e.g. `tp = 4`"))?;
                        let n: u64 = v.base10_parse()?;
                        if n == 0 {
                            return Err(syn::Error::new(v.span(), "the tensor-parallel degree must be at least 1"));
                        }
                        tp.set(cx, span, n, |_, _| None);
                    }
                    Some(DIMS) => {
                        meta.parse_nested_meta(|dim| {
                            let Some(name) = dim.path.get_ident().cloned() else {
                                return Err(dim.error("a dimension is `name = value`, e.g. `vocab = 50304`"));
                            };
                            let v: syn::LitInt = dim.value()?.parse()?;
                            let n: u64 = v.base10_parse()?;
                            if dims.iter().any(|(d, _)| *d == name) {
                                cx.error_spanned_by(&name, format!("duplicate dimension `{name}`"));
                            } else {
                                dims.push((name, Spanned { value: n, span: v.span() }));
                            }
                            Ok(())
                        })?;
                    }
                    _ => {
                        return Err(
                            meta.error(format!("unknown `model` key `{}`: expected `precision`, `loss_scaling`, `tp` or `dims(..)`", path_str(&meta.path)))
                        )
                    }
                }
                Ok(())
            });
            if let Err(e) = r {
                cx.syn_error(e);
            }
        }
        ModelAttrs { precision: precision.value, loss_scaling: loss_scaling.value, tp: tp.value, dims }
    }
}
