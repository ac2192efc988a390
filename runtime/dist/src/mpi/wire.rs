//! Tensors' elements as MPI moves them, and the MPI calls that move them.
//!
//! Every call here is a thin wrapper over one C function of the MPI library,
//! taking Rust slices, so that the pointers and counts MPI sees always
//! describe live memory of the right length. Data movement (gathers,
//! broadcasts, all-to-all, messages) never looks at the values: elements
//! travel as unsigned integers of their width ([`Bits`]), so `bf16` and
//! `f16`, which MPI has no type for, move like any other. Sums name the
//! element type ([`Summand`]), since MPI adds them.

use ::mpi::datatype::Equivalence;
use ::mpi::ffi;
use ::mpi::traits::AsRaw;
use std::ffi::c_void;
use std::os::raw::c_int;
use tessera_core::backend::CpuStorage;
use tessera_core::tensor::{with_elem, Element};
use tessera_core::{Error, Result};

/// The raw handle of a communicator.
pub(super) type Comm = ffi::MPI_Comm;

/// An element type and the unsigned integer of its width, as which MPI
/// moves it bit for bit.
pub(super) trait Wire: Element {
    /// The integer type of the same size.
    type Bits: Equivalence + bytemuck::Pod;
}

impl Wire for f32 {
    type Bits = u32;
}
impl Wire for f64 {
    type Bits = u64;
}
impl Wire for half::bf16 {
    type Bits = u16;
}
impl Wire for half::f16 {
    type Bits = u16;
}
impl Wire for i32 {
    type Bits = u32;
}
impl Wire for u32 {
    type Bits = u32;
}

/// Elements of a tensor as the integers of their width.
#[derive(Clone, Copy)]
pub(super) enum Bits<'a> {
    B16(&'a [u16]),
    B32(&'a [u32]),
    B64(&'a [u64]),
}

/// Writable elements as the integers of their width.
pub(super) enum BitsMut<'a> {
    B16(&'a mut [u16]),
    B32(&'a mut [u32]),
    B64(&'a mut [u64]),
}

/// The elements `range` of a host storage, as bits.
pub(super) fn bits(s: &CpuStorage, range: std::ops::Range<usize>) -> Bits<'_> {
    with_elem!(s.dtype(), T => typed_bits::<T>(&s.as_slice::<T>().expect("the storage's own dtype")[range]))
}

/// All elements of a host storage, writable, as bits.
pub(super) fn bits_mut(s: &mut CpuStorage) -> BitsMut<'_> {
    with_elem!(s.dtype(), T => typed_bits_mut::<T>(s.as_mut_slice::<T>().expect("the storage's own dtype")))
}

fn typed_bits<T: Wire>(s: &[T]) -> Bits<'_> {
    match std::mem::size_of::<T>() {
        2 => Bits::B16(bytemuck::cast_slice(s)),
        4 => Bits::B32(bytemuck::cast_slice(s)),
        _ => Bits::B64(bytemuck::cast_slice(s)),
    }
}

fn typed_bits_mut<T: Wire>(s: &mut [T]) -> BitsMut<'_> {
    match std::mem::size_of::<T>() {
        2 => BitsMut::B16(bytemuck::cast_slice_mut(s)),
        4 => BitsMut::B32(bytemuck::cast_slice_mut(s)),
        _ => BitsMut::B64(bytemuck::cast_slice_mut(s)),
    }
}

fn datatype<T: Equivalence>() -> ffi::MPI_Datatype {
    T::equivalent_datatype().as_raw()
}

impl Bits<'_> {
    fn raw(&self) -> (*const c_void, usize, ffi::MPI_Datatype) {
        match self {
            Bits::B16(s) => (s.as_ptr().cast(), s.len(), datatype::<u16>()),
            Bits::B32(s) => (s.as_ptr().cast(), s.len(), datatype::<u32>()),
            Bits::B64(s) => (s.as_ptr().cast(), s.len(), datatype::<u64>()),
        }
    }
}

impl BitsMut<'_> {
    fn raw(&mut self) -> (*mut c_void, usize, ffi::MPI_Datatype) {
        match self {
            BitsMut::B16(s) => (s.as_mut_ptr().cast(), s.len(), datatype::<u16>()),
            BitsMut::B32(s) => (s.as_mut_ptr().cast(), s.len(), datatype::<u32>()),
            BitsMut::B64(s) => (s.as_mut_ptr().cast(), s.len(), datatype::<u64>()),
        }
    }
}

/// An element type MPI sums itself (`MPI_SUM`).
pub(super) trait Summand: Element + Equivalence {}
impl Summand for f32 {}
impl Summand for f64 {}
impl Summand for i32 {}
impl Summand for u32 {}

/// `n` as an MPI count: MPI counts are C `int`s, so one call moves at most
/// 2³¹ − 1 elements (of the element's own width).
pub(super) fn count(op: &'static str, n: usize) -> Result<c_int> {
    c_int::try_from(n)
        .map_err(|_| Error::unsupported(op, format!("{n} elements in one MPI call: MPI counts are 32-bit C ints (at most {}); split the tensor", c_int::MAX)))
}

fn counts(op: &'static str, ns: &[usize]) -> Result<Vec<c_int>> {
    ns.iter().map(|&n| count(op, n)).collect()
}

/// Displacements of consecutive blocks of `ns` elements.
fn displacements(op: &'static str, ns: &[usize]) -> Result<Vec<c_int>> {
    let mut at = 0usize;
    ns.iter()
        .map(|&n| {
            let d = count(op, at);
            at += n;
            d
        })
        .collect()
}

/// A non-success return code: with the error handler the world sets
/// (`MPI_ERRORS_ARE_FATAL`) MPI aborts the job before one could come back,
/// so this is a library that ignored its handler.
fn check(rc: c_int, op: &'static str) {
    if rc != 0 {
        super::abort_job(&format!("MPI returned error code {rc} in {op} despite MPI_ERRORS_ARE_FATAL"));
    }
}

fn same_width(a: &Bits<'_>, b: &BitsMut<'_>) {
    let same = matches!((a, b), (Bits::B16(_), BitsMut::B16(_)) | (Bits::B32(_), BitsMut::B32(_)) | (Bits::B64(_), BitsMut::B64(_)));
    assert!(same, "send and receive buffers of one call have the same element width");
}

/// `MPI_Allgather`: every rank's `send` (the same length everywhere),
/// concatenated in rank order into `recv` (`n` times as long).
pub(super) fn all_gather(comm: Comm, send: Bits<'_>, mut recv: BitsMut<'_>) -> Result<()> {
    same_width(&send, &recv);
    let (sp, sn, dt) = send.raw();
    let (rp, rn, _) = recv.raw();
    let c = count("all_gather", sn)?;
    count("all_gather", rn)?;
    // SAFETY: `sp` points at `sn` live elements and `rp` at `rn` writable
    // ones of datatype `dt`; the caller sized `recv` as the group size
    // times `send`, which is what MPI writes; both outlive the blocking call.
    check(unsafe { ffi::MPI_Allgather(sp, c, dt, rp, c, dt, comm) }, "MPI_Allgather");
    Ok(())
}

/// `MPI_Allgatherv`: rank `r`'s `send` (of `lens[r]` elements) lands at
/// the sum of the lengths before it in `recv`.
pub(super) fn all_gather_v(comm: Comm, send: Bits<'_>, mut recv: BitsMut<'_>, lens: &[usize]) -> Result<()> {
    same_width(&send, &recv);
    let (sp, sn, dt) = send.raw();
    let (rp, rn, _) = recv.raw();
    assert_eq!(rn, lens.iter().sum::<usize>(), "the receive buffer holds every rank's part");
    let (c, cs, ds) = (count("all_gather", sn)?, counts("all_gather", lens)?, displacements("all_gather", lens)?);
    // SAFETY: `recv` holds exactly the parts `cs` at `ds` (checked above),
    // `send` holds `c` elements; all live through the blocking call.
    check(unsafe { ffi::MPI_Allgatherv(sp, c, dt, rp, cs.as_ptr(), ds.as_ptr(), dt, comm) }, "MPI_Allgatherv");
    Ok(())
}

/// `MPI_Alltoall`: block `j` of `send` goes to rank `j`; block `i` of
/// `recv` comes from rank `i` (both `n` blocks of one length).
pub(super) fn all_to_all(comm: Comm, n: usize, send: Bits<'_>, mut recv: BitsMut<'_>) -> Result<()> {
    same_width(&send, &recv);
    let (sp, sn, dt) = send.raw();
    let (rp, rn, _) = recv.raw();
    assert!(sn == rn && sn % n == 0, "n equal blocks each way");
    let c = count("all_to_all", sn / n)?;
    count("all_to_all", sn)?;
    // SAFETY: both buffers hold `n` blocks of `c` elements of `dt` and live
    // through the blocking call.
    check(unsafe { ffi::MPI_Alltoall(sp, c, dt, rp, c, dt, comm) }, "MPI_Alltoall");
    Ok(())
}

/// `MPI_Alltoallv`: the elements `send_lens[j]` (consecutive blocks of
/// `send`) go to rank `j`; `recv` gets `recv_lens[i]` from rank `i`.
pub(super) fn all_to_all_v(comm: Comm, send: Bits<'_>, send_lens: &[usize], mut recv: BitsMut<'_>, recv_lens: &[usize]) -> Result<()> {
    same_width(&send, &recv);
    let (sp, sn, dt) = send.raw();
    let (rp, rn, _) = recv.raw();
    assert_eq!(sn, send_lens.iter().sum::<usize>(), "the send buffer holds every part");
    assert_eq!(rn, recv_lens.iter().sum::<usize>(), "the receive buffer holds every part");
    let op = "all_to_all";
    let (sc, sd, rc, rd) = (counts(op, send_lens)?, displacements(op, send_lens)?, counts(op, recv_lens)?, displacements(op, recv_lens)?);
    // SAFETY: the counts and displacements describe exactly the two live
    // buffers (checked above), which outlive the blocking call.
    check(unsafe { ffi::MPI_Alltoallv(sp, sc.as_ptr(), sd.as_ptr(), dt, rp, rc.as_ptr(), rd.as_ptr(), dt, comm) }, "MPI_Alltoallv");
    Ok(())
}

/// `MPI_Bcast` from the root, whose elements are only read.
pub(super) fn broadcast_from(comm: Comm, root: usize, data: Bits<'_>) -> Result<()> {
    let (p, n, dt) = data.raw();
    let c = count("broadcast", n)?;
    // SAFETY: on the root MPI_Bcast only reads its buffer (the standard's
    // `buffer` argument is IN there), so passing read-only memory as the
    // C API's non-const pointer is sound; it holds `c` live elements.
    check(unsafe { ffi::MPI_Bcast(p.cast_mut(), c, dt, root as c_int, comm) }, "MPI_Bcast");
    Ok(())
}

/// `MPI_Bcast` into `data` on a rank other than the root.
pub(super) fn broadcast_into(comm: Comm, root: usize, mut data: BitsMut<'_>) -> Result<()> {
    let (p, n, dt) = data.raw();
    let c = count("broadcast", n)?;
    // SAFETY: `p` holds `c` writable elements, the root's count (the call
    // check compared the shapes), and lives through the blocking call.
    check(unsafe { ffi::MPI_Bcast(p, c, dt, root as c_int, comm) }, "MPI_Bcast");
    Ok(())
}

/// `MPI_Allreduce` with `MPI_SUM` of `send` into `recv` (the same length).
pub(super) fn all_reduce_sum<T: Summand>(comm: Comm, send: &[T], recv: &mut [T]) -> Result<()> {
    assert_eq!(send.len(), recv.len());
    let c = count("all_reduce_sum", send.len())?;
    // SAFETY: both slices hold `c` live elements of T's MPI datatype and
    // outlive the blocking call; MPI_SUM is predefined.
    check(unsafe { ffi::MPI_Allreduce(send.as_ptr().cast(), recv.as_mut_ptr().cast(), c, datatype::<T>(), ffi::RSMPI_SUM, comm) }, "MPI_Allreduce");
    Ok(())
}

/// `MPI_Reduce_scatter_block` with `MPI_SUM`: block `r` of the sum of
/// every rank's `send` (`n` blocks of `recv`'s length) into rank `r`'s `recv`.
pub(super) fn reduce_scatter_sum<T: Summand>(comm: Comm, n: usize, send: &[T], recv: &mut [T]) -> Result<()> {
    assert_eq!(send.len(), recv.len() * n);
    let c = count("reduce_scatter_sum", recv.len())?;
    count("reduce_scatter_sum", send.len())?;
    // SAFETY: `send` holds `n · c` and `recv` `c` live elements of T's MPI
    // datatype, through the blocking call; MPI_SUM is predefined.
    check(
        unsafe { ffi::MPI_Reduce_scatter_block(send.as_ptr().cast(), recv.as_mut_ptr().cast(), c, datatype::<T>(), ffi::RSMPI_SUM, comm) },
        "MPI_Reduce_scatter_block",
    );
    Ok(())
}

/// `MPI_Barrier`.
pub(super) fn barrier(comm: Comm) {
    // SAFETY: `comm` is a live communicator.
    check(unsafe { ffi::MPI_Barrier(comm) }, "MPI_Barrier");
}

/// A started non-blocking send or receive, whose buffer the caller keeps
/// alive and untouched until the request is complete.
#[repr(transparent)]
pub(super) struct Request(ffi::MPI_Request);

// SAFETY: an MPI request is a handle that may be completed from any thread
// under MPI_THREAD_MULTIPLE (the level the world requires), as long as two
// threads never complete the same request at once; every owner of a
// `Request` completes it through `&mut`.
unsafe impl Send for Request {}

impl Request {
    fn null() -> Self {
        // SAFETY: reads a constant the MPI library defines.
        Request(unsafe { ffi::RSMPI_REQUEST_NULL })
    }

    /// Whether the operation has completed (then the request is freed).
    pub(super) fn test(&mut self) -> bool {
        let mut done: c_int = 0;
        // SAFETY: `self.0` is a request this process started and has not
        // completed; MPI_Test frees it when it reports completion.
        check(unsafe { ffi::MPI_Test(&mut self.0, &mut done, ffi::RSMPI_STATUS_IGNORE) }, "MPI_Test");
        done != 0
    }
}

/// Waits for every request.
pub(super) fn wait_all(requests: &mut [Request]) {
    if requests.is_empty() {
        return;
    }
    let n = c_int::try_from(requests.len()).expect("fewer requests than ranks");
    // SAFETY: `Request` is a transparent wrapper over live MPI requests in
    // contiguous memory (a slice of a one-field struct has the field's
    // layout); MPI_Waitall completes and frees each.
    check(unsafe { ffi::MPI_Waitall(n, requests.as_mut_ptr().cast(), ffi::RSMPI_STATUSES_IGNORE) }, "MPI_Waitall");
}

/// `MPI_Isend` of `data` to rank `to` with `tag`. The caller keeps `data`
/// alive and unmodified until the request completes.
pub(super) fn isend(comm: Comm, data: Bits<'_>, to: usize, tag: c_int) -> Result<Request> {
    let (p, n, dt) = data.raw();
    let c = count("send", n)?;
    let mut r = Request::null();
    // SAFETY: `p` holds `c` live elements; the caller keeps them alive and
    // unmodified until `r` completes (documented above).
    check(unsafe { ffi::MPI_Isend(p, c, dt, to as c_int, tag, comm, &mut r.0) }, "MPI_Isend");
    Ok(r)
}

/// `MPI_Irecv` into `data` from rank `from` with `tag`. The caller keeps
/// `data` alive and does not touch it until the request completes.
pub(super) fn irecv(comm: Comm, mut data: BitsMut<'_>, from: usize, tag: c_int) -> Result<Request> {
    let (p, n, dt) = data.raw();
    let c = count("recv", n)?;
    let mut r = Request::null();
    // SAFETY: `p` holds `c` writable elements that the caller keeps alive
    // and untouched until `r` completes (documented above).
    check(unsafe { ffi::MPI_Irecv(p, c, dt, from as c_int, tag, comm, &mut r.0) }, "MPI_Irecv");
    Ok(r)
}

/// `MPI_Recv` into `data` from rank `from` with `tag`; the message must be
/// exactly as long (MPI reports a longer one as a truncation error, which
/// aborts the job).
pub(super) fn recv(comm: Comm, mut data: BitsMut<'_>, from: usize, tag: c_int) -> Result<()> {
    let (p, n, dt) = data.raw();
    let c = count("recv", n)?;
    // SAFETY: `p` holds `c` writable elements that live through the
    // blocking call.
    check(unsafe { ffi::MPI_Recv(p, c, dt, from as c_int, tag, comm, ffi::RSMPI_STATUS_IGNORE) }, "MPI_Recv");
    Ok(())
}
