//! Launching a kernel on a device's compute stream.
//!
//! Every kernel is a grid-stride loop (over items, or over rows with one
//! block per row), so any grid covers any size: the grid is sized for
//! occupancy and capped, never for the data alone.

use super::args::Grid;
use super::device::CudaDevice;
use crate::error::{Error, Result};
use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use tessera_kernels::cuda::attention::{AttnParams, DEFAULT_SHARED_LIMIT};
use tessera_kernels::cuda::signature::Param;

/// Threads per block of an item loop.
const ITEM_THREADS: u32 = 256;
/// Most blocks of a launch: enough to fill any current GPU many times over;
/// the grid-stride loops cover the rest.
const MAX_BLOCKS: usize = 1 << 16;

/// A kernel argument's value.
// Built per launch, a few at a time (see `Arg`).
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy, Debug)]
pub(crate) enum Value {
    /// A device pointer, a length or a dimension.
    U64(u64),
    U32(u32),
    F32(f32),
    /// The attention kernels' argument struct, passed by value.
    Attn(AttnArg),
}

/// [`AttnParams`] as a kernel argument.
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnArg(pub(crate) AttnParams);

// SAFETY: `AttnParams` is `#[repr(C)]` plain data (u64s, an f32, a u32)
// that mirrors `struct AttnParams` of `attention.cu` field for field (a test
// of `tessera_kernels::cuda::attention` ties the two), so its bytes are the
// kernel parameter's bytes.
unsafe impl DeviceRepr for AttnArg {}

/// The launch configuration of `grid`; `None` when there is nothing to do.
pub(crate) fn config(grid: Grid) -> Option<LaunchConfig> {
    let (blocks, threads) = match grid {
        Grid::Items(0) | Grid::Rows { rows: 0, .. } => return None,
        Grid::Items(n) => (n.div_ceil(ITEM_THREADS as usize).min(MAX_BLOCKS), ITEM_THREADS),
        // A multiple of 32 (whole warps, as the block reduction needs), at most 1024.
        Grid::Rows { rows, cols } => (rows.min(MAX_BLOCKS), cols.clamp(1, 1024).next_multiple_of(32) as u32),
        Grid::Fixed { blocks: 0, .. } => return None,
        Grid::Fixed { blocks, threads, shared_bytes } => {
            return Some(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: shared_bytes })
        }
    };
    Some(LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 })
}

impl CudaDevice {
    /// Launches `symbol` of the source `source` over `grid` on the compute
    /// stream with `values` as its arguments, in order.
    ///
    /// The arguments are checked against the parameters the kernel's PTX
    /// declares (their number, and each one's width and kind): a mismatch
    /// is an error, never bytes the kernel misreads.
    ///
    /// # Safety
    ///
    /// What the PTX cannot say is the caller's to guarantee: every pointer
    /// among `values` addresses live memory of this device, queued on its
    /// compute stream, at least as large as the kernel reads and writes for
    /// the lengths and dimensions among `values`, with the element type the
    /// kernel takes (its `_{dtype}` suffix). All work runs on the compute
    /// stream, whose order makes a kernel see the writes queued before it.
    pub(crate) unsafe fn launch(&self, source: &'static str, symbol: &str, grid: Grid, values: &[Value]) -> Result<()> {
        let Some(cfg) = config(grid) else { return Ok(()) };
        let kernel = self.kernel(source, symbol)?;
        check_arguments(&kernel.params, values).map_err(|detail| Error::Cuda {
            ordinal: self.ordinal(),
            op: "launching a kernel",
            detail: format!("`{symbol}`: {detail}"),
        })?;
        let f = &kernel.function;
        if cfg.shared_mem_bytes > DEFAULT_SHARED_LIMIT {
            // More than the default dynamic shared memory must be allowed per
            // function before the launch, or the launch fails.
            f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, cfg.shared_mem_bytes as i32).map_err(|e| {
                Error::Cuda {
                    ordinal: self.ordinal(),
                    op: "allowing a kernel more shared memory",
                    detail: format!("`{symbol}` with {} bytes: {}", cfg.shared_mem_bytes, super::device::describe(&e)),
                }
            })?;
        }
        let stream = self.compute_stream();
        let mut builder = stream.launch_builder(f);
        for v in values {
            match v {
                Value::U64(x) => builder.arg(x),
                Value::U32(x) => builder.arg(x),
                Value::F32(x) => builder.arg(x),
                Value::Attn(x) => builder.arg(x),
            };
        }
        // SAFETY: the values match the kernel's parameters in number, width
        // and kind (checked above); the caller guarantees its pointers are
        // live and large enough (this function's contract).
        unsafe { builder.launch(cfg) }.map_err(|e| Error::Cuda {
            ordinal: self.ordinal(),
            op: "launching a kernel",
            detail: format!("`{symbol}`: {}", super::device::describe(&e)),
        })?;
        self.counters().kernel();
        Ok(())
    }
}

/// Whether `values` fit the parameters `params` one for one: a 64-bit value
/// (pointer or length) where the kernel declares 64 bits, a `u32` for 32, an
/// `f32` for a float, the attention struct for a byte array of its size.
pub(crate) fn check_arguments(params: &[Param], values: &[Value]) -> std::result::Result<(), String> {
    if params.len() != values.len() {
        return Err(format!("the kernel takes {} arguments, the launch passes {}", params.len(), values.len()));
    }
    for (i, (p, v)) in params.iter().zip(values).enumerate() {
        let fits = match (p, v) {
            (Param::B64, Value::U64(_)) | (Param::B32, Value::U32(_)) | (Param::F32, Value::F32(_)) => true,
            (Param::Bytes(n), Value::Attn(_)) => *n == std::mem::size_of::<AttnArg>(),
            _ => false,
        };
        if !fits {
            let given = match v {
                Value::U64(_) => "a u64".to_string(),
                Value::U32(_) => "a u32".to_string(),
                Value::F32(_) => "an f32".to_string(),
                Value::Attn(_) => format!("the {}-byte attention struct", std::mem::size_of::<AttnArg>()),
            };
            return Err(format!("argument {i} is {given}, but the kernel declares {p}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_cover_the_data_with_whole_warps_and_capped_blocks() {
        assert!(config(Grid::Items(0)).is_none());
        assert!(config(Grid::Rows { rows: 0, cols: 8 }).is_none());
        let c = config(Grid::Items(1000)).unwrap();
        assert_eq!((c.grid_dim.0, c.block_dim.0), (4, 256));
        assert_eq!(config(Grid::Items(usize::MAX / 2)).unwrap().grid_dim.0 as usize, MAX_BLOCKS);
        let r = config(Grid::Rows { rows: 3, cols: 5 }).unwrap();
        assert_eq!((r.grid_dim.0, r.block_dim.0), (3, 32));
        assert_eq!(config(Grid::Rows { rows: 1 << 20, cols: 4096 }).unwrap().block_dim.0, 1024);
        assert_eq!(config(Grid::Rows { rows: 2, cols: 100 }).unwrap().block_dim.0, 128);
        assert!(config(Grid::Fixed { blocks: 0, threads: 256, shared_bytes: 1 }).is_none());
        let f = config(Grid::Fixed { blocks: 7, threads: 256, shared_bytes: 83_200 }).unwrap();
        assert_eq!((f.grid_dim.0, f.block_dim.0, f.shared_mem_bytes), (7, 256, 83_200));
    }

    #[test]
    fn arguments_are_checked_against_the_declared_parameters() {
        let add = [Param::B64, Param::B64, Param::B64, Param::B64];
        assert!(check_arguments(&add, &[Value::U64(1), Value::U64(2), Value::U64(3), Value::U64(4)]).is_ok());
        let short = check_arguments(&add, &[Value::U64(1), Value::U64(2), Value::U64(3)]).unwrap_err();
        assert!(short.contains("takes 4 arguments, the launch passes 3"), "{short}");
        let scale = [Param::B64, Param::F32, Param::B64, Param::B64];
        let swapped = check_arguments(&scale, &[Value::U64(1), Value::U64(2), Value::U64(3), Value::F32(0.5)]).unwrap_err();
        assert!(swapped.contains("argument 1 is a u64, but the kernel declares an f32"), "{swapped}");
        let narrow = check_arguments(&[Param::B64], &[Value::U32(7)]).unwrap_err();
        assert!(narrow.contains("argument 0 is a u32"), "{narrow}");
    }
}
