//! libibverbs, loaded at run time.
//!
//! Linking libibverbs would make every mscclpp binary fail to start on hosts without rdma-core, so the
//! library is opened with `dlopen` (libloading) when IB is first asked for: `MSCCLPP_IBV_SO` if set
//! (and then only that file: the user chose it), else `libibverbs.so.1`, then `libibverbs.so`.
//!
//! Three verbs are not exported: `ibv_poll_cq`, `ibv_post_send` and `ibv_post_recv` are inline
//! functions in verbs.h that call through the context's ops table; `Verbs::poll_cq` and friends do
//! the same through the `#[repr(C)]` mirrors in [`crate::ffi`]. `ibv_query_port` is a macro in
//! current headers; its exported symbol takes the older, shorter port-attribute layout, which
//! [`crate::ffi::IbvPortAttr`] covers.

use crate::ffi::*;
use libloading::Library;
use mscclpp_core::env::Env;
use mscclpp_core::{Error, Result};
use std::ffi::{c_char, c_void, CStr};
use std::os::raw::c_int;
use std::path::PathBuf;

/// Names tried, in order, when `MSCCLPP_IBV_SO` is not set.
pub const DEFAULT_LIBRARY_NAMES: [&str; 2] = ["libibverbs.so.1", "libibverbs.so"];

type RegMrFn = unsafe extern "C" fn(*mut IbvPd, *mut c_void, usize, c_int) -> *mut IbvMr;
type RegMrIova2Fn = unsafe extern "C" fn(*mut IbvPd, *mut c_void, usize, u64, u32) -> *mut IbvMr;

/// `ibv_reg_mr` is a macro in recent headers; the plain exported symbol has existed since
/// IBVERBS_1.1, `ibv_reg_mr_iova2` since rdma-core 22. Either registers the same way here.
#[derive(Clone, Copy)]
enum RegMr {
    Plain(RegMrFn),
    Iova2(RegMrIova2Fn),
}

/// The exported verbs this crate calls, resolved once.
pub struct Verbs {
    pub(crate) get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut IbvDevice,
    pub(crate) free_device_list: unsafe extern "C" fn(*mut *mut IbvDevice),
    pub(crate) get_device_name: unsafe extern "C" fn(*mut IbvDevice) -> *const c_char,
    pub(crate) open_device: unsafe extern "C" fn(*mut IbvDevice) -> *mut IbvContext,
    pub(crate) close_device: unsafe extern "C" fn(*mut IbvContext) -> c_int,
    pub(crate) query_device: unsafe extern "C" fn(*mut IbvContext, *mut IbvDeviceAttr) -> c_int,
    pub(crate) query_port: unsafe extern "C" fn(*mut IbvContext, u8, *mut IbvPortAttr) -> c_int,
    pub(crate) query_gid: unsafe extern "C" fn(*mut IbvContext, u8, c_int, *mut IbvGid) -> c_int,
    pub(crate) alloc_pd: unsafe extern "C" fn(*mut IbvContext) -> *mut IbvPd,
    pub(crate) dealloc_pd: unsafe extern "C" fn(*mut IbvPd) -> c_int,
    reg_mr: RegMr,
    pub(crate) dereg_mr: unsafe extern "C" fn(*mut IbvMr) -> c_int,
    pub(crate) create_cq:
        unsafe extern "C" fn(*mut IbvContext, c_int, *mut c_void, *mut c_void, c_int) -> *mut IbvCq,
    pub(crate) destroy_cq: unsafe extern "C" fn(*mut IbvCq) -> c_int,
    pub(crate) create_qp: unsafe extern "C" fn(*mut IbvPd, *mut IbvQpInitAttr) -> *mut IbvQp,
    pub(crate) destroy_qp: unsafe extern "C" fn(*mut IbvQp) -> c_int,
    pub(crate) modify_qp: unsafe extern "C" fn(*mut IbvQp, *mut IbvQpAttr, c_int) -> c_int,
    path: String,
    // Declared last so it is dropped last: the function pointers above point into it.
    _library: Library,
}

impl std::fmt::Debug for Verbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Verbs({})", self.path)
    }
}

/// An error and its cause: libloading's `DlOpen` displays as "dlopen failed" and keeps the loader's
/// own message (which file was missing, or why it did not load) as its source.
fn with_source(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

/// Resolves `name` (or, failing that, `fallback`) to a function pointer of type `T`.
///
/// # Safety
/// `T` must be the `extern "C"` signature the library gives the symbol.
unsafe fn symbol<T: Copy>(lib: &Library, path: &str, names: &[&str]) -> Result<T> {
    let mut last = String::new();
    for name in names {
        // SAFETY: the caller guarantees `T` matches the symbol's C signature.
        match unsafe { lib.get::<T>(name.as_bytes()) } {
            Ok(sym) => return Ok(*sym),
            Err(e) => last = with_source(&e),
        }
    }
    Err(Error::IbUnavailable(format!(
        "{path} does not export {} ({last}); it is not libibverbs, or an rdma-core too old for \
         mscclpp-rs (set MSCCLPP_IBV_SO to a libibverbs.so.1 from rdma-core 22 or newer)",
        names.join(" or ")
    )))
}

impl Verbs {
    /// Opens libibverbs as the module docs describe. Every failure is `Error::IbUnavailable`
    /// naming each file tried and the loader's reason.
    pub fn load(env: &Env) -> Result<Verbs> {
        let candidates: Vec<PathBuf> = match &env.ibv_so {
            Some(p) => vec![p.clone()],
            None => DEFAULT_LIBRARY_NAMES.iter().map(PathBuf::from).collect(),
        };
        let mut tried = Vec::new();
        for candidate in &candidates {
            // SAFETY: loading runs the library's initialisers; libibverbs' only read the
            // environment and its provider directory.
            match unsafe { Library::new(candidate) } {
                Ok(lib) => {
                    let path = candidate.display().to_string();
                    return Self::resolve(lib, path);
                }
                Err(e) => tried.push(format!("{}: {}", candidate.display(), with_source(&e))),
            }
        }
        let hint = if env.ibv_so.is_some() {
            "check MSCCLPP_IBV_SO"
        } else {
            "install rdma-core's libibverbs (Debian/Ubuntu: libibverbs1) or set MSCCLPP_IBV_SO"
        };
        Err(Error::IbUnavailable(format!(
            "libibverbs could not be loaded ({hint}); tried {}",
            tried.join("; ")
        )))
    }

    fn resolve(lib: Library, path: String) -> Result<Verbs> {
        let p = path.as_str();
        // SAFETY (all `symbol` calls): each type is the prototype from verbs.h for that name;
        // `ibv_query_port` is the exported compat symbol, which takes a shorter struct than
        // `IbvPortAttr` (see ffi.rs), so passing the larger one is sound.
        unsafe {
            let reg_mr = match symbol::<RegMrFn>(&lib, p, &["ibv_reg_mr"]) {
                Ok(f) => RegMr::Plain(f),
                Err(_) => RegMr::Iova2(symbol::<RegMrIova2Fn>(&lib, p, &["ibv_reg_mr_iova2"])?),
            };
            Ok(Verbs {
                get_device_list: symbol(&lib, p, &["ibv_get_device_list"])?,
                free_device_list: symbol(&lib, p, &["ibv_free_device_list"])?,
                get_device_name: symbol(&lib, p, &["ibv_get_device_name"])?,
                open_device: symbol(&lib, p, &["ibv_open_device"])?,
                close_device: symbol(&lib, p, &["ibv_close_device"])?,
                query_device: symbol(&lib, p, &["ibv_query_device"])?,
                query_port: symbol(&lib, p, &["ibv_query_port", "_ibv_query_port"])?,
                query_gid: symbol(&lib, p, &["ibv_query_gid"])?,
                alloc_pd: symbol(&lib, p, &["ibv_alloc_pd"])?,
                dealloc_pd: symbol(&lib, p, &["ibv_dealloc_pd"])?,
                reg_mr,
                dereg_mr: symbol(&lib, p, &["ibv_dereg_mr"])?,
                create_cq: symbol(&lib, p, &["ibv_create_cq"])?,
                destroy_cq: symbol(&lib, p, &["ibv_destroy_cq"])?,
                create_qp: symbol(&lib, p, &["ibv_create_qp"])?,
                destroy_qp: symbol(&lib, p, &["ibv_destroy_qp"])?,
                modify_qp: symbol(&lib, p, &["ibv_modify_qp"])?,
                path,
                _library: lib,
            })
        }
    }

    /// The file the verbs were loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Names of the RDMA devices libibverbs sees, in its order.
    pub fn device_names(&self) -> Result<Vec<String>> {
        let list = DeviceList::get(self)?;
        Ok(list.iter().map(|(name, _)| name).collect())
    }

    /// `ibv_reg_mr` through whichever exported symbol this library has.
    ///
    /// # Safety
    /// `pd` must be a live protection domain of this library, and `addr..addr+len` memory the HCA
    /// may access until the returned MR is deregistered.
    pub(crate) unsafe fn reg_mr(
        &self,
        pd: *mut IbvPd,
        addr: *mut c_void,
        len: usize,
        access: u32,
    ) -> *mut IbvMr {
        // SAFETY: forwarded under the caller's contract. Access flags are small positive bits.
        unsafe {
            match self.reg_mr {
                RegMr::Plain(f) => f(pd, addr, len, access as c_int),
                RegMr::Iova2(f) => f(pd, addr, len, addr as u64, access),
            }
        }
    }

    /// verbs.h's inline `ibv_poll_cq`. Returns the number of completions or a negative value.
    ///
    /// # Safety
    /// `cq` must be a live CQ created by this library and `wc` must hold `wc.len()` entries.
    pub(crate) unsafe fn poll_cq(&self, cq: *mut IbvCq, wc: &mut [IbvWc]) -> Result<usize> {
        // SAFETY: the caller guarantees `cq` is live, so its context and ops table are too.
        let op = unsafe { (*(*cq).context).ops.poll_cq };
        let op = op.ok_or_else(|| {
            Error::Internal("the provider's ops table has no poll_cq entry".into())
        })?;
        let n = c_int::try_from(wc.len()).unwrap_or(c_int::MAX);
        // SAFETY: `wc` holds at least `n` entries.
        let got = unsafe { op(cq, n, wc.as_mut_ptr()) };
        usize::try_from(got).map_err(|_| Error::Driver {
            call: "ibv_poll_cq",
            code: i64::from(got),
            message: "the completion queue is in an error state".into(),
        })
    }

    /// verbs.h's inline `ibv_post_send`; returns the provider's errno-style code (0 = posted).
    ///
    /// # Safety
    /// `qp` must be a live QP of this library; `wr` and everything it points to must be valid.
    pub(crate) unsafe fn post_send(&self, qp: *mut IbvQp, wr: &mut IbvSendWr) -> c_int {
        let mut bad: *mut IbvSendWr = std::ptr::null_mut();
        // SAFETY: as the caller guarantees; a missing entry is reported as ENOSYS.
        unsafe {
            match (*(*qp).context).ops.post_send {
                Some(op) => op(qp, wr, &mut bad),
                None => libc::ENOSYS,
            }
        }
    }

    /// verbs.h's inline `ibv_post_recv`; returns the provider's errno-style code (0 = posted).
    ///
    /// # Safety
    /// As [`Verbs::post_send`].
    pub(crate) unsafe fn post_recv(&self, qp: *mut IbvQp, wr: &mut IbvRecvWr) -> c_int {
        let mut bad: *mut IbvRecvWr = std::ptr::null_mut();
        // SAFETY: as the caller guarantees; a missing entry is reported as ENOSYS.
        unsafe {
            match (*(*qp).context).ops.post_recv {
                Some(op) => op(qp, wr, &mut bad),
                None => libc::ENOSYS,
            }
        }
    }
}

/// The array from `ibv_get_device_list`, freed on drop (null and empty when the kernel has no RDMA
/// support). Devices opened from it stay valid after.
pub(crate) struct DeviceList<'a> {
    verbs: &'a Verbs,
    list: *mut *mut IbvDevice,
    len: usize,
}

impl<'a> DeviceList<'a> {
    pub(crate) fn get(verbs: &'a Verbs) -> Result<Self> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer.
        let list = unsafe { (verbs.get_device_list)(&mut n) };
        if list.is_null() {
            let e = std::io::Error::last_os_error();
            // rdma-core answers ENOSYS when the kernel has no RDMA support at all (no
            // /sys/class/infiniband_verbs): for the caller that is simply "no device".
            if e.raw_os_error() == Some(libc::ENOSYS) {
                tracing::debug!(target: mscclpp_core::log::target::NET,
                    "ibv_get_device_list: {e}; treating the host as having no RDMA device");
                return Ok(DeviceList {
                    verbs,
                    list,
                    len: 0,
                });
            }
            return Err(Error::Driver {
                call: "ibv_get_device_list",
                code: i64::from(e.raw_os_error().unwrap_or(0)),
                message: format!("{e} (is the ib_uverbs kernel module loaded?)"),
            });
        }
        Ok(DeviceList {
            verbs,
            list,
            len: usize::try_from(n).unwrap_or(0),
        })
    }

    /// `(name, device)` pairs.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (String, *mut IbvDevice)> + '_ {
        (0..self.len).filter_map(move |i| {
            // SAFETY: the list holds `len` device pointers while `self` lives.
            let dev = unsafe { *self.list.add(i) };
            if dev.is_null() {
                return None;
            }
            // SAFETY: `dev` is a device of the list; the name is a NUL-terminated string it owns.
            let name = unsafe { (self.verbs.get_device_name)(dev) };
            let name = if name.is_null() {
                format!("<unnamed device {i}>")
            } else {
                // SAFETY: non-null, NUL-terminated, valid while the list lives.
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned()
            };
            Some((name, dev))
        })
    }
}

impl Drop for DeviceList<'_> {
    fn drop(&mut self) {
        if !self.list.is_null() {
            // SAFETY: `list` came from ibv_get_device_list and is freed exactly once.
            unsafe { (self.verbs.free_device_list)(self.list) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Env {
        Env::from_vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string()))).unwrap()
    }

    #[test]
    fn missing_library_names_the_path() {
        let e =
            Verbs::load(&env(&[("MSCCLPP_IBV_SO", "/nonexistent/libibverbs.so.1")])).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::IbUnavailable(_)), "{e:?}");
        assert!(
            msg.contains("/nonexistent/libibverbs.so.1") && msg.contains("MSCCLPP_IBV_SO"),
            "{msg}"
        );
    }

    /// A real shared library that is not libibverbs: the error names the first missing verb.
    #[test]
    fn library_without_verbs_names_the_symbol() {
        let libc_path = [
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/lib/aarch64-linux-gnu/libc.so.6",
            "/lib64/libc.so.6",
            "/usr/lib/libc.so.6",
        ]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
        let Some(libc_path) = libc_path else {
            eprintln!("skipping: no libc.so.6 at a known path to stand in for a non-verbs library");
            return;
        };
        let e = Verbs::load(&env(&[("MSCCLPP_IBV_SO", libc_path)])).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::IbUnavailable(_)), "{e:?}");
        assert!(msg.contains(libc_path) && msg.contains("ibv_"), "{msg}");
    }

    #[test]
    fn default_search_reports_every_name_or_loads() {
        match Verbs::load(&env(&[])) {
            Ok(v) => eprintln!("libibverbs present here: {}", v.path()),
            Err(e) => {
                let msg = e.to_string();
                for name in DEFAULT_LIBRARY_NAMES {
                    assert!(msg.contains(name), "{msg}");
                }
            }
        }
    }
}
