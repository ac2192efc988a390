//! Which rank writes which piece, and the names of the files they write.
//!
//! Every piece of the model state is written exactly once, by the rank
//! that the rules below pick among those holding identical copies:
//!
//! - **pp**: the lowest pipeline stage holding the parameter (a weight tied
//!   between the first and the last stage is written by the first);
//! - **ep**: an expert's weights by the expert-parallel rank holding that
//!   expert; every other parameter by expert rank 0;
//! - **tp**: each tensor-parallel rank its slice of a split parameter; a
//!   parameter every tensor-parallel rank holds whole by tp rank 0;
//! - **dp**: data-parallel replicas hold the same values, so replica 0
//!   writes; with ZeRO each replica writes its own shard instead.
//!
//! The same rules serve a live save and an offline reshard, so both lay
//! files out alike.

use super::manifest::{MeshInfo, ParamRecord};
use tessera_core::Result;
use tessera_nn::module::{Cx, PipelineLayout};

/// A rank's place on the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Coords {
    pub pp: usize,
    pub dp: usize,
    pub ep: usize,
    pub tp: usize,
}

impl Coords {
    /// This rank's coordinates.
    pub fn of(cx: &Cx) -> Coords {
        let g = cx.groups();
        Coords { pp: g.pp.rank(), dp: g.dp.rank(), ep: g.ep.rank(), tp: g.tp.rank() }
    }

    /// Whether this is the rank that commits a save (every coordinate 0).
    pub fn is_root(&self) -> bool {
        *self == Coords { pp: 0, dp: 0, ep: 0, tp: 0 }
    }

    /// Every rank of `mesh`, in rank order (tp fastest).
    pub fn all(mesh: &MeshInfo) -> Vec<Coords> {
        let mut out = Vec::with_capacity(mesh.world());
        for pp in 0..mesh.pp {
            for dp in 0..mesh.dp {
                for ep in 0..mesh.ep {
                    for tp in 0..mesh.tp {
                        out.push(Coords { pp, dp, ep, tp });
                    }
                }
            }
        }
        out
    }

    /// The rank file this rank writes: `pp<p>[-dp<d>][-ep<e>]-tp<t>.safetensors`,
    /// naming dp only when replicas write their own shards (ZeRO over more
    /// than one replica) and ep only when experts are split.
    pub fn rank_file(&self, mesh: &MeshInfo, dp_shards: bool) -> String {
        let mut name = format!("pp{}", self.pp);
        if dp_shards && mesh.dp > 1 {
            name += &format!("-dp{}", self.dp);
        }
        if mesh.ep > 1 {
            name += &format!("-ep{}", self.ep);
        }
        format!("{name}-tp{}.safetensors", self.tp)
    }

    /// The file this rank's part of a save (its records, or its error) goes
    /// to before the manifest merges them all.
    pub fn part_file(&self) -> String {
        format!("part-pp{}-dp{}-ep{}-tp{}.json", self.pp, self.dp, self.ep, self.tp)
    }

    /// `pp1 dp0 ep0 tp1`, for messages.
    pub fn describe(&self) -> String {
        format!("pp{} dp{} ep{} tp{}", self.pp, self.dp, self.ep, self.tp)
    }
}

/// Whether the rank at `c` of `mesh` writes its copy of parameter `p`
/// (its pipeline stage, expert rank and tensor-parallel rank; the caller
/// applies the data-parallel rule).
pub(crate) fn writes(p: &ParamRecord, c: Coords, mesh: &MeshInfo) -> Result<bool> {
    let layout = PipelineLayout::new(mesh.pp, mesh.chunks)?;
    let stage = layout.holders(&p.stages)[0];
    let expert_rank = p.expert.map_or(0, |e| e.rank(mesh.ep));
    let tp_split = p.split_dim.is_some() && mesh.tp > 1;
    Ok(c.pp == stage && c.ep == expert_rank && (tp_split || c.tp == 0))
}
