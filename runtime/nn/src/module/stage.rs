//! Where a pipeline places a parameter: the part of a staged model that
//! reaches it, and the stage that runs that part.
//!
//! A model with a `#[stage(split)]` field is cut into the part before that
//! field (the first stage's), the field's layers (divided among the virtual
//! stages, see `tessera::parallel::pipeline`), and the part after
//! it (the last stage's). The parameter visitor reports each parameter's
//! [`StagePart`]; a [`PipelineLayout`] maps parts to stages. Both
//! materialisation (a stage holds only its own parameters) and checkpoints
//! (each stage writes only its own) read the placement from here, so they
//! always agree with what the pipeline executor runs.

use serde::{Deserialize, Serialize};
use std::ops::Range;
use tessera_core::{Error, Result};

/// The part of a pipelined model a parameter is reached through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StagePart {
    /// Not placed by a pipeline cut: every stage holds it (a model without a
    /// `#[stage(split)]` field, or a layer used on both sides of the cut).
    Whole,
    /// Before the split field: the first stage.
    First,
    /// Layer `index` of the split field's `count` layers.
    Layer {
        /// The layer.
        index: usize,
        /// Layers of the split field.
        count: usize,
    },
    /// After the split field: the last stage.
    Last,
}

/// `whole`, `first`, `layer 3 of 8`, `last`.
impl std::fmt::Display for StagePart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StagePart::Whole => f.write_str("whole"),
            StagePart::First => f.write_str("first"),
            StagePart::Layer { index, count } => write!(f, "layer {index} of {count}"),
            StagePart::Last => f.write_str("last"),
        }
    }
}

/// How a pipeline lays a staged model over its stages: `stages` ranks along
/// the pp axis, each holding `chunks` model chunks (1 unless interleaved).
///
/// ```
/// use tessera::module::{PipelineLayout, StagePart};
///
/// // 2 stages with 2 chunks each: virtual stages 0..4 run layers 0..2, 2..4,
/// // 4..6, 6..8 and sit on stages 0, 1, 0, 1.
/// let layout = PipelineLayout::new(2, 2)?;
/// assert_eq!(layout.stage_of(StagePart::Layer { index: 5, count: 8 }), Some(0));
/// assert_eq!(layout.stage_of(StagePart::Last), Some(1));
/// // A weight tied between the first and the last part lives on both stages.
/// assert_eq!(layout.holders(&[StagePart::First, StagePart::Last]), vec![0, 1]);
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineLayout {
    stages: usize,
    chunks: usize,
}

impl PipelineLayout {
    /// `stages` stages of `chunks` chunks each (both at least 1).
    pub fn new(stages: usize, chunks: usize) -> Result<Self> {
        if stages == 0 || chunks == 0 {
            return Err(Error::schedule(
                "PipelineLayout::new",
                format!("{stages} stages of {chunks} chunks: both must be at least 1 (1 chunk unless the schedule interleaves)"),
            ));
        }
        Ok(PipelineLayout { stages, chunks })
    }

    /// Number of stages (ranks along the pp axis).
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// Model chunks per stage.
    pub fn chunks(&self) -> usize {
        self.chunks
    }

    /// Number of virtual stages: `stages · chunks`.
    pub fn virtual_stages(&self) -> usize {
        self.stages * self.chunks
    }

    /// The stage that runs `part`; `None` for [`StagePart::Whole`] (every stage).
    pub fn stage_of(&self, part: StagePart) -> Option<usize> {
        let k = match part {
            StagePart::Whole => return None,
            StagePart::First => 0,
            StagePart::Last => self.virtual_stages() - 1,
            StagePart::Layer { index, count } => virtual_stage_of_layer(index, self.virtual_stages(), count),
        };
        Some(k % self.stages)
    }

    /// The stages holding a parameter reached through `parts`, ascending
    /// (every stage when a part is [`StagePart::Whole`] or there is none).
    pub fn holders(&self, parts: &[StagePart]) -> Vec<usize> {
        let mut stages: Vec<usize> = Vec::new();
        for &part in parts {
            match self.stage_of(part) {
                Some(s) => stages.push(s),
                None => return (0..self.stages).collect(),
            }
        }
        if stages.is_empty() {
            return (0..self.stages).collect();
        }
        stages.sort_unstable();
        stages.dedup();
        stages
    }
}

/// The layers of the split field that virtual stage `k` of `virtual_stages`
/// runs: as even as possible, earlier virtual stages taking the extra layers.
pub fn layers_of(k: usize, virtual_stages: usize, layers: usize) -> Range<usize> {
    let (base, extra) = (layers / virtual_stages, layers % virtual_stages);
    let start = k * base + k.min(extra);
    start..start + base + usize::from(k < extra)
}

/// The virtual stage whose [`layers_of`] range holds `layer`.
fn virtual_stage_of_layer(layer: usize, virtual_stages: usize, layers: usize) -> usize {
    let (base, extra) = (layers / virtual_stages, layers % virtual_stages);
    let long = extra * (base + 1);
    if layer < long {
        return layer / (base + 1);
    }
    // With fewer layers than virtual stages (`base` 0) the executor refuses
    // to run the pipeline; any answer in range keeps the mapping total.
    (layer - long).checked_div(base).map_or(virtual_stages - 1, |k| extra + k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_layer_maps_to_the_virtual_stage_that_runs_it() {
        for virtual_stages in 1..7 {
            for layers in virtual_stages..20 {
                for k in 0..virtual_stages {
                    for layer in layers_of(k, virtual_stages, layers) {
                        assert_eq!(virtual_stage_of_layer(layer, virtual_stages, layers), k, "{layer} of {layers} over {virtual_stages}");
                    }
                }
            }
        }
    }
}
