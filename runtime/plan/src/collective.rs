//! How long a collective takes over a [`Link`]: the ring algorithms'
//! α–β costs (the ones NCCL uses for large messages).
//!
//! For a group of `n` devices and a message of `b` bytes per device, a ring
//! reduce-scatter or all-gather takes `n − 1` steps, each moving `b / n`
//! bytes: `(n − 1)·(α + b / (n·β))`. An all-reduce is one of each. An
//! all-to-all sends each peer its `b / n` bytes: `n − 1` steps of the same
//! size. Point-to-point (a pipeline's send) is one step of `b` bytes.

use crate::profile::Link;

/// A collective operation, as the cost model counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// Every device ends with the sum of everyone's `b` bytes.
    AllReduce,
    /// Every device ends with its `b / n` bytes of the sum.
    ReduceScatter,
    /// Every device ends with everyone's pieces: `b` bytes in all.
    AllGather,
    /// Every device sends `b / n` bytes to each other one.
    AllToAll,
    /// One device sends `b` bytes to one other.
    SendRecv,
}

impl Collective {
    /// Seconds for `bytes` (the whole message on one device, as described
    /// above) over a group of `size` devices on `link`; 0 for one device.
    pub fn seconds(self, link: &Link, size: usize, bytes: f64) -> f64 {
        if size <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        let (steps, volume) = self.ring(size, bytes);
        let (latency, bandwidth) = link.for_size(size);
        steps * latency + volume / bandwidth
    }

    /// The steps a ring runs for `bytes` over `size` devices, and the bytes
    /// each device sends in all: the two terms the α–β cost multiplies.
    pub fn ring(self, size: usize, bytes: f64) -> (f64, f64) {
        let n = size as f64;
        match self {
            Collective::AllReduce => (2.0 * (n - 1.0), 2.0 * (n - 1.0) / n * bytes),
            Collective::ReduceScatter | Collective::AllGather | Collective::AllToAll => (n - 1.0, (n - 1.0) / n * bytes),
            Collective::SendRecv => (1.0, bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINK: Link = Link { bandwidth: 100e9, latency: 5e-6, by_size: Vec::new(), overlaps_compute: true };

    #[test]
    fn an_all_reduce_is_a_reduce_scatter_then_an_all_gather() {
        for n in [2, 3, 8, 64] {
            for bytes in [1e3, 1e6, 1e9] {
                let ar = Collective::AllReduce.seconds(&LINK, n, bytes);
                let parts = Collective::ReduceScatter.seconds(&LINK, n, bytes) + Collective::AllGather.seconds(&LINK, n, bytes);
                assert!((ar - parts).abs() <= 1e-12 * ar.max(1.0), "n {n}, {bytes} bytes");
            }
        }
    }

    #[test]
    fn large_messages_approach_the_ring_bandwidth_bound() {
        // A ring all-reduce moves 2(n − 1)/n of the message through each link.
        let (n, bytes) = (8, 1e10);
        let bound = 2.0 * (n as f64 - 1.0) / n as f64 * bytes / LINK.bandwidth;
        let t = Collective::AllReduce.seconds(&LINK, n, bytes);
        assert!(t >= bound && t < bound * 1.001, "{t} vs {bound}");
        // Small ones are latency: 2(n − 1) steps.
        let t = Collective::AllReduce.seconds(&LINK, n, 8.0);
        assert!((t - 14.0 * LINK.latency).abs() < 1e-9, "{t}");
    }

    #[test]
    fn one_device_or_no_bytes_costs_nothing_and_more_costs_more() {
        assert_eq!(Collective::AllReduce.seconds(&LINK, 1, 1e9), 0.0);
        assert_eq!(Collective::AllGather.seconds(&LINK, 8, 0.0), 0.0);
        for op in [Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather, Collective::AllToAll, Collective::SendRecv] {
            let mut last = 0.0;
            for bytes in [1.0, 1e3, 1e6, 1e9] {
                let t = op.seconds(&LINK, 4, bytes);
                assert!(t > last, "{op:?} at {bytes} bytes");
                last = t;
            }
            let slow = Link { bandwidth: LINK.bandwidth / 10.0, ..LINK };
            assert!(op.seconds(&slow, 4, 1e6) > op.seconds(&LINK, 4, 1e6), "{op:?}");
        }
    }
}
