//! The device mesh: named parallel axes and the groups of ranks along them.
//!
//! A [`Mesh`] lays the world's ranks out on a grid with one axis per kind of
//! parallelism. Ranks are numbered with the axes nested, from the
//! slowest-varying to the fastest:
//!
//! ```text
//! rank = (((pp · DP + dp) · CP + cp) · EP + ep) · TP + tp
//! ```
//!
//! **tp varies fastest** so that a tensor-parallel group is a run of
//! contiguous ranks, and launchers number the ranks of one node contiguously:
//! TP's collectives run on every layer, in the critical path, and must stay
//! on the node's fast links. **ep** comes next because its all-to-all also
//! runs on every MoE layer. **cp** (context parallelism) is next: its ring
//! passes key/value blocks between neighbours on every attention layer,
//! point to point and overlapped with the blocks' attention, which tolerates
//! a slower link than an all-to-all. **dp** follows: its gradient all-reduce
//! runs once per step and overlaps the backward. **pp** is slowest: it only sends one
//! activation per microbatch between neighbours, which tolerates the slower
//! network between nodes best. This is the order Megatron uses (tp fastest,
//! pp slowest).
//!
//! Context-parallel ranks hold the same parameters and see different tokens
//! of the same sequences, so for the gradients they are data replicas like
//! any other: the data-parallel groups ([`Mesh::data_group`]) and the
//! replica groups ([`Mesh::replica_group`]) span dp × cp, which is why cp
//! sits next to dp.
//!
//! Adding an axis means adding a variant to [`Axis`] and placing it in
//! [`Axis::ALL`]; everything else is generic.
//!
//! ```
//! use tessera::dist::mesh::{Axis, Mesh};
//!
//! // 16 ranks on two nodes of 8: pp2 × dp2 × tp4.
//! let mesh = Mesh::parse("dp2,tp4,pp2", 16, 8)?;
//! assert_eq!(mesh.group(Axis::Tp, 5)?, vec![4, 5, 6, 7]);
//! assert_eq!(mesh.group(Axis::Dp, 5)?, vec![1, 5]);
//! assert_eq!(mesh.group(Axis::Pp, 5)?, vec![5, 13]);
//! assert!(mesh.warnings().is_empty());
//! # Ok::<(), tessera::Error>(())
//! ```

use std::fmt;
use std::ops::{Index, IndexMut};
use std::str::FromStr;
use tessera_core::{Error, Result};

/// A named axis of the mesh: one kind of parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Axis {
    /// Pipeline parallelism: the model's layers split into stages.
    Pp,
    /// Data parallelism: replicas that see different data.
    Dp,
    /// Context parallelism: each sequence split over ranks, attention
    /// passing key/value blocks around their ring.
    Cp,
    /// Expert parallelism: the experts of MoE layers split over ranks.
    Ep,
    /// Tensor parallelism: each layer's weights split over ranks.
    Tp,
}

impl Axis {
    /// Every axis, from the slowest-varying in the rank numbering to the fastest.
    pub const ALL: [Axis; 5] = [Axis::Pp, Axis::Dp, Axis::Cp, Axis::Ep, Axis::Tp];

    /// Number of axes.
    pub const COUNT: usize = Self::ALL.len();

    /// The axis's short name, as written in a mesh spec (`"tp"`).
    pub fn name(self) -> &'static str {
        match self {
            Axis::Pp => "pp",
            Axis::Dp => "dp",
            Axis::Cp => "cp",
            Axis::Ep => "ep",
            Axis::Tp => "tp",
        }
    }

    /// Whether the axis communicates on every layer (tp's collectives, ep's
    /// all-to-all, cp's ring), so that its groups belong on one node.
    pub fn is_communication_heavy(self) -> bool {
        matches!(self, Axis::Tp | Axis::Ep | Axis::Cp)
    }

    /// The position in [`Axis::ALL`].
    fn index(self) -> usize {
        Self::ALL.iter().position(|&a| a == self).expect("every axis is listed in Axis::ALL")
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Axis {
    type Err = Error;

    fn from_str(s: &str) -> Result<Axis> {
        Axis::ALL
            .into_iter()
            .find(|a| a.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::topology("Axis::from_str", format!("unknown axis `{s}`; the axes are {}", axis_list())))
    }
}

/// "pp, dp, cp, ep, tp": for error messages.
fn axis_list() -> String {
    Axis::ALL.map(Axis::name).join(", ")
}

/// The degree (number of ranks) along every axis; axes not set are 1.
///
/// ```
/// use tessera::dist::mesh::{Axis, Degrees};
///
/// let d = Degrees::new().with(Axis::Dp, 2).with(Axis::Tp, 4);
/// assert_eq!(d, "dp2,tp4".parse()?);
/// assert_eq!(d[Axis::Pp], 1);
/// # Ok::<(), tessera::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Degrees([usize; Axis::COUNT]);

impl Default for Degrees {
    fn default() -> Self {
        Degrees([1; Axis::COUNT])
    }
}

impl Degrees {
    /// Every axis of degree 1 (a single rank).
    pub fn new() -> Self {
        Self::default()
    }

    /// The same degrees with `axis` set to `degree`.
    pub fn with(mut self, axis: Axis, degree: usize) -> Self {
        self.0[axis.index()] = degree;
        self
    }

    /// The degree of `axis`.
    pub fn get(&self, axis: Axis) -> usize {
        self.0[axis.index()]
    }

    /// The number of ranks these degrees need, or `None` if it overflows.
    pub fn product(&self) -> Option<usize> {
        self.0.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// Parses a compact spec such as `"dp2,tp4,pp2"` (also `"dp=2 tp=4"`):
    /// axes in any order, separated by commas or spaces; axes left out are 1.
    pub fn parse(spec: &str) -> Result<Degrees> {
        const OP: &str = "Degrees::parse";
        let mut degrees = Degrees::new();
        let mut seen = [false; Axis::COUNT];
        for item in spec.split(|c: char| c == ',' || c.is_whitespace()).filter(|s| !s.is_empty()) {
            let split = item.find(|c: char| !c.is_ascii_alphabetic()).unwrap_or(item.len());
            let (name, rest) = item.split_at(split);
            let axis: Axis =
                name.parse().map_err(|_| Error::topology(OP, format!("unknown axis `{name}` in `{item}` of `{spec}`; the axes are {}", axis_list())))?;
            let number = rest.strip_prefix(['=', ':']).unwrap_or(rest);
            let degree: usize = number
                .parse()
                .map_err(|_| Error::topology(OP, format!("`{item}` in `{spec}` has no valid degree; write the axis and its degree, as in `{axis}4`")))?;
            if std::mem::replace(&mut seen[axis.index()], true) {
                return Err(Error::topology(OP, format!("`{axis}` is given twice in `{spec}`; give each axis once")));
            }
            degrees = degrees.with(axis, degree);
        }
        Ok(degrees)
    }

    /// "pp(2) * dp(2) * cp(1) * ep(1) * tp(4)": every factor, for error messages.
    fn factors(&self) -> String {
        Axis::ALL.map(|a| format!("{a}({})", self.get(a))).join(" * ")
    }
}

impl Index<Axis> for Degrees {
    type Output = usize;
    fn index(&self, axis: Axis) -> &usize {
        &self.0[axis.index()]
    }
}

impl FromStr for Degrees {
    type Err = Error;
    fn from_str(s: &str) -> Result<Degrees> {
        Degrees::parse(s)
    }
}

/// Written as a spec that [`Degrees::parse`] reads back: `pp2,dp2,cp1,ep1,tp4`.
impl fmt::Display for Degrees {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&Axis::ALL.map(|a| format!("{a}{}", self.get(a))).join(","))
    }
}

/// A rank's position along every axis.
///
/// ```
/// use tessera::dist::mesh::{Axis, Coords};
///
/// let c = Coords::new().with(Axis::Dp, 1).with(Axis::Tp, 3);
/// assert_eq!((c[Axis::Dp], c[Axis::Tp], c[Axis::Pp]), (1, 3, 0));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Coords([usize; Axis::COUNT]);

impl Coords {
    /// The origin: coordinate 0 on every axis.
    pub fn new() -> Self {
        Self::default()
    }

    /// The same coordinates with `axis` set to `coord`.
    pub fn with(mut self, axis: Axis, coord: usize) -> Self {
        self.0[axis.index()] = coord;
        self
    }

    /// The coordinate along `axis`.
    pub fn get(&self, axis: Axis) -> usize {
        self.0[axis.index()]
    }
}

impl Index<Axis> for Coords {
    type Output = usize;
    fn index(&self, axis: Axis) -> &usize {
        &self.0[axis.index()]
    }
}

impl IndexMut<Axis> for Coords {
    fn index_mut(&mut self, axis: Axis) -> &mut usize {
        &mut self.0[axis.index()]
    }
}

/// Written as `(pp 0, dp 1, cp 0, ep 0, tp 3)`.
impl fmt::Display for Coords {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({})", Axis::ALL.map(|a| format!("{a} {}", self.get(a))).join(", "))
    }
}

/// The world's ranks on a grid of parallel axes, and the nodes they run on.
///
/// Ranks `n·ranks_per_node .. (n+1)·ranks_per_node` are on node `n`, the
/// numbering every launcher uses. See the [module documentation](self) for
/// the order of the axes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    degrees: Degrees,
    world: usize,
    ranks_per_node: usize,
}

impl Mesh {
    /// A mesh of `degrees` over a world of `world` ranks, `ranks_per_node` to a node.
    ///
    /// Fails, naming every factor, unless every degree is at least 1 and their
    /// product is `world`.
    ///
    /// ```
    /// use tessera::dist::mesh::{Degrees, Mesh};
    ///
    /// let err = Mesh::new("dp2,pp2,tp4".parse()?, 8, 8).unwrap_err();
    /// assert!(err.to_string().contains("pp(2) * dp(2) * cp(1) * ep(1) * tp(4) = 16, but the world has 8 ranks"));
    /// # Ok::<(), tessera::Error>(())
    /// ```
    pub fn new(degrees: Degrees, world: usize, ranks_per_node: usize) -> Result<Mesh> {
        const OP: &str = "Mesh::new";
        if world == 0 {
            return Err(Error::topology(OP, "the world has 0 ranks; a mesh needs at least one rank"));
        }
        if ranks_per_node == 0 {
            return Err(Error::topology(OP, "ranks_per_node is 0; give the number of ranks (devices) on each node, at least 1"));
        }
        let zero: Vec<String> = Axis::ALL.iter().filter(|&&a| degrees.get(a) == 0).map(|a| a.to_string()).collect();
        if !zero.is_empty() {
            return Err(Error::topology(
                OP,
                format!("{} has degree 0 in {}; every axis needs degree at least 1 (1 leaves it unused)", zero.join(" and "), degrees.factors()),
            ));
        }
        match degrees.product() {
            Some(n) if n == world => Ok(Mesh { degrees, world, ranks_per_node }),
            Some(n) => {
                Err(Error::topology(OP, format!("{} = {n}, but the world has {world} ranks; choose degrees whose product is {world}", degrees.factors())))
            }
            None => {
                Err(Error::topology(OP, format!("{} overflows, but the world has {world} ranks; choose degrees whose product is {world}", degrees.factors())))
            }
        }
    }

    /// A mesh from a compact spec such as `"dp2,tp4,pp2"`; see [`Degrees::parse`].
    pub fn parse(spec: &str, world: usize, ranks_per_node: usize) -> Result<Mesh> {
        Mesh::new(Degrees::parse(spec)?, world, ranks_per_node)
    }

    /// The mesh of a single rank: every axis of degree 1.
    pub fn single() -> Mesh {
        Mesh { degrees: Degrees::new(), world: 1, ranks_per_node: 1 }
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Ranks on each node.
    pub fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }

    /// Number of nodes the world occupies (the last one may be partly used).
    pub fn nodes(&self) -> usize {
        self.world.div_ceil(self.ranks_per_node)
    }

    /// The degree of every axis.
    pub fn degrees(&self) -> Degrees {
        self.degrees
    }

    /// The degree of `axis`: the size of each of its groups.
    pub fn size(&self, axis: Axis) -> usize {
        self.degrees.get(axis)
    }

    /// How far apart in rank numbers two neighbours along `axis` are: the
    /// product of the degrees of the faster axes (1 for tp).
    pub fn stride(&self, axis: Axis) -> usize {
        Axis::ALL[axis.index() + 1..].iter().map(|&a| self.size(a)).product()
    }

    /// The coordinates of `rank`.
    ///
    /// ```
    /// use tessera::dist::mesh::{Axis, Mesh};
    ///
    /// let mesh = Mesh::parse("pp2,dp2,tp2", 8, 8)?;
    /// let c = mesh.coords(6)?;
    /// assert_eq!((c[Axis::Pp], c[Axis::Dp], c[Axis::Tp]), (1, 1, 0));
    /// assert_eq!(mesh.rank_of(c)?, 6);
    /// # Ok::<(), tessera::Error>(())
    /// ```
    pub fn coords(&self, rank: usize) -> Result<Coords> {
        self.check_rank("Mesh::coords", rank)?;
        let mut coords = Coords::new();
        let mut rest = rank;
        for &axis in Axis::ALL.iter().rev() {
            coords[axis] = rest % self.size(axis);
            rest /= self.size(axis);
        }
        Ok(coords)
    }

    /// The rank at `coords`; fails if a coordinate is outside its axis.
    pub fn rank_of(&self, coords: Coords) -> Result<usize> {
        let mut rank = 0;
        for axis in Axis::ALL {
            let (c, n) = (coords[axis], self.size(axis));
            if c >= n {
                return Err(Error::no_such_rank(
                    "Mesh::rank_of",
                    format!("coordinate {axis} {c} of {coords} is outside the axis, whose degree is {n}; use 0..{n}"),
                ));
            }
            rank = rank * n + c;
        }
        Ok(rank)
    }

    /// The group of `rank` along `axis`: the ranks that share all its other
    /// coordinates, ordered by their coordinate on `axis` (so a rank's index
    /// in the group is its coordinate).
    pub fn group(&self, axis: Axis, rank: usize) -> Result<Vec<usize>> {
        let coord = self.coords(rank)?[axis];
        let stride = self.stride(axis);
        let first = rank - coord * stride;
        Ok((0..self.size(axis)).map(|i| first + i * stride).collect())
    }

    /// Every group along `axis`, ordered by their first rank: disjoint, and
    /// together covering the world.
    ///
    /// ```
    /// use tessera::dist::mesh::{Axis, Mesh};
    ///
    /// let mesh = Mesh::parse("dp2,tp2", 4, 4)?;
    /// assert_eq!(mesh.groups(Axis::Tp), vec![vec![0, 1], vec![2, 3]]);
    /// assert_eq!(mesh.groups(Axis::Dp), vec![vec![0, 2], vec![1, 3]]);
    /// # Ok::<(), tessera::Error>(())
    /// ```
    pub fn groups(&self, axis: Axis) -> Vec<Vec<usize>> {
        let (stride, size) = (self.stride(axis), self.size(axis));
        // A group's first rank has coordinate 0 on `axis`: within each block of
        // `stride · size` ranks, the first `stride` ranks.
        (0..self.world).filter(|r| (r / stride) % size == 0).map(|first| (0..size).map(|i| first + i * stride).collect()).collect()
    }

    /// The data-parallel group of `rank`: the ranks that hold the same
    /// parameters (pipeline stage, tensor shard and experts) over the data-
    /// and context-parallel axes together (`dp × cp` ranks), ordered by
    /// `d · CP + c`. Context-parallel ranks see other tokens of the same
    /// sequences, so for the gradients they are replicas: the experts'
    /// gradients are averaged, and ZeRO shards the optimizer, over this
    /// group. It is the dp axis's group when cp is 1.
    ///
    /// ```
    /// use tessera::dist::mesh::Mesh;
    ///
    /// let mesh = Mesh::parse("dp2,cp2,tp2", 8, 8)?;
    /// assert_eq!(mesh.data_group(3)?, vec![1, 3, 5, 7]);
    /// # Ok::<(), tessera::Error>(())
    /// ```
    pub fn data_group(&self, rank: usize) -> Result<Vec<usize>> {
        self.run_group(rank, &[Axis::Dp, Axis::Cp])
    }

    /// The data replicas `rank` belongs to: the ranks that hold the same
    /// pipeline stage and tensor shard, over the data-, context- and
    /// expert-parallel axes together (`dp × cp × ep` ranks), ordered by
    /// replica index `(d · CP + c) · EP + e`. Gradients of parameters that
    /// every replica holds (all but the experts) are summed over this group.
    ///
    /// ```
    /// use tessera::dist::mesh::Mesh;
    ///
    /// let mesh = Mesh::parse("dp2,ep2,tp2", 8, 8)?;
    /// assert_eq!(mesh.replica_group(3)?, vec![1, 3, 5, 7]);
    /// # Ok::<(), tessera::Error>(())
    /// ```
    pub fn replica_group(&self, rank: usize) -> Result<Vec<usize>> {
        self.run_group(rank, &[Axis::Dp, Axis::Cp, Axis::Ep])
    }

    /// The group of `rank` over `axes`, which must be adjacent in
    /// [`Axis::ALL`] (slowest first): together they step by the fastest's
    /// stride, one run of evenly spaced ranks, ordered by the coordinates
    /// with the slowest axis first.
    fn run_group(&self, rank: usize, axes: &[Axis]) -> Result<Vec<usize>> {
        let c = self.coords(rank)?;
        let fastest = *axes.last().expect("at least one axis");
        let stride = self.stride(fastest);
        let index = axes.iter().fold(0, |acc, &a| acc * self.size(a) + c[a]);
        let first = rank - index * stride;
        let count: usize = axes.iter().map(|&a| self.size(a)).product();
        Ok((0..count).map(|i| first + i * stride).collect())
    }

    /// Every data-parallel group (see [`data_group`](Self::data_group)),
    /// ordered by their first rank: disjoint, and together covering the world.
    pub fn data_groups(&self) -> Vec<Vec<usize>> {
        (0..self.world).filter_map(|r| self.data_group(r).ok().filter(|g| g[0] == r)).collect()
    }

    /// Every replica group (see [`replica_group`](Self::replica_group)),
    /// ordered by their first rank: disjoint, and together covering the world.
    pub fn replica_groups(&self) -> Vec<Vec<usize>> {
        (0..self.world).filter_map(|r| self.replica_group(r).ok().filter(|g| g[0] == r)).collect()
    }

    /// The node `rank` runs on.
    pub fn node_of(&self, rank: usize) -> Result<usize> {
        self.check_rank("Mesh::node_of", rank)?;
        Ok(rank / self.ranks_per_node)
    }

    /// Layout problems worth telling the user about, one sentence each: a
    /// communication-heavy axis (tp, ep) whose groups span nodes.
    ///
    /// ```
    /// use tessera::dist::mesh::Mesh;
    ///
    /// let mesh = Mesh::parse("tp8", 8, 4)?;
    /// assert_eq!(
    ///     mesh.warnings(),
    ///     ["tp=8 spans 2 nodes of 4 ranks: its collectives run on every layer and would cross the network between nodes; keep tp ≤ ranks per node (4)"]
    /// );
    /// # Ok::<(), tessera::Error>(())
    /// ```
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for axis in Axis::ALL.into_iter().filter(|a| a.is_communication_heavy() && self.size(*a) > 1) {
            let spanned = self.groups(axis).iter().map(|g| self.nodes_spanned(g)).max().unwrap_or(1);
            if spanned <= 1 {
                continue;
            }
            let (size, per_node) = (self.size(axis), self.ranks_per_node);
            // A group occupies `size · stride` consecutive ranks: the axis and
            // every faster one must fit on a node together.
            let inner: Vec<Axis> = Axis::ALL[axis.index()..].iter().copied().filter(|&a| a == axis || self.size(a) > 1).collect();
            let footprint: usize = inner.iter().map(|&a| self.size(a)).product();
            let names = inner.iter().map(|a| a.name()).collect::<Vec<_>>().join("·");
            let why = match axis {
                Axis::Tp => "its collectives run on every layer",
                Axis::Cp => "its ring passes keys and values on every attention layer",
                _ => "its all-to-all runs on every MoE layer",
            };
            let fix = if footprint <= per_node {
                format!("choose {names} dividing the ranks per node ({per_node})")
            } else {
                format!("keep {names} ≤ ranks per node ({per_node})")
            };
            let what = if names == axis.name() { format!("{axis}={size}") } else { format!("{axis}={size} (with {names}={footprint})") };
            out.push(format!("{what} spans {spanned} nodes of {per_node} ranks: {why} and would cross the network between nodes; {fix}"));
        }
        out
    }

    /// Number of distinct nodes `ranks` run on.
    fn nodes_spanned(&self, ranks: &[usize]) -> usize {
        let mut nodes: Vec<usize> = ranks.iter().map(|r| r / self.ranks_per_node).collect();
        nodes.dedup(); // groups are sorted, so equal nodes are adjacent
        nodes.len()
    }

    fn check_rank(&self, op: &'static str, rank: usize) -> Result<()> {
        if rank >= self.world {
            return Err(Error::no_such_rank(op, format!("rank {rank} is outside the world of {} ranks; use 0..{}", self.world, self.world)));
        }
        Ok(())
    }
}

/// Written as `pp2,dp2,cp1,ep1,tp4 (16 ranks, 8 per node)`.
impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({} ranks, {} per node)", self.degrees, self.world, self.ranks_per_node)
    }
}
