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
//! Every copy is issued on the calling thread (the Ethernet receiver applies frames in order) on
//! the resolver's own non-blocking stream and waited for, so a semaphore store issued after a write
//! lands after the write's bytes. The 8-byte store of a signal is one aligned copy; kernels compare
//! the whole word against their expected counter.
//!
//! The kernels that wait for these copies must never wait behind them, so the copies stay off two
//! shared paths of the driver:
//! - the legacy default stream: a caller's kernel may run on it, or it may be waiting for one
//!   (PyTorch makes its current stream, the legacy one by default, wait for a communication
//!   stream);
//! - pageable host memory: the driver stages pageable copies through buffers of its own, one copy
//!   at a time, and another thread's copy into pageable memory (PyTorch's `tensor.cpu()`) waits
//!   for the kernel that waits for ours. Seen with the EP buffer across simulated hosts, where
//!   every rank hung in `.cpu()` after its first exchange. So the bytes go through a pinned
//!   bounce buffer of the resolver's.
//!
//! The copies are made in relaxed capture mode ([`CaptureMode`](crate::gpu::CaptureMode)):
//! their waits are for the resolver's own stream, and in the default mode a wait made while the
//! caller's thread captures a graph in PyTorch's default mode invalidates that capture. Peers that
//! finished capturing first and replay at once send rows to a rank still capturing.
//!
//! The bounce buffer and its stream are made by [`MemoryResolver::prepare`], which the connection
//! setup calls, not by the first copy: the first copy runs on a transport thread while a send/recv
//! group's kernel already waits for it, and a stream or pinned allocation made then can wait
//! behind the same pageable copy (a user's `.cpu()` of the group's result right after it).

use crate::error::{Error, Result};
use crate::gpu::{relaxed_capture, DevicePtr, Gpu, HostMapped, Stream};
use crate::transport::host_memory::MemoryResolver;
use crate::transport::MemoryRegion;
use std::sync::{Arc, Mutex, RwLock};

/// Device memory ranges a staging transport may access. See the module docs.
pub struct DeviceMemoryResolver {
    gpu: Arc<dyn Gpu>,
    device: usize,
    ranges: RwLock<Vec<(DevicePtr, u64)>>,
    /// The copies' stream and pinned bounce buffer (see the module docs), made by `prepare` (or
    /// by the first copy, where no setup called it).
    bounce: Mutex<Option<Bounce>>,
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
            bounce: Mutex::new(None),
        }
    }

    /// Runs `f` with the stream and bounce buffer, made on first use, in relaxed capture mode
    /// (see the module docs). The caller has bound the device ([`Self::resolve`]).
    fn with_bounce(&self, f: impl FnOnce(&Bounce) -> Result<()>) -> Result<()> {
        relaxed_capture(&*self.gpu, || {
            let mut bounce = self.bounce.lock().map_err(|_| {
                Error::Internal("device memory resolver bounce lock poisoned".into())
            })?;
            let b = match &*bounce {
                Some(b) => b,
                None => {
                    let stream = self.gpu.create_stream()?;
                    match self.gpu.alloc_host_mapped(BOUNCE_BYTES) {
                        Ok(buffer) => bounce.insert(Bounce { stream, buffer }),
                        Err(e) => {
                            let _ = self.gpu.destroy_stream(stream);
                            return Err(e);
                        }
                    }
                }
            };
            f(b)
        })
    }

    /// Copies `data` to device address `dst` through the bounce buffer.
    fn copy_in(&self, dst: DevicePtr, data: &[u8]) -> Result<()> {
        self.with_bounce(|b| {
            for (k, piece) in data.chunks(BOUNCE_BYTES).enumerate() {
                // SAFETY: the bounce buffer holds BOUNCE_BYTES pinned bytes, alive while the lock
                // is held, and no copy of it is pending (each piece is waited for).
                unsafe {
                    std::ptr::copy_nonoverlapping(piece.as_ptr(), b.buffer.host_ptr, piece.len())
                };
                let at = dst + (k * BOUNCE_BYTES) as u64;
                self.gpu
                    .memcpy_async(at, b.buffer.host_ptr as u64, piece.len(), b.stream)?;
                self.gpu.synchronize_stream(b.stream)?;
            }
            Ok(())
        })
    }

    /// Copies from device address `src` into `out` through the bounce buffer.
    fn copy_out(&self, out: &mut [u8], src: DevicePtr) -> Result<()> {
        self.with_bounce(|b| {
            for (k, piece) in out.chunks_mut(BOUNCE_BYTES).enumerate() {
                let at = src + (k * BOUNCE_BYTES) as u64;
                self.gpu
                    .memcpy_async(b.buffer.host_ptr as u64, at, piece.len(), b.stream)?;
                self.gpu.synchronize_stream(b.stream)?;
                // SAFETY: as in copy_in; the copy into the buffer has completed.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        b.buffer.host_ptr,
                        piece.as_mut_ptr(),
                        piece.len(),
                    )
                };
            }
            Ok(())
        })
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
        self.copy_out(out, src)
    }

    fn write(&self, region: &MemoryRegion, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.resolve(region, offset, data.len() as u64)?;
        self.copy_in(dst, data)
    }

    fn store_release(&self, region: &MemoryRegion, offset: u64, value: u64) -> Result<()> {
        let dst = self.resolve(region, offset, 8)?;
        if dst % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "semaphore word at {dst:#x} is not 8-byte aligned"
            )));
        }
        self.copy_in(dst, &value.to_le_bytes())
    }

    fn prepare(&self) -> Result<()> {
        self.gpu.set_device(self.device)?;
        self.with_bounce(|_| Ok(()))
    }
}

/// Bytes of a resolver's pinned bounce buffer: a larger write goes through it in pieces.
const BOUNCE_BYTES: usize = 1 << 20;

/// A resolver's copy stream and pinned bounce buffer.
struct Bounce {
    stream: Stream,
    buffer: HostMapped,
}

impl Drop for DeviceMemoryResolver {
    fn drop(&mut self) {
        if let Some(b) = self.bounce.get_mut().ok().and_then(|b| b.take()) {
            let _ = self.gpu.set_device(self.device);
            let _ = self.gpu.destroy_stream(b.stream);
            let _ = self.gpu.free_host_mapped(&b.buffer);
        }
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
        // The setup makes the bounce buffer; copies only use it.
        r.prepare().unwrap();
        assert!(r.bounce.lock().unwrap().is_some());
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

    /// While the caller's thread captures a graph in global mode, a transport thread's copies
    /// still complete (their waits are made in relaxed mode), and the copying thread's own mode
    /// is given back after each.
    #[test]
    fn copies_complete_beside_a_global_capture() {
        let host = Arc::new(HostGpu::default());
        let gpu: Arc<dyn Gpu> = host.clone();
        let buf = gpu.alloc(64, MemoryKind::Plain).unwrap();
        let r = DeviceMemoryResolver::new(gpu.clone(), 0);
        r.register(buf.ptr, 64).unwrap();
        r.prepare().unwrap();
        host.capture_globally_elsewhere(true);
        let slot = MemoryRegion {
            addr: buf.ptr,
            size: 64,
            key: 0,
        };
        r.write(&slot, 0, &[7; 16]).unwrap();
        r.store_release(&slot, 16, 9).unwrap();
        let mut out = [0u8; 24];
        r.read(&slot, 0, &mut out).unwrap();
        assert_eq!(out[..16], [7; 16]);
        assert_eq!(u64::from_le_bytes(out[16..].try_into().unwrap()), 9);
        assert!(
            gpu.synchronize_stream(Stream::DEFAULT).is_err(),
            "the thread's global mode is back"
        );
        host.capture_globally_elsewhere(false);
        gpu.free(&buf).unwrap();
    }
}
