//! What each rank is told: the torchrun-compatible environment variables.
//!
//! Pure arithmetic on the node's place in the job, kept apart from process
//! handling so that it can be checked without starting anything.

/// Where this node's launcher sits in the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Ranks started on this node.
    pub nproc_per_node: usize,
    /// Nodes in the job, each with its own launcher.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
}

impl Topology {
    /// A topology after checking what a launcher cannot work with; the
    /// messages name the flag to change.
    pub fn new(nproc_per_node: usize, nnodes: usize, node_rank: usize) -> Result<Topology, String> {
        if nproc_per_node == 0 {
            return Err("--nproc-per-node must be at least 1 (the number of ranks to start on this node)".into());
        }
        if nnodes == 0 {
            return Err("--nnodes must be at least 1 (the number of nodes, each running its own launcher)".into());
        }
        if node_rank >= nnodes {
            return Err(format!("--node-rank {node_rank} is out of range for --nnodes {nnodes}: node ranks are 0..{}", nnodes - 1));
        }
        if nproc_per_node.checked_mul(nnodes).is_none() {
            return Err(format!("--nnodes {nnodes} × --nproc-per-node {nproc_per_node} overflows the world size"));
        }
        Ok(Topology { nproc_per_node, nnodes, node_rank })
    }

    /// Ranks in the whole job.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// The global rank of local rank `local`: nodes hold contiguous blocks of
    /// ranks, so the communication-heavy mesh axes (tensor parallelism varies
    /// fastest) stay inside a node.
    pub fn global_rank(&self, local: usize) -> usize {
        self.node_rank * self.nproc_per_node + local
    }
}

/// The variables that a rank's process gets on top of the launcher's own
/// environment. `threads` is `Some` when the launcher chooses the rank's
/// rayon pool size (the user did not set `RAYON_NUM_THREADS`).
pub struct RankEnv<'a> {
    /// The node's place in the job.
    pub topology: Topology,
    /// The rendezvous host.
    pub master_addr: &'a str,
    /// The rendezvous port.
    pub master_port: u16,
    /// The attempt: 0 first, then one more at each restart.
    pub restart: u32,
    /// How many restarts the launcher allows.
    pub max_restarts: u32,
    /// The rayon pool size to set, if the launcher sets one.
    pub threads: Option<usize>,
}

impl RankEnv<'_> {
    /// The variables of local rank `local`, in a stable order.
    pub fn vars(&self, local: usize) -> Vec<(&'static str, String)> {
        let t = self.topology;
        let mut vars = vec![
            ("RANK", t.global_rank(local).to_string()),
            ("WORLD_SIZE", t.world_size().to_string()),
            ("LOCAL_RANK", local.to_string()),
            ("LOCAL_WORLD_SIZE", t.nproc_per_node.to_string()),
            ("GROUP_RANK", t.node_rank.to_string()),
            ("GROUP_WORLD_SIZE", t.nnodes.to_string()),
            ("MASTER_ADDR", self.master_addr.to_string()),
            ("MASTER_PORT", self.master_port.to_string()),
            ("TESSERA_RESTART_COUNT", self.restart.to_string()),
            ("TORCHELASTIC_RESTART_COUNT", self.restart.to_string()),
            ("TESSERA_MAX_RESTARTS", self.max_restarts.to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", self.max_restarts.to_string()),
        ];
        if let Some(n) = self.threads {
            vars.push(("RAYON_NUM_THREADS", n.to_string()));
        }
        vars
    }
}

/// The rayon pool size of each rank when the user set none: the node's cores
/// divided among its ranks. Every rank's pool would otherwise start one
/// thread per core, so N ranks would run N threads per core and their
/// work-stealing workers would spin against each other.
pub fn threads_per_rank(cores: usize, nproc_per_node: usize) -> usize {
    (cores / nproc_per_node.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(vars: &[(&str, String)], key: &str) -> String {
        vars.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone()).unwrap_or_else(|| panic!("{key} is not set"))
    }

    #[test]
    fn ranks_are_contiguous_per_node() {
        let t = Topology::new(4, 3, 2).unwrap();
        let env = RankEnv { topology: t, master_addr: "10.0.0.1", master_port: 1234, restart: 2, max_restarts: 5, threads: None };
        for local in 0..4 {
            let vars = env.vars(local);
            assert_eq!(get(&vars, "RANK"), (8 + local).to_string());
            assert_eq!(get(&vars, "LOCAL_RANK"), local.to_string());
            assert_eq!(get(&vars, "WORLD_SIZE"), "12");
            assert_eq!(get(&vars, "LOCAL_WORLD_SIZE"), "4");
            assert_eq!(get(&vars, "GROUP_RANK"), "2");
            assert_eq!(get(&vars, "GROUP_WORLD_SIZE"), "3");
            assert_eq!(get(&vars, "TESSERA_RESTART_COUNT"), "2");
            assert_eq!(get(&vars, "TORCHELASTIC_RESTART_COUNT"), "2");
            assert!(!vars.iter().any(|(k, _)| *k == "RAYON_NUM_THREADS"));
        }
    }

    #[test]
    fn bad_topologies_name_the_flag() {
        assert!(Topology::new(0, 1, 0).unwrap_err().contains("--nproc-per-node"));
        assert!(Topology::new(1, 0, 0).unwrap_err().contains("--nnodes"));
        assert!(Topology::new(1, 2, 2).unwrap_err().contains("--node-rank 2"));
        assert!(Topology::new(usize::MAX, 2, 0).unwrap_err().contains("overflows"));
    }

    #[test]
    fn cores_are_divided_never_below_one() {
        assert_eq!(threads_per_rank(16, 4), 4);
        assert_eq!(threads_per_rank(16, 3), 5);
        assert_eq!(threads_per_rank(2, 4), 1);
        assert_eq!(threads_per_rank(1, 1), 1);
    }
}
