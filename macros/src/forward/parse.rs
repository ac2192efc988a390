//! Lowers a `#[forward]` body into SSA form: one node per operation, each
//! naming the nodes it reads.

use crate::ctxt::Ctxt;
use proc_macro2::Span;
use std::collections::HashMap;
use syn::spanned::Spanned;

/// The differentiable functions a forward body may call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Func {
    Gelu,
    Silu,
    Swiglu,
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Func {
    fn from_name(name: &str) -> Option<Func> {
        Some(match name {
            "gelu" => Func::Gelu,
            "silu" => Func::Silu,
            "swiglu" => Func::Swiglu,
            "all_reduce" => Func::AllReduce,
            "reduce_scatter" => Func::ReduceScatter,
            "all_gather" => Func::AllGather,
            _ => return None,
        })
    }

    pub fn arity(self) -> usize {
        if self == Func::Swiglu {
            2
        } else {
            1
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Func::Gelu => "gelu",
            Func::Silu => "silu",
            Func::Swiglu => "swiglu",
            Func::AllReduce => "all_reduce",
            Func::ReduceScatter => "reduce_scatter",
            Func::AllGather => "all_gather",
        }
    }
}

#[derive(Clone, Debug)]
pub enum Op {
    /// The forward's input.
    Input,
    /// `self.field(arg)`.
    Call(syn::Ident),
    /// `a + b`.
    Add,
    /// `a * b`.
    Mul,
    /// `func(args..)`.
    Func(Func),
}

pub struct Node {
    pub op: Op,
    pub args: Vec<usize>,
    /// The user's expression, for errors and for `quote_spanned!`.
    pub span: Span,
    /// How many later nodes (or the output) read this one.
    pub uses: usize,
    /// The `let` name bound to it, if any.
    pub name: Option<syn::Ident>,
}

pub struct Program {
    pub input: syn::Ident,
    pub in_layout: syn::Type,
    pub out_layout: syn::Type,
    pub nodes: Vec<Node>,
    pub output: usize,
    /// The `#[forward]` impl's parameters and where-clause (`impl<B: Block> Lm<B>`),
    /// which every generated impl repeats.
    pub generics: syn::Generics,
    /// The model type as the impl names it (`Lm<B>`).
    pub self_ty: syn::Type,
}

const ALLOWED: &str = "a `#[forward]` body may use `let` bindings, sub-module calls `self.field(x)`, \
`gelu`, `silu`, `swiglu`, `all_reduce`, `reduce_scatter`, `all_gather`, `+` and `*`; \
for anything else implement `Module` by hand with an explicit backward";

/// The layout `L` of a type written `Act<L>`.
fn act_layout(ty: &syn::Type) -> Option<syn::Type> {
    let syn::Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    if last.ident != "Act" {
        return None;
    }
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else { return None };
    match args.args.first()? {
        syn::GenericArgument::Type(t) if args.args.len() == 1 => Some(t.clone()),
        _ => None,
    }
}

pub fn parse(cx: &Ctxt, item: &syn::ItemImpl) -> Option<Program> {
    let mut fns = item.items.iter().filter_map(|i| match i {
        syn::ImplItem::Fn(f) => Some(f),
        _ => None,
    });
    let Some(f) = fns.next() else {
        cx.error_spanned_by(&item.self_ty, "a `#[forward]` impl holds one method: `fn forward(&self, x: Act<L>) -> Act<M>`");
        return None;
    };
    if item.items.len() != 1 {
        cx.error_spanned_by(&item.self_ty, "a `#[forward]` impl holds exactly one method, the forward; put other methods in a separate `impl` block");
    }
    let sig = &f.sig;
    let mut inputs = sig.inputs.iter();
    match inputs.next() {
        Some(syn::FnArg::Receiver(r)) if r.reference.is_some() && r.mutability.is_none() => {}
        _ => {
            cx.error_spanned_by(sig, "the forward takes `&self` and one activation: `fn forward(&self, x: Act<L>) -> Act<M>`");
            return None;
        }
    }
    let Some(syn::FnArg::Typed(arg)) = inputs.next() else {
        cx.error_spanned_by(sig, "the forward takes one activation after `&self`: `fn forward(&self, x: Act<L>) -> Act<M>`");
        return None;
    };
    let extras: Vec<&syn::FnArg> = inputs.collect();
    for extra in &extras {
        cx.error_spanned_by(extra, "the forward takes exactly one activation; pass several values through a sub-module that combines them");
    }
    let syn::Pat::Ident(input) = &*arg.pat else {
        cx.error_spanned_by(&arg.pat, "name the forward's input with a plain identifier, e.g. `x: Act<Replicated>`");
        return None;
    };
    let Some(in_layout) = act_layout(&arg.ty) else {
        cx.error_spanned_by(&arg.ty, "the forward's input must be written `Act<Layout>`, e.g. `Act<Replicated>`");
        return None;
    };
    let out_layout = match &sig.output {
        syn::ReturnType::Type(_, ty) => act_layout(ty),
        syn::ReturnType::Default => None,
    };
    let Some(out_layout) = out_layout else {
        match &sig.output {
            syn::ReturnType::Default => cx.error_spanned_by(&sig.ident, "the forward must return `Act<Layout>`, e.g. `-> Act<Replicated>`"),
            out => cx.error_spanned_by(out, "the forward must return `Act<Layout>`, e.g. `-> Act<Replicated>`"),
        }
        return None;
    };
    let mut lower = Lower { cx, nodes: Vec::new(), env: HashMap::new() };
    for extra in extras {
        if let syn::FnArg::Typed(syn::PatType { pat, .. }) = extra {
            if let syn::Pat::Ident(pi) = &**pat {
                lower.env.insert(pi.ident.to_string(), None);
            }
        }
    }
    lower.nodes.push(Node { op: Op::Input, args: vec![], span: input.ident.span(), uses: 0, name: Some(input.ident.clone()) });
    lower.env.insert(input.ident.to_string(), Some(0));
    let mut output = None;
    let stmts = &f.block.stmts;
    for (i, stmt) in stmts.iter().enumerate() {
        let last = i + 1 == stmts.len();
        match stmt {
            syn::Stmt::Local(local) => {
                let syn::Pat::Ident(pi) = &local.pat else {
                    cx.error_spanned_by(&local.pat, format!("bind one value per `let` with a plain name; {ALLOWED}"));
                    poison_pattern(&mut lower.env, &local.pat);
                    continue;
                };
                let Some(init) = &local.init else {
                    cx.error_spanned_by(local, "a `let` in a forward body must bind a value: `let h = ...;`");
                    continue;
                };
                let id = lower.expr(&init.expr);
                if let Some(id) = id {
                    if lower.nodes[id].name.is_none() {
                        lower.nodes[id].name = Some(pi.ident.clone());
                    }
                }
                lower.env.insert(pi.ident.to_string(), id);
            }
            syn::Stmt::Expr(e, None) if last => output = lower.expr(e),
            other => cx.error_spanned_by(other, format!("the forward body is `let` bindings followed by the output expression (no `;` after it); {ALLOWED}")),
        }
    }
    let output = match output {
        Some(o) => o,
        None => {
            if !cx.has_errors() {
                cx.error_spanned_by(&f.block, "the forward body must end with the output expression");
            }
            // The signature is still good: the caller emits a placeholder impl
            // with its layouts, so the model's uses add no errors of their own.
            0
        }
    };
    lower.nodes[output].uses += 1;
    Some(Program {
        input: input.ident.clone(),
        in_layout,
        out_layout,
        nodes: lower.nodes,
        output,
        generics: item.generics.clone(),
        self_ty: (*item.self_ty).clone(),
    })
}

struct Lower<'a> {
    cx: &'a Ctxt,
    nodes: Vec<Node>,
    /// Bound names; `None` marks a name whose binding failed (already
    /// reported, so its uses are not reported again).
    env: HashMap<String, Option<usize>>,
}

impl Lower<'_> {
    fn push(&mut self, op: Op, args: Vec<usize>, span: Span) -> usize {
        for &a in &args {
            self.nodes[a].uses += 1;
        }
        self.nodes.push(Node { op, args, span, uses: 0, name: None });
        self.nodes.len() - 1
    }

    fn expr(&mut self, e: &syn::Expr) -> Option<usize> {
        match e {
            syn::Expr::Paren(p) => self.expr(&p.expr),
            syn::Expr::Group(g) => self.expr(&g.expr),
            syn::Expr::Path(p) if p.path.get_ident().is_some() && p.qself.is_none() => {
                let id = p.path.get_ident().expect("checked");
                match self.env.get(&id.to_string()) {
                    Some(&n) => n,
                    None => {
                        self.cx.error_spanned_by(id, format!("unknown value `{id}`: bind it with `let` before using it"));
                        None
                    }
                }
            }
            syn::Expr::MethodCall(m) if is_self(&m.receiver) => {
                if m.args.len() != 1 {
                    self.cx.error_spanned_by(&m.method, format!("a sub-module takes one activation: `self.{}(x)`", m.method));
                    return None;
                }
                let arg = self.expr(&m.args[0])?;
                Some(self.push(Op::Call(m.method.clone()), vec![arg], m.method.span()))
            }
            syn::Expr::Call(c) => {
                let name = match &*c.func {
                    syn::Expr::Path(p) if p.path.get_ident().is_some() => p.path.get_ident().expect("checked").clone(),
                    other => {
                        self.cx.error_spanned_by(other, format!("not part of the forward DSL; {ALLOWED}"));
                        return None;
                    }
                };
                let Some(func) = Func::from_name(&name.to_string()) else {
                    self.cx.error_spanned_by(&name, format!("`{name}` is not a function of the forward DSL; {ALLOWED}"));
                    return None;
                };
                if c.args.len() != func.arity() {
                    self.cx.error_spanned_by(e, format!("`{}` takes {} argument(s), got {}", func.name(), func.arity(), c.args.len()));
                    return None;
                }
                let args: Option<Vec<usize>> = c.args.iter().map(|a| self.expr(a)).collect();
                Some(self.push(Op::Func(func), args?, name.span()))
            }
            syn::Expr::Binary(b) => {
                let op = match b.op {
                    syn::BinOp::Add(_) => Op::Add,
                    syn::BinOp::Mul(_) => Op::Mul,
                    _ => {
                        self.cx.error_spanned_by(b.op, format!("this operator is not part of the forward DSL; {ALLOWED}"));
                        return None;
                    }
                };
                let l = self.expr(&b.left);
                let r = self.expr(&b.right);
                Some(self.push(op, vec![l?, r?], b.op.span()))
            }
            other => {
                self.cx.error_spanned_by(other, format!("not part of the forward DSL; {ALLOWED}"));
                None
            }
        }
    }
}

fn is_self(e: &syn::Expr) -> bool {
    matches!(e, syn::Expr::Path(p) if p.path.is_ident("self"))
}

/// Marks every name a failed pattern would have bound.
fn poison_pattern(env: &mut HashMap<String, Option<usize>>, pat: &syn::Pat) {
    match pat {
        syn::Pat::Ident(pi) => {
            env.insert(pi.ident.to_string(), None);
        }
        syn::Pat::Tuple(t) => t.elems.iter().for_each(|p| poison_pattern(env, p)),
        syn::Pat::Type(t) => poison_pattern(env, &t.pat),
        syn::Pat::Paren(p) => poison_pattern(env, &p.pat),
        _ => {}
    }
}
