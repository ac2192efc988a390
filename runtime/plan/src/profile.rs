//! What a cluster can do: a device's peak rates and memory, and the links
//! between its devices inside a node and between nodes.
//!
//! A profile is a TOML file (the format `tessera profile` writes, and the
//! one the shipped profiles of [`shipped`] use):
//!
//! ```toml
//! name = "h100-sxm5-80gb"
//! gpus_per_node = 8
//!
//! [device]
//! name = "NVIDIA H100 80GB HBM3"
//! memory_bytes = 85520809984
//! memory_bandwidth = 3.35e12   # bytes/s
//! [device.peak_flops]          # flop/s by dtype
//! bf16 = 989e12
//!
//! [intra_node]                 # per device, per direction
//! bandwidth = 450e9            # bytes/s
//! latency = 5e-6               # seconds per step of a collective
//!
//! [inter_node]
//! bandwidth = 50e9
//! latency = 1e-5
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tessera_core::{Error, Result};

use crate::measure::MatmulRate;

/// A cluster of identical nodes: what the planner plans for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterProfile {
    /// What the profile describes (`h100-sxm5-80gb`).
    pub name: String,
    /// Devices in one node.
    pub gpus_per_node: usize,
    /// One device.
    pub device: DeviceProfile,
    /// The link between two devices of one node.
    pub intra_node: Link,
    /// The link between devices of different nodes; none in a profile of
    /// one machine (which plans for one node only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter_node: Option<Link>,
    /// Whether a node's devices share one pool of cores (CPU ranks of one
    /// machine): a rank that waits lends its share to the others, so a
    /// pipeline's idle time mostly turns into the busy stages' speed.
    /// False for GPUs, each its own device.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ranks_share_cores: bool,
    /// Host memory of one node, in bytes: what ZeRO-Offload may fill. A
    /// profile without it plans no offload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory_bytes: Option<u64>,
}

/// One device's rates and memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceProfile {
    /// The device's name.
    pub name: String,
    /// Memory a program can use, in bytes.
    pub memory_bytes: u64,
    /// Memory bandwidth, bytes/s.
    pub memory_bandwidth: f64,
    /// Peak matrix-multiply rate by dtype (`f32`, `tf32`, `bf16`, `f16`,
    /// `fp8`), flop/s, dense.
    pub peak_flops: BTreeMap<String, f64>,
    /// Rates measured on the device by shape (`tessera profile`); empty in
    /// a profile made from datasheets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matmul: Vec<MatmulRate>,
    /// Causal attention's rate by dtype (forward and backward together),
    /// flop/s, measured; where absent, attention runs at the matrix rate.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attention_flops: BTreeMap<String, f64>,
    /// Elements per second of a transcendental element-wise function (gelu)
    /// forward and backward, measured; where absent, such functions cost
    /// only their memory traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nonlinear: Option<NonlinearRate>,
    /// Parameters per second AdamW updates (f32 state), measured; where
    /// absent, the update costs its memory traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_rate: Option<f64>,
}

/// Elements per second of a transcendental element-wise function.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NonlinearRate {
    /// Forward elements per second.
    pub forward: f64,
    /// Backward (derivative) elements per second.
    pub backward: f64,
}

/// A link as the collectives over it see it: a fixed cost per step and a
/// bandwidth (the α–β model), and where they were measured, the values
/// fitted for each group size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Bytes/s one device sends (and receives) at once.
    pub bandwidth: f64,
    /// Seconds each step of a collective costs besides its bytes.
    pub latency: f64,
    /// Measured fits by group size (`tessera profile`), which take the
    /// place of the two figures above for groups of their size.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub by_size: Vec<GroupFit>,
    /// Whether its collectives run beside compute (a GPU's copy engines and
    /// NCCL's own kernels do; CPU ranks share their cores with them, so a
    /// collective there takes its time from the step). True when absent.
    #[serde(default = "yes", skip_serializing_if = "Clone::clone")]
    pub overlaps_compute: bool,
}

fn yes() -> bool {
    true
}

/// A link's latency and bandwidth fitted to a group size's measured
/// collectives.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupFit {
    /// Devices in the group.
    pub size: usize,
    /// Bytes/s, as [`Link::bandwidth`].
    pub bandwidth: f64,
    /// Seconds per step, as [`Link::latency`].
    pub latency: f64,
}

impl Link {
    /// The (latency, bandwidth) of a group of `size`: its measured fit if
    /// the link has one, else the link's own figures.
    pub fn for_size(&self, size: usize) -> (f64, f64) {
        match self.by_size.iter().find(|f| f.size == size) {
            Some(f) => (f.latency, f.bandwidth),
            None => (self.latency, self.bandwidth),
        }
    }
}

impl ClusterProfile {
    /// Reads a profile from TOML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<ClusterProfile> {
        let profile: ClusterProfile = toml::from_str(text).map_err(|e| Error::config(origin, format!("not a cluster profile: {e}")))?;
        profile.check(origin)?;
        Ok(profile)
    }

    /// The profile as TOML, as [`parse`](Self::parse) reads it.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a profile is plain data")
    }

    /// Reads the profile file at `path`, or a shipped profile by name.
    pub fn load(path_or_name: &str) -> Result<ClusterProfile> {
        if let Some(p) = shipped().into_iter().find(|p| p.name == path_or_name) {
            return Ok(p);
        }
        let path = Path::new(path_or_name);
        let text = std::fs::read_to_string(path).map_err(|e| {
            let names: Vec<String> = shipped().into_iter().map(|p| p.name).collect();
            Error::data_file(path, format!("cannot read it ({e}); give a profile file or one of the shipped profiles: {}", names.join(", ")))
        })?;
        ClusterProfile::parse(&text, &path.display().to_string())
    }

    /// The peak rate of `dtype` matrix products, flop/s.
    pub fn peak_flops(&self, dtype: &str) -> Result<f64> {
        self.device.peak_flops.get(dtype).copied().ok_or_else(|| {
            let have: Vec<&str> = self.device.peak_flops.keys().map(String::as_str).collect();
            Error::config("device.peak_flops", format!("profile `{}` gives no rate for {dtype}; it has {}", self.name, have.join(", ")))
        })
    }

    /// The link a group of `size` devices, `stride` apart in rank order, in
    /// a job of `world` devices communicates over: inside a node when every
    /// such group fits in one, else between nodes (whose link is the slower one a collective waits
    /// for). Contiguous ranks fill a node first, and the groups of a mesh
    /// axis tile blocks of `size × stride` ranks, so they all fit when that
    /// block divides the node: groups of 6 on nodes of 8 do not (ranks 6
    /// to 11 span two).
    /// An error when the group spans nodes and the profile has no link
    /// between them.
    pub fn link(&self, size: usize, stride: usize, world: usize) -> Result<&Link> {
        if size <= 1 || world <= self.gpus_per_node || self.gpus_per_node.is_multiple_of(size * stride.max(1)) {
            return Ok(&self.intra_node);
        }
        self.inter_node.as_ref().ok_or_else(|| {
            Error::config(
                "inter_node",
                format!(
                    "a group of {size} devices {stride} apart spans nodes of {}, and profile `{}` has no link between nodes; plan for one node, or add [inter_node] to the profile",
                    self.gpus_per_node, self.name
                ),
            )
        })
    }

    fn check(&self, origin: &str) -> Result<()> {
        let bad = |key: &str, detail: String| Err(Error::config(format!("{origin}: {key}"), detail));
        if self.gpus_per_node == 0 {
            return bad("gpus_per_node", "is 0; a node has at least one device".into());
        }
        if self.device.memory_bytes == 0 {
            return bad("device.memory_bytes", "is 0; give the memory a program can use, in bytes".into());
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.device.memory_bandwidth) {
            return bad("device.memory_bandwidth", format!("is {}; give bytes/s, above 0", self.device.memory_bandwidth));
        }
        if self.device.peak_flops.is_empty() {
            return bad("device.peak_flops", "is empty; give at least one dtype's rate (bf16 = 989e12)".into());
        }
        for (dtype, &rate) in &self.device.peak_flops {
            if !positive(rate) {
                return bad(&format!("device.peak_flops.{dtype}"), format!("is {rate}; give flop/s, above 0"));
            }
        }
        for (i, r) in self.device.matmul.iter().enumerate() {
            if r.m == 0 || r.n == 0 || r.k == 0 || !positive(r.flops) {
                return bad(&format!("device.matmul[{i}]"), format!("is {r:?}; give sizes and a rate above 0"));
            }
        }
        for (key, link) in [("intra_node", Some(&self.intra_node)), ("inter_node", self.inter_node.as_ref())] {
            let Some(link) = link else { continue };
            let fits = link.by_size.iter().enumerate().map(|(i, f)| (format!("{key}.by_size[{i}]."), f.bandwidth, f.latency, f.size));
            for (at, bandwidth, latency, size) in std::iter::once((format!("{key}."), link.bandwidth, link.latency, 2)).chain(fits) {
                if !positive(bandwidth) {
                    return bad(&format!("{at}bandwidth"), format!("is {bandwidth}; give bytes/s, above 0"));
                }
                if !(latency.is_finite() && latency >= 0.0) {
                    return bad(&format!("{at}latency"), format!("is {latency}; give seconds, 0 or more"));
                }
                if size < 2 {
                    return bad(&format!("{at}size"), format!("is {size}; a group that communicates has at least 2 devices"));
                }
            }
        }
        Ok(())
    }
}

/// The profiles that ship with Tessera, for clusters that are not here to
/// measure: 8-GPU A100, H100 and H200 nodes from the vendors' public
/// figures (each file names its sources).
pub fn shipped() -> Vec<ClusterProfile> {
    SHIPPED.iter().map(|(name, text)| ClusterProfile::parse(text, name).unwrap_or_else(|e| panic!("the shipped profile {name} is broken: {e}"))).collect()
}

const SHIPPED: &[(&str, &str)] = &[
    ("profiles/a100-sxm4-80gb.toml", include_str!("../profiles/a100-sxm4-80gb.toml")),
    ("profiles/h100-sxm5-80gb.toml", include_str!("../profiles/h100-sxm5-80gb.toml")),
    ("profiles/h200-sxm-141gb.toml", include_str!("../profiles/h200-sxm-141gb.toml")),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_profiles_parse_and_say_what_their_datasheets_say() {
        let all = shipped();
        assert_eq!(all.len(), 3);
        let h100 = ClusterProfile::load("h100-sxm5-80gb").unwrap();
        assert_eq!(h100.peak_flops("bf16").unwrap(), 989e12);
        assert_eq!(h100.gpus_per_node, 8);
        let h200 = ClusterProfile::load("h200-sxm-141gb").unwrap();
        assert_eq!(h200.device.peak_flops, h100.device.peak_flops, "the H200 has the H100's compute");
        assert!(h200.device.memory_bandwidth > h100.device.memory_bandwidth && h200.device.memory_bytes > h100.device.memory_bytes);
        let a100 = ClusterProfile::load("a100-sxm4-80gb").unwrap();
        assert_eq!(a100.peak_flops("bf16").unwrap(), 312e12);
        assert!(a100.peak_flops("fp8").unwrap_err().to_string().contains("no rate for fp8"));
        for p in &all {
            assert!(p.intra_node.bandwidth > p.inter_node.as_ref().unwrap().bandwidth, "{}", p.name);
        }
    }

    #[test]
    fn a_bad_profile_is_refused_naming_the_key() {
        let good = include_str!("../profiles/h100-sxm5-80gb.toml");
        let cases = [
            (good.replace("gpus_per_node = 8", "gpus_per_node = 0"), "gpus_per_node"),
            (good.replace("bandwidth = 450e9", "bandwidth = -1.0"), "intra_node.bandwidth"),
            (good.replace("latency = 1e-5", "latency = nan"), "inter_node.latency"),
            (good.replace("bf16 = 989e12", "bf16 = 0.0"), "device.peak_flops.bf16"),
            (good.replace("memory_bandwidth = 3.35e12", "memory_bandwidth = \"fast\""), "memory_bandwidth"),
            (good.replace("gpus_per_node = 8", "gpus_per_node = 8\ngpus = 8"), "gpus"),
            (good.replace("[inter_node]", "[between_nodes]"), "between_nodes"),
        ];
        for (text, key) in cases {
            let e = ClusterProfile::parse(&text, "test.toml").unwrap_err().to_string();
            assert!(e.contains(key), "expected {key} in: {e}");
        }
        let e = ClusterProfile::load("/nonexistent/profile.toml").unwrap_err().to_string();
        assert!(e.contains("h100-sxm5-80gb") && e.contains("/nonexistent/profile.toml"), "{e}");
    }

    #[test]
    fn a_profile_with_measured_rates_round_trips_through_toml() {
        let mut p = ClusterProfile::load("a100-sxm4-80gb").unwrap();
        p.device.matmul.push(MatmulRate { m: 4096, n: 4096, k: 4096, dtype: "bf16".into(), flops: 2.71e14 });
        p.intra_node.by_size.push(GroupFit { size: 4, bandwidth: 2.2e11, latency: 7e-6 });
        let back = ClusterProfile::parse(&p.to_toml(), "round trip").unwrap();
        assert_eq!(back, p);
        assert_eq!(back.intra_node.for_size(4), (7e-6, 2.2e11));
        assert_eq!(back.intra_node.for_size(8), (back.intra_node.latency, back.intra_node.bandwidth));
        let mut bad = p.clone();
        bad.intra_node.by_size[0].size = 1;
        assert!(ClusterProfile::parse(&bad.to_toml(), "t").unwrap_err().to_string().contains("intra_node.by_size[0].size"));
        let mut bad = p.clone();
        bad.device.matmul[0].flops = 0.0;
        assert!(ClusterProfile::parse(&bad.to_toml(), "t").unwrap_err().to_string().contains("device.matmul[0]"));
    }

    #[test]
    fn a_group_that_fits_in_a_node_uses_its_links() {
        let p = ClusterProfile::load("h100-sxm5-80gb").unwrap();
        let inter = p.inter_node.as_ref();
        assert_eq!(p.link(1, 1, 64).ok(), Some(&p.intra_node));
        assert_eq!(p.link(8, 1, 64).ok(), Some(&p.intra_node));
        assert_eq!(p.link(2, 4, 64).ok(), Some(&p.intra_node), "ranks 0 and 4 share a node");
        assert_eq!(p.link(2, 8, 64).ok(), inter, "ranks 0 and 8 do not");
        assert_eq!(p.link(16, 1, 64).ok(), inter);
        assert_eq!(p.link(6, 1, 64).ok(), inter, "ranks 6 to 11 span two nodes");
        assert_eq!(p.link(3, 2, 64).ok(), inter, "ranks 1, 3, 5 share a node, 7, 9, 11 do not");
        assert_eq!(p.link(6, 1, 6).ok(), Some(&p.intra_node), "a job of one node never leaves it");
        let one_machine = ClusterProfile { inter_node: None, ..p.clone() };
        assert!(one_machine.link(16, 1, 16).unwrap_err().to_string().contains("no link between nodes"));
        assert_eq!(ClusterProfile::parse(&one_machine.to_toml(), "t").unwrap(), one_machine);
    }
}
