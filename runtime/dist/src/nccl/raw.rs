//! The NCCL library and its communicator handles, below the [`Communicator`]
//! trait: loading the library without panicking, creating the handles of a
//! group of devices, and turning NCCL's status codes into errors.
//!
//! cudarc's safe `Comm` is not used: its handle is neither `Send` nor
//! `Sync` (a communicator must move to its rank's thread), it takes typed
//! slices where a tensor's storage is bytes of a run-time dtype, and its
//! `Drop` panics when NCCL reports an error. This layer keeps only what those
//! need: a handle that can move between threads and the `result` calls.
//!
//! [`Communicator`]: crate::Communicator

use cudarc::nccl::{result, sys};
use std::ffi::CStr;
use std::panic::catch_unwind;
use std::sync::OnceLock;
use tessera_core::tensor::DType;
use tessera_core::{Error, Result};

/// Loads the NCCL library once per process; its version (`major·10000 +
/// minor·100 + patch`), or why it cannot be used.
///
/// cudarc opens the library on first use and panics when it (or a symbol
/// the bindings need) is missing; the library is probed first and the first
/// call runs under `catch_unwind`, so a machine without NCCL gets an error.
pub(super) fn library() -> Result<i32> {
    static READY: OnceLock<std::result::Result<i32, String>> = OnceLock::new();
    READY
        .get_or_init(|| {
            // SAFETY: only opens and closes the library to see whether it loads.
            if !unsafe { sys::is_culib_present() } {
                return Err("the NCCL library (libnccl.so) cannot be loaded: it is not installed, or not on the loader path".into());
            }
            match catch_unwind(result::get_nccl_version) {
                Ok(Ok(version)) => Ok(version),
                Ok(Err(e)) => Err(format!("asking NCCL for its version failed: {}", describe(&e))),
                Err(_) => Err("the NCCL library lacks functions this build needs (NCCL 2.18 or newer)".into()),
            }
        })
        .clone()
        .map_err(|detail| Error::NcclUnavailable { detail })
}

/// NCCL's name and text for a failed call.
pub(super) fn describe(e: &result::NcclError) -> String {
    // SAFETY: ncclGetErrorString returns a pointer to a static string for
    // every status, known or not; the library is loaded (a call just failed).
    let text = catch_unwind(|| unsafe { sys::ncclGetErrorString(e.0) })
        .ok()
        .filter(|p| !p.is_null())
        .map(|p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
    match text {
        Some(text) => format!("{:?} ({text})", e.0),
        None => format!("{:?}", e.0),
    }
}

/// NCCL's element type for `dtype`; every dtype of the runtime has one.
pub(super) fn nccl_type(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
        DType::U32 => sys::ncclDataType_t::ncclUint32,
    }
}

/// One rank's NCCL communicator handle.
///
/// Released with `ncclCommAbort`, which frees the handle without waiting
/// for peers (the owner first waits for the work it queued, see
/// `Member::drop`).
pub(super) struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread provided calls on
// it are not concurrent; every use goes through the `Mutex` of its member
// state, which serialises them.
unsafe impl Send for RawComm {}

impl RawComm {
    /// The communicators of a group of one process driving the devices
    /// `ordinals` (all distinct): rank `i` runs on `ordinals[i]`.
    ///
    /// This is `ncclCommInitAll`, which creates every rank's handle from the
    /// calling thread, so no thread has to wait for the others to join.
    pub(super) fn init_all(ordinals: &[usize]) -> std::result::Result<Vec<RawComm>, String> {
        let list: Vec<i32> = ordinals.iter().map(|&o| i32::try_from(o).unwrap_or(i32::MAX)).collect();
        let count = i32::try_from(list.len()).map_err(|_| format!("{} ranks are more than NCCL can address", list.len()))?;
        let mut comms: Vec<sys::ncclComm_t> = vec![std::ptr::null_mut(); list.len()];
        // SAFETY: `comms` has room for `count` handles and `list` holds
        // `count` device ordinals; both outlive the call.
        let status = catch_unwind(move || {
            let r = unsafe { result::comm_init_all(comms.as_mut_ptr(), count, list.as_ptr()) };
            r.map(|_| comms)
        });
        match status {
            Ok(Ok(comms)) => Ok(comms.into_iter().map(RawComm).collect()),
            Ok(Err(e)) => Err(describe(&e)),
            Err(_) => Err("the NCCL library lacks ncclCommInitAll".into()),
        }
    }

    /// A new group's identity, made on the group's first rank and handed to
    /// the others (through the rendezvous store): 128 opaque bytes.
    pub(super) fn unique_id() -> std::result::Result<[u8; 128], String> {
        match catch_unwind(result::get_uniqueid) {
            Ok(Ok(id)) => Ok(id.internal.map(|c| c as u8)),
            Ok(Err(e)) => Err(describe(&e)),
            Err(_) => Err("the NCCL library lacks ncclGetUniqueId".into()),
        }
    }

    /// This process's handle as rank `rank` of the group of `size` ranks
    /// named `id` (`ncclCommInitRank`): every rank of the group calls it, in
    /// its own process, with the device it runs on current; it returns once
    /// all have.
    pub(super) fn init_rank(size: usize, id: &[u8; 128], rank: usize) -> std::result::Result<RawComm, String> {
        let size = i32::try_from(size).map_err(|_| format!("{size} ranks are more than NCCL can address"))?;
        let rank = i32::try_from(rank).map_err(|_| format!("rank {rank} is more than NCCL can address"))?;
        let id = sys::ncclUniqueId { internal: id.map(|b| b as std::ffi::c_char) };
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid place for one handle and outlives the
        // call; the id is passed by value.
        let status = catch_unwind(move || unsafe { result::comm_init_rank(&mut comm, size, id, rank) }.map(|_| comm));
        match status {
            Ok(Ok(comm)) => Ok(RawComm(comm)),
            Ok(Err(e)) => Err(describe(&e)),
            Err(_) => Err("the NCCL library lacks ncclCommInitRank".into()),
        }
    }

    /// The handle, for a call made while its member's lock is held.
    pub(super) fn handle(&self) -> sys::ncclComm_t {
        self.0
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        // Errors here cannot be reported (the handle is gone either way) and
        // must not panic inside a drop.
        let comm = self.0;
        // SAFETY: the handle came from ncclCommInitAll or ncclCommInitRank
        // and is released once.
        let _ = catch_unwind(move || unsafe { result::comm_abort(comm) });
    }
}
