//! The device mesh: the rank numbering (tp fastest), groups along every
//! axis, up-front validation with every factor named, topology warnings and
//! the compact spec.

use tessera::dist::mesh::{Axis, Coords, Degrees, Mesh};

/// Meshes of several shapes, with the ranks per node each is tried on.
fn meshes() -> Vec<Mesh> {
    let specs = [
        ("", 1, 1),
        ("tp2", 2, 2),
        ("dp2,tp2", 4, 4),
        ("pp2,dp2,tp2", 8, 4),
        ("pp2,dp3,ep2,tp2", 24, 8),
        ("dp4,ep2", 8, 8),
        ("pp3,tp4", 12, 4),
        ("pp2,dp2,ep2,tp4", 32, 8),
        ("dp2,cp2,tp2", 8, 8),
        ("pp2,dp3,cp2,ep2,tp2", 48, 8),
        ("cp4", 4, 4),
    ];
    specs.iter().map(|&(spec, world, per_node)| Mesh::parse(spec, world, per_node).unwrap()).collect()
}

#[test]
fn ranks_are_numbered_pp_dp_ep_tp_with_tp_fastest() {
    let mesh = Mesh::parse("pp2,dp3,ep2,tp2", 24, 8).unwrap();
    for rank in 0..mesh.world() {
        let c = mesh.coords(rank).unwrap();
        let expected = ((c[Axis::Pp] * 3 + c[Axis::Dp]) * 2 + c[Axis::Ep]) * 2 + c[Axis::Tp];
        assert_eq!(rank, expected, "rank {rank} at {c}");
    }
    assert_eq!(mesh.coords(1).unwrap(), Coords::new().with(Axis::Tp, 1));
    assert_eq!(mesh.coords(2).unwrap(), Coords::new().with(Axis::Ep, 1));
    assert_eq!(mesh.coords(4).unwrap(), Coords::new().with(Axis::Dp, 1));
    assert_eq!(mesh.coords(12).unwrap(), Coords::new().with(Axis::Pp, 1));
    assert_eq!([Axis::Pp, Axis::Dp, Axis::Ep, Axis::Tp].map(|a| mesh.stride(a)), [12, 4, 2, 1]);
}

#[test]
fn coords_and_rank_of_are_inverse() {
    for mesh in meshes() {
        let mut seen = std::collections::HashSet::new();
        for rank in 0..mesh.world() {
            let c = mesh.coords(rank).unwrap();
            for axis in Axis::ALL {
                assert!(c[axis] < mesh.size(axis));
            }
            assert!(seen.insert(c), "{mesh}: two ranks at {c}");
            assert_eq!(mesh.rank_of(c).unwrap(), rank, "{mesh}");
        }
    }
}

#[test]
fn a_group_shares_every_other_coordinate_and_is_ordered_by_its_own() {
    for mesh in meshes() {
        for axis in Axis::ALL {
            for rank in 0..mesh.world() {
                let group = mesh.group(axis, rank).unwrap();
                let me = mesh.coords(rank).unwrap();
                assert_eq!(group.len(), mesh.size(axis), "{mesh} {axis}");
                assert_eq!(group[me[axis]], rank, "{mesh} {axis}: a rank's index in its group is its coordinate");
                for (i, &r) in group.iter().enumerate() {
                    let c = mesh.coords(r).unwrap();
                    assert_eq!(c[axis], i, "{mesh} {axis}");
                    for other in Axis::ALL.into_iter().filter(|&o| o != axis) {
                        assert_eq!(c[other], me[other], "{mesh} {axis}: rank {r} differs from {rank} on {other}");
                    }
                }
            }
        }
    }
}

#[test]
fn groups_partition_the_world() {
    for mesh in meshes() {
        for axis in Axis::ALL {
            let groups = mesh.groups(axis);
            assert_eq!(groups.len(), mesh.world() / mesh.size(axis), "{mesh} {axis}");
            let mut all: Vec<usize> = groups.iter().flatten().copied().collect();
            all.sort();
            assert_eq!(all, (0..mesh.world()).collect::<Vec<_>>(), "{mesh} {axis}: disjoint and covering");
            for g in &groups {
                assert_eq!(&mesh.group(axis, g[0]).unwrap(), g, "{mesh} {axis}");
            }
            assert!(groups.windows(2).all(|w| w[0][0] < w[1][0]), "{mesh} {axis}: ordered by first rank");
        }
    }
}

/// The data replicas (dp × cp × ep together): the ranks of one pipeline
/// stage and tensor shard, a rank's index among them its replica index
/// (d·CP + c)·EP + e, and the groups partition the world. The data-parallel
/// groups (dp × cp) likewise, over the ranks that also share their experts.
#[test]
fn replica_groups_span_dp_cp_and_ep_and_partition_the_world() {
    for mesh in meshes() {
        let (dp, cp, ep) = (mesh.size(Axis::Dp), mesh.size(Axis::Cp), mesh.size(Axis::Ep));
        let mut seen = vec![0; mesh.world()];
        for group in mesh.data_groups() {
            assert_eq!(group.len(), dp * cp, "{mesh}");
            for &r in &group {
                seen[r] += 1;
                assert_eq!(mesh.data_group(r).unwrap(), group, "{mesh}: rank {r}");
                let (c, first) = (mesh.coords(r).unwrap(), mesh.coords(group[0]).unwrap());
                assert_eq!((c[Axis::Pp], c[Axis::Ep], c[Axis::Tp]), (first[Axis::Pp], first[Axis::Ep], first[Axis::Tp]), "{mesh}: rank {r} in {group:?}");
                let index = group.iter().position(|&m| m == r).unwrap();
                assert_eq!(index, c[Axis::Dp] * cp + c[Axis::Cp], "{mesh}: rank {r} in {group:?}");
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{mesh}: {seen:?}");
        let mut seen = vec![0; mesh.world()];
        for group in mesh.replica_groups() {
            assert_eq!(group.len(), dp * cp * ep, "{mesh}");
            for &r in &group {
                seen[r] += 1;
                assert_eq!(mesh.replica_group(r).unwrap(), group, "{mesh}: rank {r}");
                let (c, first) = (mesh.coords(r).unwrap(), mesh.coords(group[0]).unwrap());
                assert_eq!((c[Axis::Pp], c[Axis::Tp]), (first[Axis::Pp], first[Axis::Tp]), "{mesh}: rank {r} in {group:?}");
                let index = group.iter().position(|&m| m == r).unwrap();
                assert_eq!(index, (c[Axis::Dp] * cp + c[Axis::Cp]) * ep + c[Axis::Ep], "{mesh}: rank {r} in {group:?}");
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{mesh}: {seen:?}");
    }
}

#[test]
fn tp_groups_are_contiguous_ranks() {
    let mesh = Mesh::parse("pp2,dp2,tp4", 16, 8).unwrap();
    assert_eq!(mesh.groups(Axis::Tp), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9, 10, 11], vec![12, 13, 14, 15]]);
    assert_eq!(mesh.group(Axis::Dp, 6).unwrap(), vec![2, 6]);
    assert_eq!(mesh.group(Axis::Pp, 6).unwrap(), vec![6, 14]);
    assert_eq!(mesh.group(Axis::Ep, 6).unwrap(), vec![6]);
}

#[test]
fn nodes_are_runs_of_ranks() {
    let mesh = Mesh::parse("dp3,tp2", 6, 4).unwrap();
    assert_eq!(mesh.nodes(), 2);
    assert_eq!((0..6).map(|r| mesh.node_of(r).unwrap()).collect::<Vec<_>>(), [0, 0, 0, 0, 1, 1]);
    assert!(mesh.node_of(6).is_err());
}

#[test]
fn a_wrong_product_names_every_factor() {
    let err = Mesh::parse("dp2,pp2,tp4", 8, 8).unwrap_err().to_string();
    assert!(err.contains("pp(2) * dp(2) * cp(1) * ep(1) * tp(4) = 16, but the world has 8 ranks; choose degrees whose product is 8"), "{err}");
    let err = Mesh::parse("tp3", 4, 4).unwrap_err().to_string();
    assert!(err.contains("pp(1) * dp(1) * cp(1) * ep(1) * tp(3) = 3, but the world has 4 ranks"), "{err}");
}

#[test]
fn zeros_are_refused_with_the_fix() {
    let err = Mesh::new(Degrees::new().with(Axis::Tp, 0), 1, 1).unwrap_err().to_string();
    assert!(err.contains("tp has degree 0") && err.contains("at least 1"), "{err}");
    let err = Mesh::new(Degrees::new(), 0, 1).unwrap_err().to_string();
    assert!(err.contains("0 ranks"), "{err}");
    let err = Mesh::new(Degrees::new(), 1, 0).unwrap_err().to_string();
    assert!(err.contains("ranks_per_node is 0"), "{err}");
    let huge = Degrees::new().with(Axis::Tp, usize::MAX).with(Axis::Dp, 2);
    let err = Mesh::new(huge, 8, 8).unwrap_err().to_string();
    assert!(err.contains("overflows"), "{err}");
}

#[test]
fn out_of_range_ranks_and_coordinates_are_errors() {
    let mesh = Mesh::parse("dp2,tp2", 4, 4).unwrap();
    let err = mesh.coords(4).unwrap_err().to_string();
    assert!(err.contains("rank 4 is outside the world of 4 ranks"), "{err}");
    assert!(mesh.group(Axis::Tp, 9).is_err());
    let err = mesh.rank_of(Coords::new().with(Axis::Tp, 2)).unwrap_err().to_string();
    assert!(err.contains("tp 2") && err.contains("0..2"), "{err}");
}

#[test]
fn tp_across_nodes_is_warned_about() {
    let mesh = Mesh::parse("tp8", 8, 4).unwrap();
    let w = mesh.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].starts_with("tp=8 spans 2 nodes of 4 ranks") && w[0].contains("keep tp ≤ ranks per node (4)"), "{w:?}");

    // tp fits on a node but does not divide it: some groups straddle two nodes.
    let w = Mesh::parse("dp4,tp3", 12, 4).unwrap().warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("tp=3 spans 2 nodes") && w[0].contains("choose tp dividing the ranks per node (4)"), "{w:?}");
}

#[test]
fn ep_across_nodes_is_warned_about_with_tp() {
    let w = Mesh::parse("ep4,tp2", 8, 4).unwrap().warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].starts_with("ep=4 (with ep·tp=8) spans 2 nodes of 4 ranks"), "{w:?}");
    assert!(w[0].contains("keep ep·tp ≤ ranks per node (4)"), "{w:?}");
}

#[test]
fn a_good_layout_has_no_warnings() {
    // dp and pp may cross nodes: their traffic is light or overlapped.
    assert!(Mesh::parse("pp2,dp2,ep2,tp4", 32, 8).unwrap().warnings().is_empty());
    assert!(Mesh::parse("dp8", 8, 1).unwrap().warnings().is_empty());
    assert!(Mesh::single().warnings().is_empty());
}

#[test]
fn specs_parse_in_any_order_and_form() {
    let d = Degrees::new().with(Axis::Dp, 2).with(Axis::Tp, 4).with(Axis::Pp, 2);
    for spec in ["dp2,tp4,pp2", "pp2,dp2,tp4", "dp=2 tp=4 pp=2", "DP2, TP4, PP2", "dp:2,tp4,pp2,ep1"] {
        assert_eq!(Degrees::parse(spec).unwrap(), d, "{spec}");
    }
    assert_eq!(Degrees::parse("").unwrap(), Degrees::new());
    assert_eq!(d.to_string(), "pp2,dp2,cp1,ep1,tp4");
    assert_eq!(d.to_string().parse::<Degrees>().unwrap(), d);
    assert_eq!(d.product(), Some(16));
    assert_eq!("ep".parse::<Axis>().unwrap(), Axis::Ep);
    let mesh = Mesh::new(d, 16, 8).unwrap();
    assert_eq!(mesh.to_string(), "pp2,dp2,cp1,ep1,tp4 (16 ranks, 8 per node)");
    assert_eq!(mesh.degrees(), d);
    assert_eq!(mesh.ranks_per_node(), 8);
}

#[test]
fn bad_specs_say_what_is_wrong() {
    let err = Degrees::parse("dp2,xp2").unwrap_err().to_string();
    assert!(err.contains("unknown axis `xp`") && err.contains("pp, dp, cp, ep, tp"), "{err}");
    let err = Degrees::parse("dp2,tp").unwrap_err().to_string();
    assert!(err.contains("`tp`") && err.contains("tp4"), "{err}");
    let err = Degrees::parse("tp2,tp4").unwrap_err().to_string();
    assert!(err.contains("`tp` is given twice"), "{err}");
    assert!(Degrees::parse("2tp").is_err());
}
