//! Local memory as a staging transport sees it: a [`MemoryResolver`] turns a [`MemoryRegion`] named by
//! a peer (or by a local caller) into bytes it may read or write, after checking that the region was
//! registered here and the range lies inside it.
//!
//! [`HostMemoryRegistry`] is the resolver for host memory. A GPU backend provides its own resolver
//! (copying staged bytes to and from device memory) and plugs it into the same transports.

use crate::error::{Error, Result};
use crate::transport::MemoryRegion;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::RwLock;

/// Access to locally registered memory by region. Every method validates that `region` (address,
/// size and key together) was registered here and that the range lies inside it; a mismatch is an
/// `InvalidArgument` error naming the region, never an access.
pub trait MemoryResolver: Send + Sync {
    /// Copies `out.len()` bytes from `region + offset` into `out` (the sender's staging step).
    fn read(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<()>;

    /// Copies `data` to `region + offset` (the receiver's staging step).
    fn write(&self, region: &MemoryRegion, offset: u64, data: &[u8]) -> Result<()>;

    /// Stores `value` into the 8-byte aligned word at `region + offset` with release ordering, so
    /// a reader that acquires it sees every earlier `write`.
    fn store_release(&self, region: &MemoryRegion, offset: u64, value: u64) -> Result<()>;

    /// Makes what the copies need before any traffic (the connection setup calls it), so that no
    /// transport thread creates it while a kernel waits for its copies. Nothing by default.
    fn prepare(&self) -> Result<()> {
        Ok(())
    }
}

/// Host memory regions registered for transports, looked up by key.
#[derive(Debug, Default)]
pub struct HostMemoryRegistry {
    regions: RwLock<HashMap<u32, MemoryRegion>>,
    next_key: AtomicU32,
}

impl HostMemoryRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `size` bytes at `ptr` and returns the region to hand to peers. Keys start at 1.
    ///
    /// # Safety
    /// `ptr..ptr+size` must stay valid for reads and writes until [`HostMemoryRegistry::deregister`]
    /// (or the registry is dropped), and while a transport may write into it the owner must not
    /// create Rust references to the bytes concurrently (read them after the semaphore that orders
    /// the write, or with volatile/atomic loads).
    pub unsafe fn register(&self, ptr: *mut u8, size: usize) -> Result<MemoryRegion> {
        if ptr.is_null() && size > 0 {
            return Err(Error::InvalidArgument(format!(
                "cannot register a null host pointer of {size} bytes"
            )));
        }
        let key = self.next_key.fetch_add(1, Ordering::Relaxed) + 1;
        let region = MemoryRegion {
            addr: ptr as u64,
            size: size as u64,
            key,
        };
        self.regions
            .write()
            .map_err(|_| Error::Internal("host memory registry lock poisoned".into()))?
            .insert(key, region);
        Ok(region)
    }

    /// Forgets a region; later accesses to it fail with `InvalidArgument`.
    pub fn deregister(&self, region: &MemoryRegion) -> Result<()> {
        let mut map = self
            .regions
            .write()
            .map_err(|_| Error::Internal("host memory registry lock poisoned".into()))?;
        match map.get(&region.key) {
            Some(r) if r == region => {
                map.remove(&region.key);
                Ok(())
            }
            _ => Err(Error::InvalidArgument(format!(
                "deregister: {region:?} is not registered here"
            ))),
        }
    }

    /// The host address of `[offset, offset+len)` of `region` after validation.
    fn resolve(&self, region: &MemoryRegion, offset: u64, len: u64) -> Result<*mut u8> {
        let map = self
            .regions
            .read()
            .map_err(|_| Error::Internal("host memory registry lock poisoned".into()))?;
        match map.get(&region.key) {
            Some(r) if r.addr == region.addr && r.size == region.size => {}
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "memory region (addr {:#x}, size {}, key {}) is not registered here",
                    region.addr, region.size, region.key
                )))
            }
        }
        region.check_range(offset, len, "host memory access")?;
        Ok((region.addr + offset) as *mut u8)
    }
}

impl MemoryResolver for HostMemoryRegistry {
    fn read(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.resolve(region, offset, out.len() as u64)?;
        // SAFETY: the range was registered as valid memory (see `register`'s contract) and checked.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn write(&self, region: &MemoryRegion, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.resolve(region, offset, data.len() as u64)?;
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    fn store_release(&self, region: &MemoryRegion, offset: u64, value: u64) -> Result<()> {
        let word = self.resolve(region, offset, 8)?;
        if word as usize % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "semaphore word at {:#x} (region key {} + offset {offset}) is not 8-byte aligned",
                word as usize, region.key
            )));
        }
        // SAFETY: registered, in range and aligned; readers use atomic loads on this word.
        unsafe { AtomicU64::from_ptr(word.cast::<u64>()) }.store(value, Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_unregistered_and_out_of_range() {
        let reg = HostMemoryRegistry::new();
        let mut buf = vec![0u64; 4];
        let region = unsafe { reg.register(buf.as_mut_ptr().cast(), 32) }.unwrap();
        reg.write(&region, 8, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 3];
        reg.read(&region, 8, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3]);
        assert!(reg.write(&region, 30, &[0; 3]).is_err());
        let forged = MemoryRegion { size: 64, ..region };
        assert!(reg.write(&forged, 0, &[0]).is_err());
        assert!(reg.store_release(&region, 4, 1).is_err(), "misaligned");
        reg.store_release(&region, 24, 7).unwrap();
        reg.deregister(&region).unwrap();
        assert!(reg.read(&region, 0, &mut out).is_err());
        assert_eq!(buf[3], 7);
    }
}
