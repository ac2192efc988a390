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
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use tessera_kernels::cuda::signature::{self, Param};

/// A loaded module and the parameter list of each of its entry points.
struct Module {
    module: Arc<CudaModule>,
    params: HashMap<String, Arc<[Param]>>,
}

/// A kernel ready to launch, with the parameters its PTX declares.
#[derive(Clone)]
pub(crate) struct Kernel {
    pub(crate) function: CudaFunction,
    pub(crate) params: Arc<[Param]>,
}

/// A device's loaded modules (by source name) and kernels (by source and symbol).
#[derive(Default)]
pub(crate) struct Modules {
    modules: Mutex<HashMap<&'static str, Arc<Module>>>,
    kernels: Mutex<HashMap<String, Kernel>>,
}

impl CudaDevice {
    /// The kernel `symbol` of the source `source` (a name in
    /// `tessera_kernels::cuda::SOURCES`), compiled and loaded on first use.
    pub(crate) fn kernel(&self, source: &'static str, symbol: &str) -> Result<Kernel> {
        let cache = self.modules();
        let key = format!("{source}/{symbol}");
        if let Some(k) = cache.kernels.lock().get(&key) {
            return Ok(k.clone());
        }
        let module = self.module(source)?;
        let lookup = |detail: String| Error::Cuda { ordinal: self.ordinal(), op: "looking up a kernel", detail };
        let function =
            module.module.load_function(symbol).map_err(|e| lookup(format!("`{symbol}` in the `{source}` kernels: {}", super::device::describe(&e))))?;
        let params = module.params.get(symbol).cloned().ok_or_else(|| lookup(format!("`{symbol}` is not an entry point of the `{source}` PTX")))?;
        let kernel = Kernel { function, params };
        cache.kernels.lock().insert(key, kernel.clone());
        Ok(kernel)
    }

    fn module(&self, source: &'static str) -> Result<Arc<Module>> {
        let cache = self.modules();
        if let Some(m) = cache.modules.lock().get(source) {
            return Ok(m.clone());
        }
        let unit = tessera_kernels::cuda::source(source)
            .ok_or_else(|| Error::unsupported("cuda kernel", format!("no kernel source named `{source}` in tessera_kernels::cuda::SOURCES")))?;
        let ptx = nvrtc::compile_ptx(unit.name, unit.source, self.capability())?;
        let params = signature::entries(&ptx)
            .map_err(|e| Error::Cuda { ordinal: self.ordinal(), op: "reading a kernel module's entry points", detail: format!("`{source}`: {e}") })?
            .into_iter()
            .map(|(name, p)| (name, Arc::from(p)))
            .collect();
        let module = self.compute_stream().context().load_module(Ptx::from_src(ptx.to_string())).map_err(|e| self.error("loading a kernel module", e))?;
        let module = Arc::new(Module { module, params });
        // Two threads may both load on a first miss; either module serves.
        cache.modules.lock().insert(source, module.clone());
        Ok(module)
    }
}
