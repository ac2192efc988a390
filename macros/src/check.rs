//! Rules across the fields of one model, each reported at the user's span.

use crate::ast::Model;
use crate::attr::{Precision, Stage};
use crate::ctxt::Ctxt;

pub fn check(cx: &Ctxt, m: &Model) {
    check_tied(cx, m);
    check_split_stacks(cx, m);
    check_fp16_needs_loss_scaling(cx, m);
    check_static_dims(cx, m);
}

/// With a static mesh, every declared dimension must split evenly over the
/// tensor-parallel degree: a vocabulary or head count that does not divide
/// is refused here rather than silently mis-sharded at run time.
fn check_static_dims(cx: &Ctxt, m: &Model) {
    let Some(tp) = m.attrs.tp else { return };
    for (name, n) in &m.attrs.dims {
        if n.value % tp.value != 0 {
            let padded = n.value.div_ceil(tp.value) * tp.value;
            cx.error_at(
                n.span,
                format!(
                    "`{name} = {}` does not divide by the tensor-parallel degree `tp = {}`; pad it to {padded} or choose a degree that divides it",
                    n.value, tp.value
                ),
            );
        }
    }
}

/// A tied field must name another field of the same struct: the weight is
/// shared, not copied. Both layers must split it the same way over the
/// tensor-parallel group (their roles are known here; their shapes only when
/// the model is built, where a mismatch names both fields).
fn check_tied(cx: &Ctxt, m: &Model) {
    let role = |f: &crate::ast::Field| match f.attrs.shard {
        Some(s) => format!("`{}`-parallel (`#[shard({})]`)", s.value.word(), s.value.word()),
        None => "not sharded".to_string(),
    };
    for f in &m.fields {
        let Some(partner) = &f.attrs.tied else { continue };
        if *partner == f.ident {
            cx.error_spanned_by(partner, format!("`{}` cannot be tied to itself; name the field whose weight it shares", f.ident));
        } else if let Some(pf) = m.field(partner) {
            if f.attrs.shard.map(|s| s.value) != pf.attrs.shard.map(|s| s.value) {
                cx.error_spanned_by(
                    partner,
                    format!(
                        "`{}` is {} but `{partner}`, whose weight it shares, is {}; tied layers split their one weight the same way over the tensor-parallel group: give both the same `#[shard(..)]`",
                        f.ident,
                        role(f),
                        role(pf)
                    ),
                );
            }
        } else if m.field(partner).is_none() {
            let names: Vec<String> = m.fields.iter().filter(|g| g.ident != f.ident).map(|g| format!("`{}`", g.ident)).collect();
            cx.error_spanned_by(partner, format!("no field `{partner}` to tie `{}` to; fields of `{}` are {}", f.ident, m.ident, names.join(", ")));
        }
    }
}

/// The pipeline splits exactly one stack of blocks over its stages.
fn check_split_stacks(cx: &Ctxt, m: &Model) {
    let mut split = m.fields.iter().filter(|f| f.attrs.stage.is_some_and(|s| s.value == Stage::Split));
    if let Some(first) = split.next() {
        for other in split {
            let span = other.attrs.stage.expect("split").span;
            cx.error_at(span, format!("only one field can be `#[stage(split)]`, and `{}` already is; put the blocks in one `Stack`", first.ident));
        }
    }
}

/// fp16 overflows without loss scaling: a model that computes anything in
/// fp16 must allow it.
fn check_fp16_needs_loss_scaling(cx: &Ctxt, m: &Model) {
    if m.attrs.loss_scaling.is_none_or(|l| l.value) {
        return;
    }
    let model_f16 = m.attrs.precision.filter(|p| p.value == Precision::F16).map(|p| p.span);
    let field_f16 = m.fields.iter().filter_map(|f| f.attrs.precision.filter(|p| p.value == Precision::F16).map(|p| p.span));
    for span in model_f16.into_iter().chain(field_f16) {
        cx.error_at(span, "an fp16 region needs loss scaling, but the model sets `loss_scaling = none`; use `bf16`, or `loss_scaling = dynamic`");
    }
}
