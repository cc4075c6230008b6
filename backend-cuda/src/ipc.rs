//! Bookkeeping for sharing device memory between processes on one host: the import cache and
//! fetching a peer's file descriptor.
//!
//! # Import cache
//! CUDA refuses to open the same legacy IPC handle twice in one process, and mapping the same VMM
//! allocation twice wastes address space, yet connections to one peer often name the same buffer
//! several times. So imports are keyed by what identifies the peer allocation (the handle bytes, or
//! owner pid + fd + size) and reference-counted; the mapping is undone when the last user closes it.
//!
//! # Descriptors (`pidfd_getfd`)
//! A VMM allocation is exported as a POSIX file descriptor that lives in the exporting process. The
//! importer copies it with `pidfd_open(pid)` + `pidfd_getfd(pidfd, fd)` (Linux >= 5.6). The kernel
//! allows this only with ptrace access to the exporter (`PTRACE_MODE_ATTACH_REALCREDS`): the same
//! user and `/proc/sys/kernel/yama/ptrace_scope` = 0, or `CAP_SYS_PTRACE` (containers may need
//! `--cap-add SYS_PTRACE`). Otherwise the call fails with EPERM and we say so.

use mscclpp_core::gpu::IpcMemHandle;
use mscclpp_core::{Error, Result};
use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd};

/// What identifies one peer allocation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ImportKey {
    /// The 64 legacy IPC handle bytes (they name the whole allocation, whatever the offset).
    Legacy(Vec<u8>),
    /// Exporting pid, its descriptor number, and the mapped size. The exporter keeps the
    /// descriptor open for the allocation's lifetime, so the number is not reused while it matters.
    PosixFd { pid: u32, fd: i32, reserved: u64 },
}

impl ImportKey {
    pub fn of(handle: &IpcMemHandle) -> ImportKey {
        match handle {
            IpcMemHandle::Legacy { bytes, .. } => ImportKey::Legacy(bytes.clone()),
            IpcMemHandle::PosixFd {
                pid, fd, reserved, ..
            } => ImportKey::PosixFd {
                pid: *pid,
                fd: *fd,
                reserved: *reserved,
            },
        }
    }
}

/// A live mapping of a peer allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    /// Base address of the mapped allocation in this process.
    pub base: u64,
    /// VMM allocation handle (0 for legacy).
    pub handle: u64,
    /// Mapped bytes (VMM) or 0 (legacy: the driver tracks it).
    pub reserved: usize,
    pub legacy: bool,
}

#[derive(Debug)]
struct Entry {
    mapping: Mapping,
    refs: usize,
}

/// Reference-counted imports, keyed by [`ImportKey`] and findable by base address.
#[derive(Debug, Default)]
pub struct ImportCache {
    by_key: HashMap<ImportKey, Entry>,
    key_of_base: HashMap<u64, ImportKey>,
}

impl ImportCache {
    /// The existing mapping for `key`, with its reference count raised.
    pub fn acquire(&mut self, key: &ImportKey) -> Option<Mapping> {
        let e = self.by_key.get_mut(key)?;
        e.refs += 1;
        Some(e.mapping)
    }

    /// Records a fresh mapping with one reference.
    pub fn insert(&mut self, key: ImportKey, mapping: Mapping) {
        self.key_of_base.insert(mapping.base, key.clone());
        self.by_key.insert(key, Entry { mapping, refs: 1 });
    }

    /// Drops one reference to the mapping at `base`. Returns the mapping when this was the last
    /// reference (the caller unmaps it), `None` while others still use it.
    pub fn release(&mut self, base: u64) -> Result<Option<Mapping>> {
        let key = self.key_of_base.get(&base).cloned().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "device address {base:#x} is not an imported peer buffer (closed twice?)"
            ))
        })?;
        let entry = self
            .by_key
            .get_mut(&key)
            .ok_or_else(|| Error::Internal(format!("import cache lost the entry of {base:#x}")))?;
        entry.refs -= 1;
        if entry.refs > 0 {
            return Ok(None);
        }
        let mapping = entry.mapping;
        self.by_key.remove(&key);
        self.key_of_base.remove(&base);
        Ok(Some(mapping))
    }

    /// References held on the mapping at `base` (0 when unknown).
    pub fn refs(&self, base: u64) -> usize {
        self.key_of_base
            .get(&base)
            .and_then(|k| self.by_key.get(k))
            .map_or(0, |e| e.refs)
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

/// Duplicates descriptor `fd` of process `pid` into this process (see the module docs for the
/// permission this needs).
pub fn fetch_peer_fd(pid: u32, fd: i32) -> Result<OwnedFd> {
    let pid_t = libc::pid_t::try_from(pid)
        .map_err(|_| Error::InvalidArgument(format!("peer pid {pid} is out of range")))?;
    // SAFETY: plain syscall with integer arguments.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid_t, 0) };
    if pidfd < 0 {
        let e = std::io::Error::last_os_error();
        let hint = match e.raw_os_error() {
            Some(libc::ESRCH) => "the exporting process has exited",
            Some(libc::ENOSYS) => "pidfd_open needs Linux >= 5.3",
            _ => "",
        };
        return Err(Error::io(format!("pidfd_open({pid}) {hint}"), e));
    }
    // SAFETY: pidfd_open returned a new descriptor that we own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    use std::os::fd::AsRawFd;
    // SAFETY: plain syscall with integer arguments.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        let e = std::io::Error::last_os_error();
        let hint = match e.raw_os_error() {
            Some(libc::EPERM) => {
                "permission denied: copying a peer's descriptor needs ptrace access to it (same \
                 user with kernel.yama.ptrace_scope=0, or CAP_SYS_PTRACE; in containers add \
                 --cap-add SYS_PTRACE)"
            }
            Some(libc::EBADF) => "the exporter no longer has that descriptor open",
            Some(libc::ENOSYS) => "pidfd_getfd needs Linux >= 5.6",
            _ => "",
        };
        return Err(Error::io(
            format!("pidfd_getfd(pid {pid}, fd {fd}): {hint}"),
            e,
        ));
    }
    // SAFETY: pidfd_getfd returned a new descriptor that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(got as i32) })
}

/// Whether this process may copy its peers' descriptors (module docs), decided once: the
/// syscalls work here (kernel >= 5.6, not filtered by seccomp: tried on a descriptor of our own),
/// and Yama lets a process attach to a non-descendant of the same user (no Yama, or
/// `ptrace_scope` 0), or this process holds CAP_SYS_PTRACE. Peers run as the same user and under
/// the same sysctl, so the answer holds for them too.
pub fn peer_descriptors_copyable() -> bool {
    static COPYABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *COPYABLE.get_or_init(|| {
        let syscalls_work = std::fs::File::open("/dev/null").is_ok_and(|f| {
            use std::os::fd::AsRawFd;
            fetch_peer_fd(std::process::id(), f.as_raw_fd()).is_ok()
        });
        let yama_allows = match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
            Ok(scope) => scope.trim() == "0",
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        };
        syscalls_work && (yama_allows || holds_cap_sys_ptrace())
    })
}

/// CAP_SYS_PTRACE (bit 19) in this process's effective capabilities.
fn holds_cap_sys_ptrace() -> bool {
    const CAP_SYS_PTRACE: u32 = 19;
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .is_some_and(|caps| caps & (1 << CAP_SYS_PTRACE) != 0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn mapping(base: u64) -> Mapping {
        Mapping {
            base,
            handle: 5,
            reserved: 1 << 21,
            legacy: false,
        }
    }

    #[test]
    fn second_import_reuses_and_last_close_unmaps() {
        let mut c = ImportCache::default();
        let key = ImportKey::PosixFd {
            pid: 1,
            fd: 9,
            reserved: 1 << 21,
        };
        assert_eq!(c.acquire(&key), None);
        c.insert(key.clone(), mapping(0x1000));
        assert_eq!(c.acquire(&key), Some(mapping(0x1000)));
        assert_eq!(c.refs(0x1000), 2);
        assert_eq!(c.release(0x1000).unwrap(), None);
        assert_eq!(c.release(0x1000).unwrap(), Some(mapping(0x1000)));
        assert!(c.is_empty());
        assert!(matches!(c.release(0x1000), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn legacy_key_ignores_offset() {
        let h = |offset| IpcMemHandle::Legacy {
            bytes: vec![1; 64],
            offset,
            size: 8,
        };
        assert_eq!(ImportKey::of(&h(0)), ImportKey::of(&h(4096)));
    }

    #[test]
    fn fetch_own_fd_works_or_names_permission() {
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        match fetch_peer_fd(std::process::id(), file.as_raw_fd()) {
            Ok(fd) => assert_ne!(fd.as_raw_fd(), file.as_raw_fd()),
            // Old kernels or seccomp sandboxes: the message must say what failed.
            Err(e) => assert!(e.to_string().contains("pidfd"), "{e}"),
        }
    }

    /// Where the syscalls fail (old kernel, seccomp), VMM must not be chosen for shared buffers.
    #[test]
    fn descriptors_are_not_copyable_where_the_syscalls_fail() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let syscalls_work = fetch_peer_fd(std::process::id(), file.as_raw_fd()).is_ok();
        eprintln!(
            "pidfd_getfd works: {syscalls_work}; peers' descriptors copyable: {}",
            peer_descriptors_copyable()
        );
        assert!(syscalls_work || !peer_descriptors_copyable());
    }

    #[test]
    fn fetch_from_missing_process_is_clear() {
        // pid_max is at most 2^22 on Linux, so this pid cannot exist.
        let err = fetch_peer_fd((1 << 22) + 1, 3).unwrap_err();
        assert!(err.to_string().contains("pidfd_open"), "{err}");
    }
}
