//! Bookkeeping for sharing device memory between processes on one host: the import cache and
//! fetching a peer's file descriptor.
//!
//! # Import cache
//! CUDA refuses to open the same legacy IPC handle twice in one process, and mapping the same VMM
//! allocation twice wastes address space, yet connections to one peer often name the same buffer
//! several times. So imports are keyed by what identifies the peer allocation (the handle bytes, or
//! owner pid + the owner's export number + size) and reference-counted; the mapping is undone when
//! the last user closes it.
//!
//! A descriptor number does not identify an allocation over time: the owner closes the descriptor
//! when it frees the allocation, and its next export may get the same number (POSIX hands out the
//! lowest free one), while this process still holds its mapping of the old allocation (another
//! registration of it is alive here, e.g. an execution plan's set-up that saw the old buffer). A key
//! of pid + fd + size would then hand the new buffer's importers the old memory: their writes land
//! where nobody reads, their reads see old data. So every export carries a number its owner never
//! gives twice ([`ExportTable`]), and the key is that number, not the descriptor's.
//!
//! # Exports
//! A VMM allocation is exported once and its descriptor kept open while the allocation lives
//! ([`ExportTable`], by allocation handle), so repeated exports give the same descriptor and the
//! same export number, and importers share one mapping.
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
    /// Exporting pid, its number of the export (never given twice by one process, unlike the
    /// descriptor's: see the module docs), and the mapped size.
    PosixFd {
        pid: u32,
        export: u64,
        reserved: u64,
    },
}

impl ImportKey {
    pub fn of(handle: &IpcMemHandle) -> ImportKey {
        match handle {
            IpcMemHandle::Legacy { bytes, .. } => ImportKey::Legacy(bytes.clone()),
            IpcMemHandle::PosixFd {
                pid,
                reserved,
                export,
                ..
            } => ImportKey::PosixFd {
                pid: *pid,
                export: *export,
                reserved: *reserved,
            },
        }
    }
}

/// A number no other export of this process has, nor, but for a negligible chance, any export of
/// an earlier process that had this pid: counted up (odd numbers) from a random start.
pub fn next_export_number() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static NEXT: OnceLock<AtomicU64> = OnceLock::new();
    NEXT.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(t.as_nanos());
        }
        // Never 0: descriptors without the field (serde's default) must not match a real export.
        AtomicU64::new(h.finish() | 1)
    })
    .fetch_add(2, Ordering::Relaxed)
}

/// The allocation an export was made for: its base and the driver's buffer id (unique per
/// allocation for the process's lifetime), so a handle value the driver reused for another
/// allocation is not taken for the old one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportOwner {
    pub base: u64,
    pub buffer_id: u64,
}

#[derive(Debug)]
struct Exported {
    fd: OwnedFd,
    number: u64,
    owner: Option<ExportOwner>,
}

/// This process's open export descriptors, by allocation (or multicast) handle (see the module
/// docs).
#[derive(Debug, Default)]
pub struct ExportTable {
    by_handle: HashMap<u64, Exported>,
}

impl ExportTable {
    /// The descriptor and export number of `handle`, exported with `export` on first use (or when
    /// the entry under this handle value was made for another allocation than `owner`: the
    /// driver may give a freed allocation's handle value to a new one when the old one was freed
    /// outside this library, say by a framework's allocator; the stale descriptor is closed).
    pub fn get_or_export(
        &mut self,
        handle: u64,
        owner: Option<ExportOwner>,
        export: impl FnOnce() -> Result<OwnedFd>,
    ) -> Result<(i32, u64)> {
        use std::os::fd::AsRawFd;
        if let Some(e) = self.by_handle.get(&handle) {
            if e.owner == owner {
                return Ok((e.fd.as_raw_fd(), e.number));
            }
        }
        let fd = export()?;
        let raw = fd.as_raw_fd();
        let number = next_export_number();
        // Replacing drops (closes) a stale descriptor.
        self.by_handle
            .insert(handle, Exported { fd, number, owner });
        Ok((raw, number))
    }

    /// Closes the descriptor of `handle` (its allocation is being freed).
    pub fn remove(&mut self, handle: u64) {
        self.by_handle.remove(&handle);
    }

    pub fn len(&self) -> usize {
        self.by_handle.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_handle.is_empty()
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
            export: 9,
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

    fn vmm_handle(fd: i32, export: u64) -> IpcMemHandle {
        IpcMemHandle::PosixFd {
            pid: 7,
            fd,
            size: 4096,
            reserved: 2 << 20,
            offset: 512,
            export,
        }
    }

    /// The session-34 failure of the DSL check (#58): a buffer freed, a new one of the same size
    /// exported under the same descriptor number while an importer still held the old mapping. The
    /// new buffer's export must not find the old mapping, whatever the descriptor's number.
    #[test]
    fn a_new_export_under_a_reused_descriptor_number_is_a_new_import() {
        let mut c = ImportCache::default();
        let old = ImportKey::of(&vmm_handle(12, 101));
        c.insert(old.clone(), mapping(0x1000));
        // Still held here (another registration of the old buffer is alive): refs 1.
        let new = ImportKey::of(&vmm_handle(12, 103));
        assert_ne!(old, new);
        assert_eq!(
            c.acquire(&new),
            None,
            "the old allocation's mapping was handed out"
        );
        // The same export, at any offset, shares the mapping.
        let again = IpcMemHandle::PosixFd {
            pid: 7,
            fd: 12,
            size: 64,
            reserved: 2 << 20,
            offset: 0,
            export: 101,
        };
        assert_eq!(c.acquire(&ImportKey::of(&again)), Some(mapping(0x1000)));
    }

    fn dev_null() -> Result<OwnedFd> {
        Ok(OwnedFd::from(std::fs::File::open("/dev/null").unwrap()))
    }

    /// The exporter's side of the same sequence, with real descriptors: export, free (the
    /// descriptor closes), export a new allocation. The number may come back; the export number
    /// must not.
    #[test]
    fn an_export_after_a_free_gets_a_new_number_even_where_its_descriptor_number_is_reused() {
        let mut t = ExportTable::default();
        let a = ExportOwner {
            base: 0x7000_0000,
            buffer_id: 1,
        };
        let (fd_a, n_a) = t.get_or_export(0xa, Some(a), dev_null).unwrap();
        // Repeated exports of one allocation: one descriptor, one number (importers share a
        // mapping).
        let calls = std::cell::Cell::new(0);
        let again = t
            .get_or_export(0xa, Some(a), || {
                calls.set(calls.get() + 1);
                dev_null()
            })
            .unwrap();
        assert_eq!(again, (fd_a, n_a));
        assert_eq!(
            calls.get(),
            0,
            "a second export of one allocation re-exported it"
        );
        t.remove(0xa);
        assert!(t.is_empty());
        let b = ExportOwner {
            base: 0x7000_0000,
            buffer_id: 2,
        };
        let (fd_b, n_b) = t.get_or_export(0xb, Some(b), dev_null).unwrap();
        eprintln!("descriptor {fd_a} then {fd_b} (reused: {})", fd_a == fd_b);
        assert_ne!(n_a, n_b);
        assert_ne!(
            ImportKey::of(&vmm_handle(fd_a, n_a)),
            ImportKey::of(&vmm_handle(fd_b, n_b))
        );
    }

    /// A handle value met again for another allocation (the old one freed outside this library)
    /// is exported anew, not answered with the old allocation's descriptor.
    #[test]
    fn a_handle_value_reused_by_another_allocation_is_exported_anew() {
        let mut t = ExportTable::default();
        let owner = |buffer_id| ExportOwner {
            base: 0x9000_0000,
            buffer_id,
        };
        let (_, first) = t.get_or_export(0xc, Some(owner(5)), dev_null).unwrap();
        let calls = std::cell::Cell::new(0);
        let (_, second) = t
            .get_or_export(0xc, Some(owner(6)), || {
                calls.set(calls.get() + 1);
                dev_null()
            })
            .unwrap();
        assert_eq!(calls.get(), 1);
        assert_ne!(first, second);
        assert_eq!(t.len(), 1, "the stale descriptor was kept");
    }

    #[test]
    fn export_numbers_are_never_zero_nor_repeated() {
        let numbers: std::collections::HashSet<u64> =
            (0..1000).map(|_| next_export_number()).collect();
        assert_eq!(numbers.len(), 1000);
        assert!(!numbers.contains(&0));
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
