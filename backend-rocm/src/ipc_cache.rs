//! Reference counting and an LRU bound for opened IPC memory handles.
//!
//! HIP (unlike CUDA) does not reference-count `hipIpcOpenMemHandle`: opening one handle twice
//! either fails or returns the same mapping, and a single `hipIpcCloseMemHandle` unmaps it for
//! every user. Two connections to one peer buffer would then break each other. The cache opens
//! each handle once, hands out the same base pointer to every importer, and counts them.
//!
//! Every opened mapping costs the process entries in its memory map, which the kernel bounds by
//! `vm.max_map_count`; a long-lived process that connects to many peer buffers would run into it.
//! So the cache itself holds one reference to each mapping it keeps: when the last importer lets
//! go, the mapping stays open (idle) for the next import of the same handle, and is closed when
//! its last reference goes: the importer's, or the cache's when it evicts the least recently used
//! idle mapping to stay within [`IpcCache::limit`] (see [`limit_from_max_map_count`]). Mappings in
//! use are never evicted; a new open beyond the limit with none idle is refused with an error that
//! names the limit.

use mscclpp_core::{Error, Result};
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;

/// Where Linux publishes the per-process limit on memory-map entries.
pub const MAX_MAP_COUNT_PATH: &str = "/proc/sys/vm/max_map_count";

/// Linux's default `vm.max_map_count`, used when the file cannot be read.
pub const DEFAULT_MAX_MAP_COUNT: u64 = 65530;

/// How many open IPC mappings to allow for a `vm.max_map_count` of `max_map_count`: one eighth of
/// it (a mapping of device memory takes a few map entries, and the rest of the process, its
/// allocator, libraries and the GPU runtime need the remainder), at least 16.
pub fn limit_from_max_map_count(max_map_count: u64) -> usize {
    usize::try_from(max_map_count / 8)
        .unwrap_or(usize::MAX)
        .max(16)
}

/// The limit for this machine, from [`MAX_MAP_COUNT_PATH`].
pub fn system_limit() -> usize {
    let max = std::fs::read_to_string(MAX_MAP_COUNT_PATH)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(DEFAULT_MAX_MAP_COUNT);
    limit_from_max_map_count(max)
}

struct Entry<K> {
    key: K,
    /// Importers holding the mapping (the cache's own reference is implicit while it is listed).
    refs: usize,
    /// Recency stamp: larger is more recent.
    used: u64,
}

/// Maps handle bytes (`K`) to an opened base pointer, counting users.
pub struct IpcCache<K> {
    inner: Mutex<Inner<K>>,
    limit: usize,
}

struct Inner<K> {
    by_key: HashMap<K, u64>,
    by_ptr: HashMap<u64, Entry<K>>,
    clock: u64,
}

impl<K: Hash + Eq + Clone> IpcCache<K> {
    /// A cache that keeps at most `limit` mappings open (at least 1).
    pub fn new(limit: usize) -> Self {
        IpcCache {
            inner: Mutex::new(Inner {
                by_key: HashMap::new(),
                by_ptr: HashMap::new(),
                clock: 0,
            }),
            limit: limit.max(1),
        }
    }

    /// The most mappings kept open at once.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The base pointer for `key`, calling `open` only if the cache does not hold it. Making room
    /// closes least recently used idle mappings with `close`. The lock is held across `open` so
    /// two threads importing the same handle cannot both open it.
    pub fn acquire(
        &self,
        key: &K,
        open: impl FnOnce() -> Result<u64>,
        close: impl FnMut(u64) -> Result<()>,
    ) -> Result<u64> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.clock += 1;
        let now = inner.clock;
        if let Some(&ptr) = inner.by_key.get(key) {
            if let Some(e) = inner.by_ptr.get_mut(&ptr) {
                e.refs += 1;
                e.used = now;
                return Ok(ptr);
            }
        }
        Self::evict_to(&mut inner, self.limit - 1, close)?;
        if inner.by_ptr.len() >= self.limit {
            return Err(Error::Unsupported(format!(
                "cannot open another IPC memory handle: all {} mappings the cache allows are in \
                 use (the limit is vm.max_map_count / 8; raise vm.max_map_count to allow more)",
                self.limit
            )));
        }
        let ptr = open()?;
        inner.by_key.insert(key.clone(), ptr);
        inner.by_ptr.insert(
            ptr,
            Entry {
                key: key.clone(),
                refs: 1,
                used: now,
            },
        );
        Ok(ptr)
    }

    /// Closes least recently used idle mappings until at most `keep` are open (or none is idle).
    /// Stops at the first failing close, having forgotten that mapping (its state is unknown, and
    /// closing it again could unmap someone else's later mapping at the same address).
    fn evict_to(
        inner: &mut Inner<K>,
        keep: usize,
        mut close: impl FnMut(u64) -> Result<()>,
    ) -> Result<()> {
        while inner.by_ptr.len() > keep {
            let Some(ptr) = inner
                .by_ptr
                .iter()
                .filter(|(_, e)| e.refs == 0)
                .min_by_key(|(_, e)| e.used)
                .map(|(&p, _)| p)
            else {
                return Ok(());
            };
            if let Some(e) = inner.by_ptr.remove(&ptr) {
                inner.by_key.remove(&e.key);
            }
            close(ptr)?;
        }
        Ok(())
    }

    /// Drops one importer of `ptr`. The mapping stays open (idle, reusable) until the LRU bound
    /// needs its place or [`IpcCache::close_idle`] runs.
    pub fn release(&self, ptr: u64) -> Result<()> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        match inner.by_ptr.get_mut(&ptr) {
            Some(entry) if entry.refs > 0 => {
                entry.refs -= 1;
                Ok(())
            }
            _ => Err(Error::InvalidArgument(format!(
                "closing imported memory at {ptr:#x}: it was not opened through this backend, or \
                 was already closed"
            ))),
        }
    }

    /// Closes every idle mapping (the cache's references), e.g. when the backend shuts down.
    pub fn close_idle(&self, close: impl FnMut(u64) -> Result<()>) -> Result<()> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        Self::evict_to(&mut inner, 0, close)
    }

    /// How many importers hold `ptr` (0 when idle or not open).
    pub fn refs(&self, ptr: u64) -> usize {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.by_ptr.get(&ptr).map_or(0, |e| e.refs)
    }

    /// How many mappings are open (in use or idle).
    pub fn open_count(&self) -> usize {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.by_ptr.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};

    fn no_close(_: u64) -> Result<()> {
        panic!("nothing should be closed here")
    }

    #[test]
    fn opens_once_and_closes_after_the_last_drop_when_room_is_needed() {
        let cache = IpcCache::<Vec<u8>>::new(1);
        let opens = Cell::new(0);
        let closed = RefCell::new(Vec::new());
        let open = |p: u64| {
            let opens = &opens;
            move || {
                opens.set(opens.get() + 1);
                Ok(p)
            }
        };
        let close = |p: u64| {
            closed.borrow_mut().push(p);
            Ok(())
        };
        assert_eq!(
            cache.acquire(&vec![1], open(0x1000), no_close).unwrap(),
            0x1000
        );
        assert_eq!(
            cache.acquire(&vec![1], open(0x1000), no_close).unwrap(),
            0x1000
        );
        assert_eq!(opens.get(), 1);
        assert_eq!(cache.refs(0x1000), 2);
        cache.release(0x1000).unwrap();
        cache.release(0x1000).unwrap();
        assert_eq!(cache.refs(0x1000), 0);
        assert!(closed.borrow().is_empty(), "an idle mapping stays open");
        // Reused while idle: no second open.
        cache.acquire(&vec![1], open(0x1000), no_close).unwrap();
        assert_eq!(opens.get(), 1);
        cache.release(0x1000).unwrap();
        // A second handle needs the only place: the idle one is closed first.
        cache.acquire(&vec![2], open(0x2000), close).unwrap();
        assert_eq!(*closed.borrow(), vec![0x1000]);
        assert_eq!(cache.open_count(), 1);
        cache.release(0x2000).unwrap();
        cache.close_idle(close).unwrap();
        assert_eq!(*closed.borrow(), vec![0x1000, 0x2000]);
        assert_eq!(cache.open_count(), 0);
    }

    #[test]
    fn evicts_the_least_recently_used_idle_mapping_and_never_one_in_use() {
        let cache = IpcCache::<u8>::new(3);
        for k in 1..=3u8 {
            cache
                .acquire(&k, || Ok(u64::from(k) << 12), no_close)
                .unwrap();
        }
        // 1 stays in use; 3 and then 2 go idle, but 3 is used again (no reopen) after that.
        cache.release(0x3000).unwrap();
        cache.release(0x2000).unwrap();
        cache.acquire(&3, || unreachable!(), no_close).unwrap();
        cache.release(0x3000).unwrap();
        let closed = RefCell::new(Vec::new());
        let close = |p: u64| {
            closed.borrow_mut().push(p);
            Ok(())
        };
        cache.acquire(&4, || Ok(0x4000), close).unwrap();
        assert_eq!(*closed.borrow(), vec![0x2000]);
        cache.acquire(&5, || Ok(0x5000), close).unwrap();
        assert_eq!(*closed.borrow(), vec![0x2000, 0x3000]);
        // 1, 4, 5 in use: a sixth handle is refused with the limit named, nothing opened.
        let err = cache
            .acquire(&6, || panic!("must not open past the limit"), close)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("all 3 mappings") && err.contains("vm.max_map_count"),
            "{err}"
        );
        assert_eq!(cache.refs(0x1000), 1);
    }

    #[test]
    fn failures_leave_no_entry_and_unknown_pointers_are_errors() {
        let cache = IpcCache::<u8>::new(8);
        let e = cache.acquire(&3, || Err(Error::Internal("open failed".into())), no_close);
        assert!(e.is_err());
        assert_eq!(cache.open_count(), 0);
        assert_eq!(cache.acquire(&3, || Ok(0x30), no_close).unwrap(), 0x30);
        let msg = cache.release(0xdead).unwrap_err().to_string();
        assert!(
            msg.contains("0xdead") && msg.contains("already closed"),
            "{msg}"
        );
        cache.release(0x30).unwrap();
        assert!(
            cache.release(0x30).is_err(),
            "a second release of one import"
        );
    }

    #[test]
    fn limit_follows_vm_max_map_count() {
        assert_eq!(limit_from_max_map_count(65530), 8191);
        assert_eq!(limit_from_max_map_count(262144), 32768);
        assert_eq!(limit_from_max_map_count(10), 16);
        assert!(system_limit() >= 16);
    }
}
