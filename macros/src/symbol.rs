//! The DSL's attribute names and keys.

pub const SHARD: &str = "shard";
pub const STAGE: &str = "stage";
pub const RECOMPUTE: &str = "recompute";
pub const PRECISION: &str = "precision";
pub const TIED: &str = "tied";
pub const MODEL: &str = "model";

pub const COLUMN: &str = "column";
pub const ROW: &str = "row";
pub const VOCAB: &str = "vocab";

pub const FIRST: &str = "first";
pub const SPLIT: &str = "split";
pub const LAST: &str = "last";

pub const SELECTIVE: &str = "selective";
pub const FULL: &str = "full";

pub const F32: &str = "f32";
pub const BF16: &str = "bf16";
pub const F16: &str = "f16";

pub const LOSS_SCALING: &str = "loss_scaling";
pub const DYNAMIC: &str = "dynamic";
pub const NONE: &str = "none";
pub const TP: &str = "tp";
pub const DIMS: &str = "dims";
