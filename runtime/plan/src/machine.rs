//! This machine as a profile: what each of `ranks` CPU ranks (threads of
//! one process, as the in-process jobs run them) can do while all of them
//! work at once.
//!
//! Ranks on one machine share its cores and memory bandwidth, so a rank's
//! "device" is its share: every figure is measured with all ranks running
//! the same work together ([`sustained_time`](crate::measure::sustained_time): each
//! run started by a barrier and timed until the slowest rank finishes, as a
//! step waits for its slowest rank too).
//!
//! [`profile_cpu`] measures ranks as threads: the link is the in-process
//! communicator's, fitted by group size, and a profile of one machine has
//! no link between nodes; [`profile_cuda`] a node of GPUs from one process.
//! A launched job of processes is measured by [`crate::job`].

use tessera_core::{DType, Device, Error, Result};
use tessera_dist::inproc::InProcess;

use crate::measure::{all_reduce_time, attention_rate, fit_all_reduce, matmul_rate, memory_bandwidth, nonlinear_rate, optimizer_rate, Budget};
use crate::profile::{ClusterProfile, DeviceProfile, GroupFit, Link};

/// The sizes a profile measures at: a device's rates depend on the shapes
/// it runs, and a CPU rank and a GPU run very different ones.
#[derive(Clone, Copy, Debug)]
pub struct Scale {
    /// Square products, by side.
    pub squares: [usize; 3],
    /// Rows of tokens of the grid of layer-like products.
    pub rows: [usize; 3],
    /// Weight widths of the grid, each side.
    pub widths: [usize; 3],
    /// The attention measured: (batch, sequence, heads, head size).
    pub attention: (usize, usize, usize, usize),
    /// Bytes of each tensor of the memory-bandwidth pass.
    pub bandwidth_bytes: usize,
    /// Elements of the gelu and AdamW passes.
    pub elements: usize,
    /// The message sizes each group's all-reduce is timed at: from ones
    /// whose time is the latency to ones whose time is the bandwidth.
    pub all_reduce_bytes: &'static [usize],
}

impl Scale {
    /// CPU ranks: a grid of 64, 256 or 2048 rows by weights 64, 256 or 1024
    /// wide on each side, whose rates differ by several times on a CPU.
    pub const CPU: Scale = Scale {
        squares: [128, 512, 1024],
        rows: [64, 256, 2048],
        widths: [64, 256, 1024],
        attention: (2, 128, 4, 64),
        bandwidth_bytes: 32 << 20,
        elements: 1 << 20,
        all_reduce_bytes: &[1 << 10, 1 << 12, 1 << 16, 1 << 20, 1 << 23],
    };

    /// GPUs: the shapes a large model's layers run, 512, 2048 or 16384 rows by
    /// weights 1024, 4096 or 12288 wide on each side.
    pub const GPU: Scale = Scale {
        squares: [1024, 4096, 8192],
        rows: [512, 2048, 16384],
        widths: [1024, 4096, 12288],
        attention: (4, 2048, 16, 128),
        bandwidth_bytes: 256 << 20,
        elements: 1 << 26,
        all_reduce_bytes: &[1 << 14, 1 << 17, 1 << 20, 1 << 24, 1 << 27, 1 << 29],
    };

    /// The products measured, `(m, n, k)`: the squares, then the grid.
    pub fn matmul_shapes(&self) -> Vec<(usize, usize, usize)> {
        let mut shapes: Vec<_> = self.squares.iter().map(|&s| (s, s, s)).collect();
        for m in self.rows {
            for n in self.widths {
                for k in self.widths {
                    shapes.push((m, n, k));
                }
            }
        }
        shapes
    }
}

/// Measures this machine for `ranks` ranks into a profile named `name`.
pub fn profile_cpu(name: &str, ranks: usize, budget: Budget) -> Result<ClusterProfile> {
    let device = measure_device(ranks, budget)?;
    // Ranks on one machine share its cores with their collectives: nothing overlaps.
    let mut fits = Vec::new();
    let mut size = 2;
    while size <= ranks {
        fits.push(fit_all_reduce(size, &all_reduce_times(size)?)?);
        size *= 2;
    }
    let intra_node = link_of(fits, device.memory_bandwidth);
    cpu_profile(name, ranks, device, intra_node, None)
}

/// What each of `ranks` CPU ranks sharing this machine can do while all of
/// them work at once: matrix products by shape and dtype, attention, gelu,
/// AdamW, memory bandwidth, and its share of the machine's memory.
pub fn measure_device(ranks: usize, budget: Budget) -> Result<DeviceProfile> {
    if ranks == 0 {
        return Err(Error::invalid("profile_cpu", "0 ranks measure nothing; give at least 1"));
    }
    let memory = machine_memory()?;
    let name = format!("CPU rank, 1 of {ranks} sharing this machine");
    measure_on(&Device::cpu(), name, memory / ranks as u64, ranks, &Scale::CPU, Figures::All, budget)
}

/// Whether a figure the backend cannot measure fails the profile or is left out.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Figures {
    /// Every figure must be measured (the CPU backend runs every op).
    All,
    /// Attention, gelu and AdamW are left out where the backend has no such op.
    Available,
}

impl Figures {
    /// A figure measured, or left out (`None`) where it may be.
    fn keep<T>(self, measured: Result<T>) -> Result<Option<T>> {
        match (measured, self) {
            (Ok(v), _) => Ok(Some(v)),
            (Err(_), Figures::Available) => Ok(None),
            (Err(e), Figures::All) => Err(e),
        }
    }
}

/// `device` measured at `scale` by `ranks` threads at once: products in f32
/// and bf16 (the best is the dtype's peak), memory bandwidth, attention,
/// gelu and AdamW.
pub(crate) fn measure_on(
    device: &Device,
    name: String,
    memory_bytes: u64,
    ranks: usize,
    scale: &Scale,
    figures: Figures,
    budget: Budget,
) -> Result<DeviceProfile> {
    let mut matmul = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        for (m, n, k) in scale.matmul_shapes() {
            matmul.push(matmul_rate(device, dtype, m, n, k, ranks, budget)?);
        }
    }
    let peak_flops = ["f32", "bf16"].iter().map(|&d| (d.to_string(), matmul.iter().filter(|r| r.dtype == d).map(|r| r.flops).fold(0.0, f64::max))).collect();
    // Two f32 tensors read, one written, per rank.
    let memory_bandwidth = memory_bandwidth(device, scale.bandwidth_bytes, ranks, budget)?;
    let mut attention_flops = std::collections::BTreeMap::new();
    for dtype in [DType::F32, DType::BF16] {
        if let Some(rate) = figures.keep(attention_rate(device, dtype, scale.attention, ranks, budget))? {
            attention_flops.insert(dtype.to_string(), rate);
        }
    }
    let nonlinear = figures.keep(nonlinear_rate(device, scale.elements, ranks, budget))?;
    let optimizer_rate = figures.keep(optimizer_rate(device, scale.elements, ranks, budget))?;
    Ok(DeviceProfile { name, memory_bytes, memory_bandwidth, peak_flops, matmul, attention_flops, nonlinear, optimizer_rate })
}

/// A link of CPU ranks from its all-reduce `fits` by group size. Groups of a
/// size not measured get the largest measured group's figures (the
/// slowest, so a plan errs towards what it can keep); with none measured,
/// a copy at `memory_bandwidth`. The collectives run on the ranks' own
/// cores: nothing overlaps compute.
pub(crate) fn link_of(fits: Vec<GroupFit>, memory_bandwidth: f64) -> Link {
    let (latency, bandwidth) = fits.last().map_or((0.0, memory_bandwidth), |f| (f.latency, f.bandwidth));
    Link { bandwidth, latency, by_size: fits, overlaps_compute: false }
}

/// The profile of nodes of `per_node` CPU ranks each, checked like a file would be.
pub(crate) fn cpu_profile(name: &str, per_node: usize, device: DeviceProfile, intra_node: Link, inter_node: Option<Link>) -> Result<ClusterProfile> {
    // CPU ranks' "device" is the host memory itself: nothing to offload to.
    let profile =
        ClusterProfile { name: name.to_string(), gpus_per_node: per_node, device, intra_node, inter_node, ranks_share_cores: true, host_memory_bytes: None };
    ClusterProfile::parse(&profile.to_toml(), name)
}

/// Measures a node of `gpus` CUDA devices (this machine's first ones):
/// device 0's matrix products by shape in f32 and bf16, attention, gelu,
/// AdamW (each where the CUDA backend runs it; a figure it cannot measure
/// is left out, and the cost model falls back to the peak or the memory
/// traffic), its memory bandwidth and memory, and NCCL's all-reduce over
/// groups of 2, 4, ... of the GPUs (a thread per GPU, as Tessera's GPU
/// jobs of one process run them). The profile's peak is the best rate
/// measured; its link overlaps compute (NCCL runs on its own stream) and
/// has no figures between nodes.
pub fn profile_cuda(name: &str, gpus: usize, budget: Budget) -> Result<ClusterProfile> {
    const OP: &str = "profile_cuda";
    if gpus == 0 {
        return Err(Error::invalid(OP, "0 GPUs measure nothing; give at least 1"));
    }
    let devices: Vec<Device> = (0..gpus)
        .map(|i| {
            Device::cuda(i).map_err(|e| Error::invalid(OP, format!("GPU {i} cannot be opened ({e}); give --gpus with the number of GPUs this machine has")))
        })
        .collect::<Result<_>>()?;
    let dev = &devices[0];
    let memory_bytes = dev.total_memory()?.ok_or_else(|| Error::invalid(OP, "the device reports no memory size"))?;
    let device = measure_on(dev, gpu_name(dev), memory_bytes, 1, &Scale::GPU, Figures::Available, budget)?;
    let mut fits = Vec::new();
    let mut size = 2;
    while size <= gpus {
        fits.push(fit_all_reduce(size, &nccl_all_reduce_times(&devices[..size], Scale::GPU.all_reduce_bytes)?)?);
        size *= 2;
    }
    let mut intra_node = link_of(fits, device.memory_bandwidth);
    intra_node.overlaps_compute = true;
    let profile = ClusterProfile {
        name: name.to_string(),
        gpus_per_node: gpus,
        device,
        intra_node,
        inter_node: None,
        ranks_share_cores: false,
        host_memory_bytes: host_memory(),
    };
    ClusterProfile::parse(&profile.to_toml(), name)
}

pub(crate) fn gpu_name(dev: &Device) -> String {
    match dev {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => d.name().to_string(),
        _ => dev.to_string(),
    }
}

/// (bytes, seconds) of NCCL all-reduces over `devices`, a thread each,
/// GPU 0's best time at each of `sizes` bytes.
#[cfg(feature = "cuda")]
fn nccl_all_reduce_times(devices: &[Device], sizes: &[usize]) -> Result<Vec<(f64, f64)>> {
    use tessera_dist::nccl::NcclCommunicator;
    let comms = NcclCommunicator::group(devices)?;
    let per_rank: Vec<Result<Vec<f64>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(devices)
            .map(|(comm, dev)| s.spawn(move || -> Result<Vec<f64>> { sizes.iter().map(|&b| all_reduce_time(&comm, dev, b, 5)).collect() }))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::invalid("profile_cuda", "a measuring GPU's thread panicked")))).collect()
    });
    let mut per_rank = per_rank.into_iter().collect::<Result<Vec<_>>>()?;
    let gpu0 = per_rank.swap_remove(0);
    Ok(sizes.iter().zip(gpu0).map(|(&b, t)| (b as f64, t)).collect())
}

/// Without the CUDA backend there are no GPUs to measure (and
/// [`profile_cuda`] has already failed opening them).
#[cfg(not(feature = "cuda"))]
fn nccl_all_reduce_times(_: &[Device], _: &[usize]) -> Result<Vec<(f64, f64)>> {
    Err(Error::NotCompiledWithCuda)
}

/// (bytes, seconds) of in-process all-reduces in a group of `size`, rank
/// 0's best time at each of the CPU scale's sizes.
fn all_reduce_times(size: usize) -> Result<Vec<(f64, f64)>> {
    let world = InProcess::new(size)?;
    let per_rank: Vec<Result<Vec<f64>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let world = &world;
                s.spawn(move || -> Result<Vec<f64>> {
                    let dev = Device::cpu();
                    let comm = world.communicator(rank, &dev)?;
                    Scale::CPU.all_reduce_bytes.iter().map(|&b| all_reduce_time(&comm, &dev, b, 5)).collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::invalid("profile_cpu", "a measuring rank panicked")))).collect()
    });
    let mut per_rank = per_rank.into_iter().collect::<Result<Vec<_>>>()?;
    let rank0 = per_rank.swap_remove(0);
    Ok(Scale::CPU.all_reduce_bytes.iter().zip(rank0).map(|(&b, t)| (b as f64, t)).collect())
}

/// The machine's memory in bytes (`MemTotal` of /proc/meminfo).
fn machine_memory() -> Result<u64> {
    let path = std::path::Path::new("/proc/meminfo");
    let text =
        std::fs::read_to_string(path).map_err(|e| Error::data_file(path, format!("cannot read the machine's memory size ({e}); profiling needs Linux")))?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .ok_or_else(|| Error::data_file(path, "has no MemTotal line in kB"))
}

/// This machine's memory (`MemTotal` of `/proc/meminfo`), what ZeRO-Offload
/// may fill; `None` where it cannot be read.
pub(crate) fn host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_gpu_profile_measures_the_device_and_its_products() {
        if tessera_core::backend::cuda::testing::cuda_or_skip("machine::a_gpu_profile_measures_the_device_and_its_products").is_none() {
            assert!(profile_cuda("gpu", 1, Budget { per_figure: Duration::from_millis(10) }).is_err());
            return;
        }
        let p = profile_cuda("gpu", 1, Budget { per_figure: Duration::from_millis(20) }).unwrap();
        assert_eq!((p.gpus_per_node, p.ranks_share_cores, p.intra_node.overlaps_compute), (1, false, true));
        assert_eq!(p.device.matmul.len(), 2 * Scale::GPU.matmul_shapes().len());
        // A GPU's bf16 products run on tensor cores: far past its f32 ones
        // and past any CPU.
        assert!(p.peak_flops("bf16").unwrap() > 2.0 * p.peak_flops("f32").unwrap(), "{:?}", p.device.peak_flops);
        assert!(p.peak_flops("bf16").unwrap() > 1e13);
        assert!(p.device.memory_bytes > 1 << 30 && p.device.memory_bandwidth > 1e11, "{:?}", p.device);
        assert!(profile_cuda("gpu", 0, Budget::default()).is_err());
    }

    #[test]
    fn a_machine_profile_of_two_ranks_is_a_valid_profile_of_one_node() {
        let p = profile_cpu("this machine", 2, Budget { per_figure: Duration::from_millis(10) }).unwrap();
        assert_eq!(p.gpus_per_node, 2);
        assert!(p.inter_node.is_none());
        assert_eq!(p.device.matmul.len(), 2 * Scale::CPU.matmul_shapes().len());
        assert_eq!(p.intra_node.by_size.len(), 1);
        assert_eq!(p.intra_node.by_size[0].size, 2);
        let f32_peak = p.peak_flops("f32").unwrap();
        assert!(p.device.matmul.iter().any(|r| r.dtype == "f32" && r.flops == f32_peak));
        assert!(p.device.memory_bytes > 0 && p.device.memory_bytes < machine_memory().unwrap());
        // Two ranks at once get at most what the machine gives one.
        let alone = matmul_rate(&Device::cpu(), DType::F32, 512, 512, 512, 1, Budget { per_figure: Duration::from_millis(50) }).unwrap();
        let shared = p.device.matmul.iter().find(|r| (r.m, r.n, r.k, r.dtype.as_str()) == (512, 512, 512, "f32")).unwrap();
        assert!(shared.flops < 1.5 * alone.flops, "a shared rank ran {} flop/s, one alone {}", shared.flops, alone.flops);
        assert!(profile_cpu("x", 0, Budget::default()).is_err());
    }
}
