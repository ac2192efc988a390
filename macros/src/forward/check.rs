//! Rules on the forward body: sub-modules exist, nothing is computed in
//! vain, and values flow forward through the pipeline stages.

use super::parse::{Op, Program};
use crate::ast::Model;
use crate::attr::Stage;
use crate::ctxt::Ctxt;

pub fn check(cx: &Ctxt, m: &Model, p: &Program) {
    check_fields(cx, m, p);
    if cx.has_errors() {
        return;
    }
    check_every_field_used(cx, m, p);
    check_unused(cx, p);
    check_stages(cx, m, p);
    check_split(cx, m, p);
}

/// The split field is where the pipeline cuts the model: it runs once, and
/// nothing computed before it is read after it (only the split field's
/// activation crosses from stage to stage).
fn check_split(cx: &Ctxt, m: &Model, p: &Program) {
    let is_split = |n: &super::parse::Node| matches!(&n.op, Op::Call(f) if m.field(f).and_then(|f| f.attrs.stage).is_some_and(|s| s.value == Stage::Split));
    let calls: Vec<usize> = p.nodes.iter().enumerate().filter(|(_, n)| is_split(n)).map(|(i, _)| i).collect();
    let Some(&split) = calls.first() else { return };
    for &again in &calls[1..] {
        cx.error_at(p.nodes[again].span, "the `#[stage(split)]` field runs once per forward: the pipeline cuts the model around that one call");
    }
    let before = super::expand::before_split(p, split);
    for (i, n) in p.nodes.iter().enumerate() {
        if i == split || before.contains(&i) {
            continue;
        }
        for &a in &n.args {
            if before.contains(&a) {
                let what = match &p.nodes[a].name {
                    Some(name) => format!("`{name}`"),
                    None => "a value".to_string(),
                };
                cx.error_at(
                    n.span,
                    format!("{what} is computed before the `#[stage(split)]` field and read after it; between pipeline stages only the split field's activation is passed"),
                );
            }
        }
    }
}

/// Every `self.name(..)` names a field of the struct.
fn check_fields(cx: &Ctxt, m: &Model, p: &Program) {
    for n in &p.nodes {
        if let Op::Call(f) = &n.op {
            if m.field(f).is_none() {
                let names: Vec<String> = m.fields.iter().map(|g| format!("`{}`", g.ident)).collect();
                cx.error_spanned_by(f, format!("`{}` has no field `{f}`; its layers are {}", m.ident, names.join(", ")));
            }
        }
    }
}

/// Every field is a layer the forward runs: a field it never calls would be
/// silently left out of initialisation, training and checkpoints.
fn check_every_field_used(cx: &Ctxt, m: &Model, p: &Program) {
    for f in &m.fields {
        let called = p.nodes.iter().any(|n| matches!(&n.op, Op::Call(c) if *c == f.ident));
        let tied_to = m.fields.iter().any(|g| g.attrs.tied.as_ref() == Some(&f.ident));
        if !called && !tied_to {
            cx.error_spanned_by(
                &f.ident,
                format!("`{}` is not used by the forward; every field of a model is a layer its forward calls: call it or remove it", f.ident),
            );
        }
    }
}

/// A value computed and never used would keep its parameters' gradients
/// from ever being complete; an unused input means the output ignores it.
fn check_unused(cx: &Ctxt, p: &Program) {
    for n in &p.nodes {
        if n.uses > 0 {
            continue;
        }
        match (&n.op, &n.name) {
            (Op::Input, _) => cx.error_at(n.span, format!("the input `{}` is never used", p.input)),
            (_, Some(name)) => cx.error_spanned_by(name, format!("`{name}` is computed but never used; remove it or use it")),
            (_, None) => cx.error_at(n.span, "this value is computed but never used"),
        }
    }
}

/// Pipeline stages follow the data flow: a layer on stage `first` cannot
/// consume a value produced on `split` or `last`, nor `split` one from `last`.
fn check_stages(cx: &Ctxt, m: &Model, p: &Program) {
    // The latest stage each value depends on.
    let mut stage: Vec<Option<Stage>> = Vec::with_capacity(p.nodes.len());
    for n in &p.nodes {
        let from = n.args.iter().filter_map(|&a| stage[a].map(|s| (s, a))).max_by_key(|(s, _)| *s);
        let own = match &n.op {
            Op::Call(f) => m.field(f).and_then(|f| f.attrs.stage).map(|s| s.value),
            _ => None,
        };
        if let (Some(own), Some((src, _))) = (own, from) {
            if own < src {
                let Op::Call(f) = &n.op else { unreachable!() };
                cx.error_at(
                    n.span,
                    format!(
                        "`{f}` is on pipeline stage `{}` but its input comes from stage `{}`; stages must follow the data flow (first, then split, then last)",
                        own.word(),
                        src.word()
                    ),
                );
            }
        }
        stage.push(own.max(from.map(|(s, _)| s)));
    }
}
