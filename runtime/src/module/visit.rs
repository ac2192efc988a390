//! Walking a model's parameters with stable dotted names.

use super::{Param, Role, RoleKind};
use crate::error::Result;

/// One parameter as a visitor sees it.
#[derive(Clone, Copy, Debug)]
pub struct ParamEntry<'a> {
    /// Stable dotted path, e.g. `blocks.3.qkv.weight`.
    pub name: &'a str,
    pub param: &'a Param,
    /// The role of the layer that owns the parameter.
    pub role: RoleKind,
    /// The dimension that role splits over the tensor-parallel group, if any.
    pub split_dim: Option<usize>,
    /// The dotted path of the innermost sub-module that owns the parameter:
    /// the path its parent's forward calls it by, and the path hooks see
    /// (a ZeRO-3 engine gathers the parameter around that call).
    pub module: &'a str,
}

/// Carries the current path and role down a model while its parameters are visited.
pub struct Visitor<'a> {
    path: String,
    module: String,
    role: RoleKind,
    f: &'a mut dyn FnMut(ParamEntry<'_>) -> Result<()>,
}

impl<'a> Visitor<'a> {
    /// A visitor calling `f` on every parameter.
    pub fn new(f: &'a mut dyn FnMut(ParamEntry<'_>) -> Result<()>) -> Self {
        Visitor { path: String::new(), module: String::new(), role: RoleKind::Plain, f }
    }

    /// Reports the parameter `name` of the current layer; `split_dim` is the
    /// dimension the layer's role splits (`None` for replicated parameters).
    pub fn param(&mut self, name: &str, param: &Param, split_dim: Option<usize>) -> Result<()> {
        let full = self.join(name);
        let split_dim = if self.role == RoleKind::Plain { None } else { split_dim };
        (self.f)(ParamEntry { name: &full, param, role: self.role, split_dim, module: &self.module })
    }

    /// Visits the sub-module `name`, used in role `R` and called through
    /// [`call`](super::call) (so hooks see it by this path), with `f`.
    pub fn child<R: Role>(&mut self, name: &str, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        let joined = self.join(name);
        let saved_path = std::mem::replace(&mut self.path, joined.clone());
        let saved_module = std::mem::replace(&mut self.module, joined);
        let saved_role = std::mem::replace(&mut self.role, R::KIND);
        let r = f(self);
        self.path = saved_path;
        self.module = saved_module;
        self.role = saved_role;
        r
    }

    /// Visits a group of the current layer's own parameters under the name
    /// prefix `name` (an MoE layer's `experts.3`): only the names change; the
    /// parameters still belong to the current sub-module.
    pub fn group(&mut self, name: &str, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        let joined = self.join(name);
        let saved_path = std::mem::replace(&mut self.path, joined);
        let r = f(self);
        self.path = saved_path;
        r
    }

    fn join(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }
}
