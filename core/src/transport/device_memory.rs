//! [`DeviceMemoryResolver`]: the [`MemoryResolver`] that lets a staging transport (Ethernet) read
//! and write GPU memory: the sender stages a write's source from the device, the receiver copies
//! the bytes it receives into the device, and signals land in device semaphore words.
//!
//! # Regions
//! A region is accepted when it lies inside a range registered here (a scratch buffer, the
//! communicator's semaphore slab); its key is not used (device ranges are named by address, as the
//! CudaIpc transport names them). So a peer may name any part of a registered range, e.g. one
//! 8-byte semaphore word of the slab.
//!
//! # Ordering
//! Copies are synchronous host<->device copies ([`Gpu::copy_to_device`] / [`Gpu::copy_from_device`]),
//! issued on the calling thread (the Ethernet receiver applies frames in order), so a semaphore
//! store issued after a write lands after the write's bytes. They go through the legacy default
//! stream, which does not wait for the library's non-blocking streams, so they complete while a
//! kernel on those streams spins on the semaphore they set. The 8-byte store of a signal is one
//! aligned copy; kernels compare the whole word against their expected counter.

use crate::error::{Error, Result};
use crate::gpu::{DevicePtr, Gpu};
use crate::transport::host_memory::MemoryResolver;
use crate::transport::MemoryRegion;
use std::sync::{Arc, RwLock};

/// Device memory ranges a staging transport may access. See the module docs.
pub struct DeviceMemoryResolver {
    gpu: Arc<dyn Gpu>,
    device: usize,
    ranges: RwLock<Vec<(DevicePtr, u64)>>,
}

impl std::fmt::Debug for DeviceMemoryResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemoryResolver")
            .field("device", &self.device)
            .field("ranges", &self.ranges.read().map(|r| r.len()).unwrap_or(0))
            .finish()
    }
}

impl DeviceMemoryResolver {
    pub fn new(gpu: Arc<dyn Gpu>, device: usize) -> Self {
        DeviceMemoryResolver {
            gpu,
            device,
            ranges: RwLock::new(Vec::new()),
        }
    }

    /// Allows access to `[ptr, ptr + size)` of this resolver's device. The memory must stay
    /// allocated while a transport that uses this resolver may access it.
    pub fn register(&self, ptr: DevicePtr, size: usize) -> Result<()> {
        if ptr == 0 || size == 0 {
            return Err(Error::InvalidArgument(format!(
                "device range at {ptr:#x} of {size} bytes: null or empty"
            )));
        }
        self.ranges
            .write()
            .map_err(|_| Error::Internal("device memory resolver lock poisoned".into()))?
            .push((ptr, size as u64));
        Ok(())
    }

    /// The device address of `[offset, offset + len)` of `region`, after checking that it lies
    /// inside a registered range.
    fn resolve(&self, region: &MemoryRegion, offset: u64, len: u64) -> Result<DevicePtr> {
        region.check_range(offset, len, "device memory access")?;
        let start = region.addr + offset;
        let inside = self
            .ranges
            .read()
            .map_err(|_| Error::Internal("device memory resolver lock poisoned".into()))?
            .iter()
            .any(|&(p, s)| start >= p && start + len <= p + s);
        if !inside {
            return Err(Error::InvalidArgument(format!(
                "device memory [{start:#x}, +{len}) (region {:#x} of {} bytes, offset {offset}) \
                 is not registered here",
                region.addr, region.size
            )));
        }
        // Transport threads are not bound to a device; bind before every copy.
        self.gpu.set_device(self.device)?;
        Ok(start)
    }
}

impl MemoryResolver for DeviceMemoryResolver {
    fn read(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.resolve(region, offset, out.len() as u64)?;
        self.gpu.copy_from_device(out, src)
    }

    fn write(&self, region: &MemoryRegion, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.resolve(region, offset, data.len() as u64)?;
        self.gpu.copy_to_device(dst, data)
    }

    fn store_release(&self, region: &MemoryRegion, offset: u64, value: u64) -> Result<()> {
        let dst = self.resolve(region, offset, 8)?;
        if dst % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "semaphore word at {dst:#x} is not 8-byte aligned"
            )));
        }
        self.gpu.copy_to_device(dst, &value.to_le_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::MemoryKind;
    use crate::port_channel::test_gpu::HostGpu;

    /// Writes, reads and signals land inside registered ranges only, at any offset inside them.
    #[test]
    fn accesses_registered_ranges_only() {
        let gpu: Arc<dyn Gpu> = Arc::new(HostGpu::default());
        let buf = gpu.alloc(64, MemoryKind::Plain).unwrap();
        let r = DeviceMemoryResolver::new(gpu.clone(), 0);
        assert!(r.register(0, 8).is_err());
        r.register(buf.ptr, 64).unwrap();
        // A peer names a part of the range (one word of a slab, one slot of a scratch).
        let word = MemoryRegion {
            addr: buf.ptr + 32,
            size: 8,
            key: 0,
        };
        r.store_release(&word, 0, 0x0102_0304_0506_0708).unwrap();
        let slot = MemoryRegion {
            addr: buf.ptr,
            size: 16,
            key: 9,
        };
        r.write(&slot, 4, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 8];
        r.read(&word, 0, &mut out).unwrap();
        assert_eq!(u64::from_le_bytes(out), 0x0102_0304_0506_0708);
        let mut three = [0u8; 3];
        r.read(&slot, 4, &mut three).unwrap();
        assert_eq!(three, [1, 2, 3]);
        // Past the region, past the registered range, unaligned words: refused, naming it.
        assert!(r.write(&slot, 14, &[0; 3]).is_err());
        let beyond = MemoryRegion {
            addr: buf.ptr + 60,
            size: 8,
            key: 0,
        };
        let e = r.write(&beyond, 0, &[0; 8]).unwrap_err();
        assert!(e.to_string().contains("not registered here"), "{e}");
        assert!(r.store_release(&slot, 4, 1).is_err());
        gpu.free(&buf).unwrap();
    }
}
