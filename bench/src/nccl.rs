//! The real NCCL (or RCCL), loaded at run time: the benchmark's same-run baseline.
//!
//! Nothing links against NCCL at build time, so the benchmark builds and runs everywhere; when the
//! library is absent, [`Nccl::load`] says which files it tried and the benchmark runs without the
//! baseline. Where the library comes from: `MSCCLPP_NCCL_LIB_PATH` (`Env::nccl_lib_path`, a file,
//! or a folder holding `libnccl.so.2` / `librccl.so.1`) and nothing else when it is set, so a
//! wrong path is reported instead of silently measuring another NCCL; otherwise `libnccl.so.2`,
//! then `librccl.so.1`, on the loader's search path.
//!
//! The declarations follow nccl.h (NCCL 2.x; RCCL exports the same names). `ncclUniqueId` is a
//! 128-byte struct passed by value to `ncclCommInitRank`; it travels from rank 0 to the others over
//! our own bootstrap ([`NcclComm::init`]). Every failure is an [`Error::Driver`] naming the NCCL
//! function, its result code, and NCCL's own message (plus `ncclGetLastError` where it exists).

use mscclpp_core::bootstrap::Bootstrap;
use mscclpp_core::gpu::{DevicePtr, Stream};
use mscclpp_core::{DataType, Error, ReduceOp, Result};
use std::ffi::{c_char, c_int, c_void, CStr, OsString};
use std::path::Path;
use std::sync::Arc;

/// `NCCL_UNIQUE_ID_BYTES`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// Library names tried on the loader path when no explicit path is given, in order.
pub const DEFAULT_LIBRARIES: [&str; 2] = ["libnccl.so.2", "librccl.so.1"];

/// `ncclUniqueId`: opaque bytes made by rank 0, identical on every rank of one communicator.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId {
    pub internal: [u8; UNIQUE_ID_BYTES],
}

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclUniqueId({:02x?}..)", &self.internal[..8])
    }
}

/// `ncclComm_t`.
type RawComm = *mut c_void;
/// `cudaStream_t` / `hipStream_t` (the same handle as the driver API's stream).
type RawStream = *mut c_void;

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueIdFn = unsafe extern "C" fn(*mut NcclUniqueId) -> c_int;
type CommInitRankFn = unsafe extern "C" fn(*mut RawComm, c_int, NcclUniqueId, c_int) -> c_int;
type CommDestroyFn = unsafe extern "C" fn(RawComm) -> c_int;
type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> c_int;
type AllGatherFn =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> c_int;
type ReduceScatterFn = AllReduceFn;
type BroadcastFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> c_int;
/// `ncclReduce(send, recv, count, type, op, root, comm, stream)`.
type ReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> c_int;
type SendFn = unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> c_int;
type RecvFn = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> c_int;
type GroupFn = unsafe extern "C" fn() -> c_int;
type GetErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type GetLastErrorFn = unsafe extern "C" fn(RawComm) -> *const c_char;

struct Api {
    get_version: GetVersionFn,
    get_unique_id: GetUniqueIdFn,
    comm_init_rank: CommInitRankFn,
    comm_destroy: CommDestroyFn,
    all_reduce: AllReduceFn,
    all_gather: AllGatherFn,
    reduce_scatter: ReduceScatterFn,
    broadcast: BroadcastFn,
    reduce: ReduceFn,
    /// Point-to-point (NCCL 2.7+): the all-to-all, gather and scatter baselines are groups of
    /// sends and receives, as nccl-tests runs them.
    p2p: Option<P2pApi>,
    get_error_string: GetErrorStringFn,
    /// Added in NCCL 2.13; absent from older libraries.
    get_last_error: Option<GetLastErrorFn>,
}

struct P2pApi {
    send: SendFn,
    recv: RecvFn,
    group_start: GroupFn,
    group_end: GroupFn,
}

/// A loaded NCCL/RCCL library. `Send + Sync`: it only holds function pointers.
pub struct Nccl {
    api: Api,
    version: i32,
    location: String,
    // Keeps the function pointers valid; dropped last.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nccl({} from {})", self.version_string(), self.location)
    }
}

/// The files [`Nccl::load`] tries, in order, for an explicit path (or none).
pub fn library_candidates(explicit: Option<&Path>) -> Vec<OsString> {
    match explicit {
        Some(p) if p.is_dir() => DEFAULT_LIBRARIES
            .iter()
            .map(|name| p.join(name).into_os_string())
            .collect(),
        Some(p) => vec![p.as_os_str().to_owned()],
        None => DEFAULT_LIBRARIES.iter().map(OsString::from).collect(),
    }
}

/// Decodes `NCCL_VERSION_CODE` to (major, minor, patch): `major*10000 + minor*100 + patch` since
/// NCCL 2.9, `major*1000 + minor*100 + patch` before.
pub fn decode_version(code: i32) -> (i32, i32, i32) {
    if code >= 10_000 {
        (code / 10_000, (code % 10_000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    }
}

/// A rank as NCCL's `int` argument; `what` names it in the error.
fn rank_arg(what: &str, rank: usize) -> Result<c_int> {
    c_int::try_from(rank)
        .map_err(|_| Error::InvalidArgument(format!("{what} {rank} does not fit an int")))
}

fn symbol<T: Copy>(lib: &libloading::Library, location: &str, name: &str) -> Result<T> {
    // SAFETY: every `T` used with this helper is the exact C signature of `name` in nccl.h; the
    // returned pointer stays valid while `lib` (kept in `Nccl`) is loaded.
    let sym = unsafe { lib.get::<T>(name.as_bytes()) }.map_err(|e| Error::BackendUnavailable {
        backend: "nccl".into(),
        reason: format!("{location} has no symbol {name} ({e}); is it an NCCL/RCCL library?"),
    })?;
    Ok(*sym)
}

fn ptr(p: DevicePtr) -> *mut c_void {
    p as usize as *mut c_void
}

fn raw_stream(s: Stream) -> RawStream {
    s.0 as usize as RawStream
}

impl Nccl {
    /// Loads NCCL from `explicit` (`MSCCLPP_NCCL_LIB_PATH`) or the loader path; see the module docs.
    /// Absence is [`Error::BackendUnavailable`] listing each file tried and why it failed.
    pub fn load(explicit: Option<&Path>) -> Result<Nccl> {
        let mut failures = Vec::new();
        for cand in library_candidates(explicit) {
            let shown = cand.to_string_lossy().into_owned();
            // SAFETY: loading NCCL runs its static initialisers, which have no preconditions.
            match unsafe { libloading::Library::new(&cand) } {
                Ok(lib) => return Self::from_library(lib, shown),
                Err(e) => failures.push(format!("{shown}: {e}")),
            }
        }
        let hint = if explicit.is_some() {
            "MSCCLPP_NCCL_LIB_PATH names a file or folder that does not load"
        } else {
            "set MSCCLPP_NCCL_LIB_PATH to the libnccl.so.2 to compare against"
        };
        Err(Error::BackendUnavailable {
            backend: "nccl".into(),
            reason: format!(
                "NCCL/RCCL could not be loaded ({hint}); tried {}",
                failures.join("; ")
            ),
        })
    }

    fn from_library(lib: libloading::Library, location: String) -> Result<Nccl> {
        let loc = location.as_str();
        let api = Api {
            get_version: symbol(&lib, loc, "ncclGetVersion")?,
            get_unique_id: symbol(&lib, loc, "ncclGetUniqueId")?,
            comm_init_rank: symbol(&lib, loc, "ncclCommInitRank")?,
            comm_destroy: symbol(&lib, loc, "ncclCommDestroy")?,
            all_reduce: symbol(&lib, loc, "ncclAllReduce")?,
            all_gather: symbol(&lib, loc, "ncclAllGather")?,
            reduce_scatter: symbol(&lib, loc, "ncclReduceScatter")?,
            broadcast: symbol(&lib, loc, "ncclBroadcast")?,
            reduce: symbol(&lib, loc, "ncclReduce")?,
            p2p: (|| -> Result<P2pApi> {
                Ok(P2pApi {
                    send: symbol(&lib, loc, "ncclSend")?,
                    recv: symbol(&lib, loc, "ncclRecv")?,
                    group_start: symbol(&lib, loc, "ncclGroupStart")?,
                    group_end: symbol(&lib, loc, "ncclGroupEnd")?,
                })
            })()
            .ok(),
            get_error_string: symbol(&lib, loc, "ncclGetErrorString")?,
            get_last_error: symbol(&lib, loc, "ncclGetLastError").ok(),
        };
        let mut nccl = Nccl {
            api,
            version: 0,
            location,
            _lib: lib,
        };
        let mut version: c_int = 0;
        // SAFETY: ncclGetVersion writes one int.
        let r = unsafe { (nccl.api.get_version)(&mut version) };
        nccl.check("ncclGetVersion", r, None)?;
        nccl.version = version;
        Ok(nccl)
    }

    /// `2.28.9`.
    pub fn version_string(&self) -> String {
        let (a, b, c) = decode_version(self.version);
        format!("{a}.{b}.{c}")
    }

    /// The file (or loader name) the library was loaded from.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// Whether this NCCL has `dtype` at all (fp8 arrived in NCCL 2.24). Which GPUs run it is
    /// NCCL's business: an unsupported combination comes back as an error from the call.
    pub fn supports(&self, dtype: DataType) -> bool {
        match dtype.to_nccl() {
            None => false,
            Some(_) if dtype.is_fp8() => decode_version(self.version) >= (2, 24, 0),
            Some(_) => true,
        }
    }

    fn error_string(&self, code: c_int) -> String {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let p = unsafe { (self.api.get_error_string)(code) };
        if p.is_null() {
            return format!("unknown ncclResult_t {code}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn last_error(&self, comm: RawComm) -> Option<String> {
        let f = self.api.get_last_error?;
        // SAFETY: ncclGetLastError accepts a communicator or null and returns a NUL-terminated
        // string owned by NCCL (possibly empty).
        let p = unsafe { f(comm) };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-null and NUL-terminated, valid until the next NCCL call on this thread.
        let s = unsafe { CStr::from_ptr(p) }
            .to_string_lossy()
            .trim()
            .to_string();
        (!s.is_empty()).then_some(s)
    }

    /// Turns an `ncclResult_t` into our error, naming the call and NCCL's message.
    fn check(&self, call: &'static str, code: c_int, comm: Option<RawComm>) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        let mut message = self.error_string(code);
        if let Some(last) = self.last_error(comm.unwrap_or(std::ptr::null_mut())) {
            message = format!("{message}; NCCL says: {last}");
        }
        Err(Error::Driver {
            call,
            code: i64::from(code),
            message,
        })
    }

    /// `ncclGetUniqueId`.
    pub fn unique_id(&self) -> Result<NcclUniqueId> {
        let mut id = NcclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: writes one 128-byte ncclUniqueId.
        let r = unsafe { (self.api.get_unique_id)(&mut id) };
        self.check("ncclGetUniqueId", r, None)?;
        Ok(id)
    }
}

/// One NCCL communicator of this rank; destroyed on drop.
pub struct NcclComm {
    nccl: Arc<Nccl>,
    comm: RawComm,
}

// SAFETY: an ncclComm_t may be used from any thread as long as calls on it are not concurrent;
// `NcclComm` only exposes `&self` methods that the benchmark calls from one thread at a time, and
// moving the handle between threads is allowed by NCCL.
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm({:?})", self.nccl)
    }
}

fn nccl_dtype(dtype: DataType) -> Result<c_int> {
    dtype
        .to_nccl()
        .ok_or_else(|| Error::Unsupported(format!("NCCL has no data type for {dtype}")))
}

impl NcclComm {
    /// Collective over `bootstrap`: rank 0 makes the unique id and broadcasts it (an empty message
    /// means rank 0 failed, and every rank then returns an error instead of waiting in NCCL), then
    /// every rank calls `ncclCommInitRank` on the device current on this thread.
    pub fn init(nccl: Arc<Nccl>, bootstrap: &dyn Bootstrap) -> Result<NcclComm> {
        let (rank, size) = (bootstrap.rank(), bootstrap.size());
        let mine = if rank == 0 {
            Some(nccl.unique_id())
        } else {
            None
        };
        let payload = match &mine {
            Some(Ok(id)) => id.internal.to_vec(),
            _ => Vec::new(),
        };
        let got = bootstrap.broadcast(0, &payload)?;
        if let Some(Err(e)) = mine {
            return Err(e);
        }
        let internal: [u8; UNIQUE_ID_BYTES] = got.as_slice().try_into().map_err(|_| Error::Peer {
            rank: 0,
            message: format!(
                "sent an NCCL unique id of {} bytes instead of {UNIQUE_ID_BYTES} (its ncclGetUniqueId failed)",
                got.len()
            ),
        })?;
        let id = NcclUniqueId { internal };
        let nranks = c_int::try_from(size)
            .map_err(|_| Error::InvalidArgument(format!("{size} ranks do not fit NCCL's int")))?;
        let me = c_int::try_from(rank)
            .map_err(|_| Error::InvalidArgument(format!("rank {rank} does not fit NCCL's int")))?;
        let mut comm: RawComm = std::ptr::null_mut();
        // SAFETY: writes one communicator handle; the id is passed by value as nccl.h declares.
        let r = unsafe { (nccl.api.comm_init_rank)(&mut comm, nranks, id, me) };
        nccl.check("ncclCommInitRank", r, None)?;
        Ok(NcclComm { nccl, comm })
    }

    pub fn nccl(&self) -> &Arc<Nccl> {
        &self.nccl
    }

    /// `ncclAllReduce` of `count` elements.
    pub fn all_reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: Stream,
    ) -> Result<()> {
        let t = nccl_dtype(dtype)?;
        // SAFETY: device buffers of at least `count` elements, owned by the caller, live until the
        // stream has run the call; the communicator is live.
        let r = unsafe {
            (self.nccl.api.all_reduce)(
                ptr(send),
                ptr(recv),
                count,
                t,
                op.to_nccl(),
                self.comm,
                raw_stream(stream),
            )
        };
        self.nccl.check("ncclAllReduce", r, Some(self.comm))
    }

    /// `ncclAllGather`: `send_count` elements per rank, `nranks * send_count` received.
    pub fn all_gather(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        send_count: usize,
        dtype: DataType,
        stream: Stream,
    ) -> Result<()> {
        let t = nccl_dtype(dtype)?;
        // SAFETY: as in `all_reduce`, with `recv` holding nranks * send_count elements.
        let r = unsafe {
            (self.nccl.api.all_gather)(
                ptr(send),
                ptr(recv),
                send_count,
                t,
                self.comm,
                raw_stream(stream),
            )
        };
        self.nccl.check("ncclAllGather", r, Some(self.comm))
    }

    /// `ncclReduceScatter`: `recv_count` elements out per rank, `nranks * recv_count` in.
    pub fn reduce_scatter(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        recv_count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: Stream,
    ) -> Result<()> {
        let t = nccl_dtype(dtype)?;
        // SAFETY: as in `all_reduce`, with `send` holding nranks * recv_count elements.
        let r = unsafe {
            (self.nccl.api.reduce_scatter)(
                ptr(send),
                ptr(recv),
                recv_count,
                t,
                op.to_nccl(),
                self.comm,
                raw_stream(stream),
            )
        };
        self.nccl.check("ncclReduceScatter", r, Some(self.comm))
    }

    /// `ncclBroadcast` of `count` elements from `root`.
    pub fn broadcast(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: Stream,
    ) -> Result<()> {
        let (t, root) = (nccl_dtype(dtype)?, rank_arg("broadcast root", root)?);
        // SAFETY: as in `all_reduce`; `send` is only read on the root.
        let r = unsafe {
            (self.nccl.api.broadcast)(
                ptr(send),
                ptr(recv),
                count,
                t,
                root,
                self.comm,
                raw_stream(stream),
            )
        };
        self.nccl.check("ncclBroadcast", r, Some(self.comm))
    }

    /// `ncclReduce` of `count` elements into `root`'s `recv`.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
        stream: Stream,
    ) -> Result<()> {
        let (t, root) = (nccl_dtype(dtype)?, rank_arg("reduce root", root)?);
        // SAFETY: as in `all_reduce`; `recv` is only written on the root.
        let r = unsafe {
            (self.nccl.api.reduce)(
                ptr(send),
                ptr(recv),
                count,
                t,
                op.to_nccl(),
                root,
                self.comm,
                raw_stream(stream),
            )
        };
        self.nccl.check("ncclReduce", r, Some(self.comm))
    }

    /// nccl-tests' gather (`gather`: every rank sends its `count` elements to `root`, which
    /// receives rank p's into chunk p of `recv`) or scatter (`root` sends chunk p of `send` to
    /// rank p, every rank receives its `count` elements into `recv`), as one group.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_or_scatter(
        &self,
        gather: bool,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        root: usize,
        (rank, nranks): (usize, usize),
        stream: Stream,
    ) -> Result<()> {
        let chunk = (count * dtype.size()) as u64;
        let whole = if gather { recv } else { send };
        let chunks: Vec<(usize, DevicePtr, usize)> = if rank == root {
            (0..nranks)
                .map(|p| (p, whole + p as u64 * chunk, count))
                .collect()
        } else {
            Vec::new()
        };
        if gather {
            self.p2p_group(&[(root, send, count)], &chunks, dtype, stream)
        } else {
            self.p2p_group(&chunks, &[(root, recv, count)], dtype, stream)
        }
    }

    /// All-to-all(-v) of traffic matrix `traffic` (elements, `[src][dst]`) as one group of
    /// `ncclSend`/`ncclRecv`, as PyTorch runs `all_to_all_single` with splits: this rank's parts
    /// packed in rank order in `send` (what it sends each peer) and `recv` (what it receives
    /// from each).
    pub fn all_to_all(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        traffic: &[Vec<usize>],
        rank: usize,
        dtype: DataType,
        stream: Stream,
    ) -> Result<()> {
        let e = dtype.size() as u64;
        let (mut sent, mut got) = (0u64, 0u64);
        let (mut sends, mut recvs) = (Vec::new(), Vec::new());
        for (p, row) in traffic.iter().enumerate() {
            let (out, into) = (traffic[rank][p], row[rank]);
            sends.push((p, send + sent * e, out));
            recvs.push((p, recv + got * e, into));
            sent += out as u64;
            got += into as u64;
        }
        self.p2p_group(&sends, &recvs, dtype, stream)
    }

    /// nccl-tests' `sendrecv`: `count` elements of `send` to rank `to`, and from rank `from` into
    /// `recv`, as one group.
    #[allow(clippy::too_many_arguments)]
    pub fn send_recv(
        &self,
        send: DevicePtr,
        recv: DevicePtr,
        count: usize,
        dtype: DataType,
        to: usize,
        from: usize,
        stream: Stream,
    ) -> Result<()> {
        self.p2p_group(&[(to, send, count)], &[(from, recv, count)], dtype, stream)
    }

    /// One group of `ncclSend`s and `ncclRecv`s, by (peer, buffer, elements).
    fn p2p_group(
        &self,
        sends: &[(usize, DevicePtr, usize)],
        recvs: &[(usize, DevicePtr, usize)],
        dtype: DataType,
        stream: Stream,
    ) -> Result<()> {
        let t = nccl_dtype(dtype)?;
        let p2p = self.nccl.api.p2p.as_ref().ok_or_else(|| {
            Error::Unsupported(format!(
                "NCCL {} has no ncclSend/ncclRecv",
                self.nccl.version_string()
            ))
        })?;
        let peer = |p: usize| rank_arg("peer", p);
        // SAFETY: group calls take no arguments.
        let r = unsafe { (p2p.group_start)() };
        self.nccl.check("ncclGroupStart", r, Some(self.comm))?;
        let mut queued = Ok(());
        for &(p, buf, count) in sends {
            queued = queued.and_then(|()| {
                // SAFETY: `buf` holds `count` elements, owned by the caller and live until the
                // stream has run the group; the communicator is live.
                let r = unsafe {
                    (p2p.send)(ptr(buf), count, t, peer(p)?, self.comm, raw_stream(stream))
                };
                self.nccl.check("ncclSend", r, Some(self.comm))
            });
        }
        for &(p, buf, count) in recvs {
            queued = queued.and_then(|()| {
                // SAFETY: as for the sends.
                let r = unsafe {
                    (p2p.recv)(ptr(buf), count, t, peer(p)?, self.comm, raw_stream(stream))
                };
                self.nccl.check("ncclRecv", r, Some(self.comm))
            });
        }
        // The group must end even when a call failed.
        // SAFETY: as above.
        let r = unsafe { (p2p.group_end)() };
        queued.and_then(|()| self.nccl.check("ncclGroupEnd", r, Some(self.comm)))
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: the communicator was created by ncclCommInitRank and is destroyed once.
        let r = unsafe { (self.nccl.api.comm_destroy)(self.comm) };
        if let Err(e) = self.nccl.check("ncclCommDestroy", r, None) {
            tracing::warn!("destroying the NCCL communicator failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[test]
    fn absent_library_is_a_clear_unavailable_error() {
        let missing = std::env::temp_dir().join("mscclpp-bench-no-such-dir/libnccl.so.2");
        let err = Nccl::load(Some(&missing)).expect_err("no library there");
        assert!(err.is_unavailable(), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("nccl"), "{msg}");
        assert!(msg.contains(&*missing.to_string_lossy()), "{msg}");
        assert!(msg.contains("MSCCLPP_NCCL_LIB_PATH"), "{msg}");
    }

    #[test]
    fn a_library_that_is_not_nccl_is_refused_by_symbol() {
        // libc is always loadable and has none of NCCL's symbols.
        match Nccl::load(Some(Path::new("libc.so.6"))) {
            Err(e) => {
                assert!(e.is_unavailable(), "{e:?}");
                assert!(e.to_string().contains("ncclGetVersion"), "{e}");
            }
            Ok(n) => panic!("libc loaded as NCCL: {n:?}"),
        }
    }

    #[test]
    fn candidates_follow_the_documented_order() {
        let none = library_candidates(None);
        assert_eq!(
            none,
            vec![
                OsString::from("libnccl.so.2"),
                OsString::from("librccl.so.1")
            ]
        );
        let file = library_candidates(Some(Path::new("/opt/nccl/lib/libnccl.so.2")));
        assert_eq!(file, vec![OsString::from("/opt/nccl/lib/libnccl.so.2")]);
        let dir = std::env::temp_dir();
        let in_dir = library_candidates(Some(&dir));
        assert_eq!(in_dir.len(), 2);
        assert!(in_dir[0].to_string_lossy().ends_with("libnccl.so.2"));
    }

    #[rstest]
    #[case(22809, (2, 28, 9))]
    #[case(21903, (2, 19, 3))]
    #[case(2804, (2, 8, 4))]
    fn version_codes(#[case] code: i32, #[case] want: (i32, i32, i32)) {
        assert_eq!(decode_version(code), want);
    }

    #[test]
    fn unique_id_is_128_bytes_by_value() {
        assert_eq!(std::mem::size_of::<NcclUniqueId>(), 128);
        assert_eq!(std::mem::align_of::<NcclUniqueId>(), 1);
    }
}
