//! Kernel modules and functions, loaded once per device.
//!
//! The first launch of a kernel compiles its source (through the NVRTC
//! caches of `nvrtc.rs`), loads the PTX as a module into the device's
//! context and looks the function up; later launches find the function in
//! this cache. A source is loaded once per device however many of its
//! kernels are used.

use super::device::CudaDevice;
use super::nvrtc;
use crate::error::{Error, Result};
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A device's loaded modules (by source name) and functions (by source and symbol).
#[derive(Default)]
pub(crate) struct Modules {
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

impl CudaDevice {
    /// The kernel `symbol` of the source `source` (a name in
    /// `tessera_kernels::cuda::SOURCES`), compiled and loaded on first use.
    pub(crate) fn function(&self, source: &'static str, symbol: &str) -> Result<CudaFunction> {
        let cache = self.modules();
        let key = format!("{source}/{symbol}");
        if let Some(f) = cache.functions.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(f.clone());
        }
        let module = self.module(source)?;
        let f = module.load_function(symbol).map_err(|e| Error::Cuda {
            ordinal: self.ordinal(),
            op: "looking up a kernel",
            detail: format!("`{symbol}` in the `{source}` kernels: {}", super::device::describe(&e)),
        })?;
        cache.functions.lock().unwrap_or_else(|e| e.into_inner()).insert(key, f.clone());
        Ok(f)
    }

    fn module(&self, source: &'static str) -> Result<Arc<CudaModule>> {
        let cache = self.modules();
        if let Some(m) = cache.modules.lock().unwrap_or_else(|e| e.into_inner()).get(source) {
            return Ok(m.clone());
        }
        let unit = tessera_kernels::cuda::source(source)
            .ok_or_else(|| Error::invalid("cuda kernel", format!("no kernel source named `{source}` in tessera_kernels::cuda::SOURCES")))?;
        let ptx = nvrtc::compile_ptx(unit.name, unit.source, self.capability())?;
        let module = self
            .compute_stream()
            .context()
            .load_module(Ptx::from_src(ptx.to_string()))
            .map_err(|e| self.error("loading a kernel module", e))?;
        // Two threads may both load on a first miss; either module serves.
        cache.modules.lock().unwrap_or_else(|e| e.into_inner()).insert(source, module.clone());
        Ok(module)
    }
}
