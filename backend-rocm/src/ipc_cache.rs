//! Reference counting for opened IPC memory handles.
//!
//! HIP (unlike CUDA) does not reference-count `hipIpcOpenMemHandle`: opening one handle twice
//! either fails or returns the same mapping, and a single `hipIpcCloseMemHandle` unmaps it for
//! every user. Two connections to one peer buffer would then break each other. The cache opens
//! each handle once, hands out the same base pointer to every importer, and closes it when the
//! last one lets go.

use mscclpp_core::{Error, Result};
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;

struct Entry<K> {
    key: K,
    refs: usize,
}

/// Maps handle bytes (`K`) to an opened base pointer, counting users.
pub struct IpcCache<K> {
    inner: Mutex<Inner<K>>,
}

struct Inner<K> {
    by_key: HashMap<K, u64>,
    by_ptr: HashMap<u64, Entry<K>>,
}

impl<K: Hash + Eq + Clone> Default for IpcCache<K> {
    fn default() -> Self {
        IpcCache {
            inner: Mutex::new(Inner {
                by_key: HashMap::new(),
                by_ptr: HashMap::new(),
            }),
        }
    }
}

impl<K: Hash + Eq + Clone> IpcCache<K> {
    /// The base pointer for `key`, calling `open` only if no one holds it. The lock is held across
    /// `open` so two threads importing the same handle cannot both open it.
    pub fn acquire(&self, key: &K, open: impl FnOnce() -> Result<u64>) -> Result<u64> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&ptr) = inner.by_key.get(key) {
            if let Some(e) = inner.by_ptr.get_mut(&ptr) {
                e.refs += 1;
                return Ok(ptr);
            }
        }
        let ptr = open()?;
        inner.by_key.insert(key.clone(), ptr);
        inner.by_ptr.insert(
            ptr,
            Entry {
                key: key.clone(),
                refs: 1,
            },
        );
        Ok(ptr)
    }

    /// Drops one user of `ptr`; calls `close` when it was the last. If `close` fails the entry is
    /// forgotten anyway: the mapping's state is unknown and retrying would double-close.
    pub fn release(&self, ptr: u64, close: impl FnOnce(u64) -> Result<()>) -> Result<()> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Some(entry) = inner.by_ptr.get_mut(&ptr) else {
            return Err(Error::InvalidArgument(format!(
                "closing imported memory at {ptr:#x}: it was not opened through this backend, or \
                 was already closed"
            )));
        };
        entry.refs -= 1;
        if entry.refs > 0 {
            return Ok(());
        }
        if let Some(e) = inner.by_ptr.remove(&ptr) {
            inner.by_key.remove(&e.key);
        }
        close(ptr)
    }

    /// How many users hold `ptr` (0 when not open).
    pub fn refs(&self, ptr: u64) -> usize {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.by_ptr.get(&ptr).map_or(0, |e| e.refs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn opens_once_and_closes_at_zero() {
        let cache = IpcCache::<Vec<u8>>::default();
        let opens = Cell::new(0);
        let closes = Cell::new(0);
        let open = || {
            opens.set(opens.get() + 1);
            Ok(0x1000)
        };
        assert_eq!(cache.acquire(&vec![1], open).unwrap(), 0x1000);
        assert_eq!(cache.acquire(&vec![1], open).unwrap(), 0x1000);
        assert_eq!(opens.get(), 1);
        assert_eq!(cache.refs(0x1000), 2);
        let close = |p: u64| {
            assert_eq!(p, 0x1000);
            closes.set(closes.get() + 1);
            Ok(())
        };
        cache.release(0x1000, close).unwrap();
        assert_eq!(closes.get(), 0);
        cache.release(0x1000, close).unwrap();
        assert_eq!(closes.get(), 1);
        assert_eq!(cache.refs(0x1000), 0);
        // Opening again after the last close really reopens.
        cache.acquire(&vec![1], open).unwrap();
        assert_eq!(opens.get(), 2);
    }

    #[test]
    fn distinct_handles_are_independent_and_failures_leave_no_entry() {
        let cache = IpcCache::<u8>::default();
        assert_eq!(cache.acquire(&1, || Ok(0x10)).unwrap(), 0x10);
        assert_eq!(cache.acquire(&2, || Ok(0x20)).unwrap(), 0x20);
        let e = cache.acquire(&3, || Err(Error::Internal("open failed".into())));
        assert!(e.is_err());
        assert_eq!(cache.acquire(&3, || Ok(0x30)).unwrap(), 0x30);
        cache.release(0x10, |_| Ok(())).unwrap();
        assert_eq!(cache.refs(0x20), 1);
    }

    #[test]
    fn releasing_unknown_pointer_is_an_error() {
        let cache = IpcCache::<u8>::default();
        let msg = cache.release(0xdead, |_| Ok(())).unwrap_err().to_string();
        assert!(
            msg.contains("0xdead") && msg.contains("already closed"),
            "{msg}"
        );
    }
}
