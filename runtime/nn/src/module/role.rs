//! Roles: how a parent uses a sub-module, set by `#[shard(..)]` on its field.

use std::fmt;

mod sealed {
    pub trait Sealed {}
}

/// A zero-sized marker for the role a layer plays in its parent: plain,
/// column-parallel, row-parallel or vocab-parallel. A layer implements
/// [`Module<R>`](super::Module) for each role it supports, with the layouts
/// that role implies.
pub trait Role: sealed::Sealed + Copy + Default + fmt::Debug + Send + Sync + 'static {
    /// The role as a value, for parameter visitors.
    const KIND: RoleKind;
}

/// The role of a sub-module, as a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RoleKind {
    /// Not sharded: the layer's parameters are replicated over the TP group.
    Plain,
    /// Output features split over the TP group (Megatron's column-parallel linear).
    Column,
    /// Input features split over the TP group (row-parallel linear).
    Row,
    /// Vocabulary rows split over the TP group (vocab-parallel embedding or head).
    Vocab,
}

macro_rules! roles {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
        pub struct $name;
        impl sealed::Sealed for $name {}
        impl Role for $name {
            const KIND: RoleKind = RoleKind::$name;
        }
    )*};
}

roles! {
    /// A field without `#[shard]`.
    Plain,
    /// `#[shard(column)]`.
    Column,
    /// `#[shard(row)]`.
    Row,
    /// `#[shard(vocab)]`.
    Vocab,
}
