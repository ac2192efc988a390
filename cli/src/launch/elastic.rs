//! Elastic membership: before each attempt, the launchers of a job agree on
//! which nodes take part, so that a job that lost a node goes on with the
//! nodes it has left (at least `--min-nodes`).
//!
//! The launcher of node 0 serves a small store at the master's address and
//! port (the ranks meet one port above it). For attempt `a`, every live
//! launcher registers under `agent/<a>/`; node 0 waits until all
//! `--nnodes` have, or, once `--min-nodes` have, at most `--last-call`
//! seconds more, then writes the members in order (itself first, the
//! others as they arrived). Each launcher's node rank for the attempt is
//! its place in that list, so the ranks stay contiguous per node. A
//! launcher that arrives after the list is written, or a round that never
//! reaches `--min-nodes` within the rendezvous timeout, fails with an error
//! that says so. The node 0 launcher must live for the job's whole length.

use super::env::Topology;
use anyhow::{bail, Context};
use std::time::{Duration, Instant};
use tessera::dist::store::{Store, StoreServer};

/// One launcher's membership in an elastic job.
pub struct Agent {
    /// Node 0's launcher serves the store until the job ends.
    _server: Option<StoreServer>,
    store: Store,
    /// The node rank this launcher was started with.
    given: usize,
    nproc_per_node: usize,
    max_nodes: usize,
    min_nodes: usize,
    last_call: Duration,
    timeout: Duration,
}

impl Agent {
    /// Joins the launchers of the job at `addr:port` (served here when
    /// `given` is 0).
    pub fn join(
        addr: &str,
        port: u16,
        given: usize,
        nproc_per_node: usize,
        nodes: (usize, usize),
        last_call: Duration,
        timeout: Duration,
    ) -> anyhow::Result<Agent> {
        let (min_nodes, max_nodes) = nodes;
        let server = match given {
            0 => {
                // An IP is bound as given; a host name as every interface
                // (it may resolve to a loopback address on its own host).
                let host = if addr.parse::<std::net::IpAddr>().is_ok() { addr } else { "0.0.0.0" };
                Some(
                    StoreServer::bind(host, port)
                        .with_context(|| format!("node 0 cannot serve the launchers' store on {addr}:{port}; give another --master-port"))?,
                )
            }
            _ => None,
        };
        let store =
            Store::connect(addr, port, timeout).with_context(|| format!("cannot reach the launchers' store on {addr}:{port}, served by node 0's launcher"))?;
        Ok(Agent { _server: server, store, given, nproc_per_node, max_nodes, min_nodes, last_call, timeout })
    }

    /// The nodes of attempt `attempt`, and this launcher's place among them.
    pub fn round(&self, attempt: u32) -> anyhow::Result<Topology> {
        let key = |name: &str| format!("agent/{attempt}/{name}");
        let arrival = self.store.add(&key("arrived"), 1)? - 1;
        self.store.set(&key(&format!("node/{arrival}")), self.given.to_string().as_bytes())?;
        if self.given == 0 {
            self.close(attempt)?;
        }
        let members = String::from_utf8(self.store.get(&key("members"), self.timeout)?)?;
        let members: Vec<usize> = members.split(',').map(str::parse).collect::<Result<_, _>>()?;
        let Some(node_rank) = members.iter().position(|&m| m == self.given) else {
            bail!(
                "node {} reached attempt {attempt} of the job after its {} nodes were settled; it can join at the next restart (start it again then)",
                self.given,
                members.len()
            );
        };
        Topology::new(self.nproc_per_node, members.len(), node_rank).map_err(anyhow::Error::msg)
    }

    /// Node 0: waits for the nodes of `attempt` and writes their list.
    fn close(&self, attempt: u32) -> anyhow::Result<()> {
        let key = |name: &str| format!("agent/{attempt}/{name}");
        let started = Instant::now();
        let mut enough_since: Option<Instant> = None;
        let arrived = loop {
            let arrived = self.store.add(&key("arrived"), 0)? as usize;
            if arrived >= self.max_nodes {
                break arrived;
            }
            if arrived >= self.min_nodes {
                let since = *enough_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= self.last_call {
                    break arrived;
                }
            } else if started.elapsed() >= self.timeout {
                bail!(
                    "only {arrived} of the at least {} nodes (--min-nodes) reached attempt {attempt} within {:?}: start the missing nodes' launchers, or lower --min-nodes",
                    self.min_nodes,
                    self.timeout
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut members = vec![0usize];
        for i in 0..arrived {
            let node: usize = String::from_utf8(self.store.get(&key(&format!("node/{i}")), self.timeout)?)?.parse()?;
            if node != 0 && !members.contains(&node) {
                members.push(node);
            }
        }
        let list: Vec<String> = members.iter().map(usize::to_string).collect();
        self.store.set(&key("members"), list.join(",").as_bytes())?;
        Ok(())
    }
}
