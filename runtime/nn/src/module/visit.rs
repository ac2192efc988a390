//! Walking a model's parameters with stable dotted names.

use super::{Param, Role, RoleKind, StagePart};
use serde::{Deserialize, Serialize};
use tessera_core::Result;

/// Which expert of a mixture-of-experts layer a parameter belongs to.
///
/// Expert parallelism places expert `index` of `count` on one rank of the
/// expert-parallel group; every other parameter is replicated over it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ExpertSlot {
    /// The expert's global index.
    pub index: usize,
    /// Experts in the layer (over all ranks of the expert-parallel group).
    pub count: usize,
}

impl ExpertSlot {
    /// The rank of an expert-parallel group of `degree` that holds this
    /// expert (experts are dealt out in contiguous blocks).
    pub fn rank(&self, degree: usize) -> usize {
        self.index / (self.count / degree).max(1)
    }
}

/// One parameter as a visitor sees it.
#[derive(Clone, Copy, Debug)]
pub struct ParamEntry<'a> {
    /// Stable dotted path, e.g. `blocks.3.qkv.weight`.
    pub name: &'a str,
    /// The parameter.
    pub param: &'a Param,
    /// The role of the layer that owns the parameter.
    pub role: RoleKind,
    /// The dimension that role splits over the tensor-parallel group, if any.
    pub split_dim: Option<usize>,
    /// The dotted path of the innermost sub-module that owns the parameter:
    /// the path its parent's forward calls it by, and the path hooks see
    /// (a ZeRO-3 engine gathers the parameter around that call).
    pub module: &'a str,
    /// The part of a pipelined model this use of the parameter belongs to.
    pub stage: StagePart,
    /// The expert it belongs to, for an expert of a mixture-of-experts layer.
    pub expert: Option<ExpertSlot>,
}

/// Where the visitor is with respect to the pipeline cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placing {
    /// No part decided yet.
    Open,
    /// Inside the split field, before its layer is known.
    SplitField,
    /// Decided (by the outermost staged model).
    Part(StagePart),
}

/// Carries the current path and role down a model while its parameters are visited.
pub struct Visitor<'a> {
    path: String,
    module: String,
    role: RoleKind,
    placing: Placing,
    expert: Option<ExpertSlot>,
    f: &'a mut dyn FnMut(ParamEntry<'_>) -> Result<()>,
}

impl<'a> Visitor<'a> {
    /// A visitor calling `f` on every parameter.
    pub fn new(f: &'a mut dyn FnMut(ParamEntry<'_>) -> Result<()>) -> Self {
        Visitor { path: String::new(), module: String::new(), role: RoleKind::Plain, placing: Placing::Open, expert: None, f }
    }

    /// Reports the parameter `name` of the current layer; `split_dim` is the
    /// dimension the layer's role splits (`None` for replicated parameters).
    pub fn param(&mut self, name: &str, param: &Param, split_dim: Option<usize>) -> Result<()> {
        let full = self.join(name);
        let split_dim = if self.role == RoleKind::Plain { None } else { split_dim };
        let stage = match self.placing {
            Placing::Part(p) => p,
            // A split field that is not a stack of layers: every stage holds it.
            Placing::Open | Placing::SplitField => StagePart::Whole,
        };
        (self.f)(ParamEntry { name: &full, param, role: self.role, split_dim, module: &self.module, stage, expert: self.expert })
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

    /// Visits, with `f`, a part of a pipelined model (what `#[stage(..)]`
    /// fields generate). The outermost staged model decides: inside a part
    /// already decided, this changes nothing.
    pub fn stage_part(&mut self, part: StagePart, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        self.placing_for(Placing::Part(part), f)
    }

    /// Visits, with `f`, the `#[stage(split)]` field of a pipelined model; a
    /// [`Stack`](crate::Stack) inside names each layer's part with
    /// [`pipeline_layer`](Self::pipeline_layer).
    pub fn split_field(&mut self, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        self.placing_for(Placing::SplitField, f)
    }

    /// Visits, with `f`, layer `index` of `count` of a sequence of layers:
    /// inside a split field, the layer's parameters belong to
    /// [`StagePart::Layer`]; elsewhere nothing changes.
    pub fn pipeline_layer(&mut self, index: usize, count: usize, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        if self.placing != Placing::SplitField {
            return f(self);
        }
        self.placing = Placing::Part(StagePart::Layer { index, count });
        let r = f(self);
        self.placing = Placing::SplitField;
        r
    }

    /// Visits, with `f`, the parameters of expert `index` of `count` of a
    /// mixture-of-experts layer (each held by one expert-parallel rank).
    pub fn expert(&mut self, index: usize, count: usize, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        let saved = self.expert.replace(ExpertSlot { index, count });
        let r = f(self);
        self.expert = saved;
        r
    }

    fn placing_for(&mut self, placing: Placing, f: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        if self.placing != Placing::Open {
            return f(self);
        }
        self.placing = placing;
        let r = f(self);
        self.placing = Placing::Open;
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
