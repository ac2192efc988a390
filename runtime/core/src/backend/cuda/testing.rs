//! Support for tests that need a GPU or the CUDA compilers: they run where
//! these exist and otherwise say loudly that they were skipped, so a machine
//! without a GPU never reports them as passed in silence.
//!
//! The skip line goes straight to the process's stderr (the test harness
//! captures only `print!`-style output, so it shows even for a passing test)
//! and, when `TESSERA_SKIP_LOG` names a file, is appended there so a CI
//! script can count the skips.

use crate::backend::Device;
use std::io::Write;

/// Reports that `test` did not run, and why: `skipped: {reason} ({test})`.
pub fn report_skip(test: &str, reason: &str) {
    let line = format!("skipped: {reason} ({test})\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os("TESSERA_SKIP_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// CUDA device 0 for `test`, or `None` after reporting
/// `skipped: no CUDA device` with the reason the device could not be opened.
pub fn cuda_or_skip(test: &str) -> Option<Device> {
    match Device::cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            report_skip(test, &format!("no CUDA device: {e}"));
            None
        }
    }
}
