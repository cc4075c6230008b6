//! Eager kernel launches through cached one-kernel graphs ([`LaunchConfig::cached_graph`]).
//!
//! Why: an eager collective is one kernel launch, and on the machines we measured the calling
//! thread pays less for cuGraphLaunch of an instantiated one-kernel graph than for cuLaunchKernel
//! or cuLaunchKernelEx (docs/performance.md). So each
//! (function, geometry, stream) gets one executable graph holding a single kernel node; a launch
//! rewrites the node's parameters in place (cuGraphExecKernelNodeSetParams) only when they differ
//! from the last launch's, then replays the graph.
//!
//! Per stream, because every launch of one executable graph is ordered after its previous
//! launches whatever the stream: a graph shared by two streams would serialise them. The maps are
//! per device, so threads driving different GPUs never wait for each other here; the lock is held
//! across update and launch, so two threads launching on one stream cannot swap parameters.
//!
//! Parameter sizes come from cuFuncGetParamInfo (CUDA 12.4+ drivers): with them the launch
//! compares bytes and checks the caller passed one pointer per parameter; without them it updates
//! the node on every launch, which is still correct. When the driver refuses to build or update a
//! graph, that call falls back to the plain launch (the caller makes it), so the driver's limits
//! never fail a launch; a wrong parameter count, which the plain launch could not even detect, is
//! an error.

use crate::driver::{self, cu};
use crate::gpu::kernel_params;
use cudarc::driver::sys;
use mscclpp_core::gpu::{Function, LaunchConfig, Stream};
use mscclpp_core::{Error, Result};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

/// Entry points this path needs beyond cuGraphLaunch (CUDA 12.0+ drivers export them).
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuGraphAddKernelNode_v2",
    "cuGraphExecKernelNodeSetParams_v2",
];

/// When a device's map holds this many graphs, they are all dropped before the next is built: a
/// program that keeps making streams must not grow it without bound, and rebuilding costs tens of
/// microseconds once.
const MAX_GRAPHS_PER_DEVICE: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    function: u64,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_mem_bytes: u32,
    stream: u64,
}

#[derive(Debug)]
struct CachedGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    node: sys::CUgraphNode,
    /// Byte size of each kernel parameter, when the driver can say.
    sizes: Option<Vec<usize>>,
    /// The parameter bytes the node holds now (empty when `sizes` is unknown).
    params: Vec<u8>,
}

// SAFETY: the handles are driver objects usable from any thread; every use is under the map's
// mutex.
unsafe impl Send for CachedGraph {}

impl CachedGraph {
    fn destroy(self) {
        // SAFETY: both handles were created by `build` and are destroyed once; an executable graph
        // still running is freed by the driver when it completes.
        let r = unsafe { sys::cuGraphExecDestroy(self.exec) };
        if let Err(e) = driver::check("cuGraphExecDestroy", r) {
            tracing::warn!(target: "mscclpp::gpu", "dropping a cached launch graph: {e}");
        }
        // SAFETY: as above.
        let r = unsafe { sys::cuGraphDestroy(self.graph) };
        if let Err(e) = driver::check("cuGraphDestroy", r) {
            tracing::warn!(target: "mscclpp::gpu", "dropping a cached launch graph: {e}");
        }
    }
}

/// The per-device caches of one `CudaGpu`.
#[derive(Debug)]
pub(crate) struct GraphLaunches {
    devices: Vec<Mutex<HashMap<Key, CachedGraph>>>,
}

/// Whether this driver has what the path needs; checked once per process.
pub(crate) fn supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| match driver::missing_symbols(REQUIRED_SYMBOLS) {
        Ok(missing) if missing.is_empty() => true,
        Ok(missing) => {
            tracing::info!(target: "mscclpp::gpu", "eager launches stay plain: the driver lacks {}", missing.join(", "));
            false
        }
        Err(e) => {
            tracing::info!(target: "mscclpp::gpu", "eager launches stay plain: {e}");
            false
        }
    })
}

/// Parameter sizes of `f`, or `None` when the driver cannot report them (before CUDA 12.4).
fn param_sizes(f: sys::CUfunction) -> Option<Vec<usize>> {
    static HAS_PARAM_INFO: OnceLock<bool> = OnceLock::new();
    let has = *HAS_PARAM_INFO.get_or_init(|| {
        driver::missing_symbols(&["cuFuncGetParamInfo"]).is_ok_and(|m| m.is_empty())
    });
    if !has {
        return None;
    }
    let mut sizes = Vec::new();
    loop {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: writes two size_t; an index past the last parameter returns an error.
        let r = unsafe { sys::cuFuncGetParamInfo(f, sizes.len(), &mut offset, &mut size) };
        match r {
            sys::CUresult::CUDA_SUCCESS => sizes.push(size),
            sys::CUresult::CUDA_ERROR_INVALID_VALUE => return Some(sizes),
            _ => return None,
        }
    }
}

/// Copies the values `params` points at (sizes from `sizes`) into `into`; returns whether they
/// differed from what `into` held.
///
/// # Safety
/// Each `params[i]` points at `sizes[i]` readable bytes.
unsafe fn capture_params(params: &[*mut c_void], sizes: &[usize], into: &mut Vec<u8>) -> bool {
    let total: usize = sizes.iter().sum();
    let mut changed = into.len() != total;
    into.resize(total, 0);
    let mut at = 0;
    for (&p, &n) in params.iter().zip(sizes) {
        // SAFETY: the caller guarantees `p` points at `n` bytes.
        let value = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), n) };
        let slot = &mut into[at..at + n];
        if slot != value {
            slot.copy_from_slice(value);
            changed = true;
        }
        at += n;
    }
    changed
}

fn node_params(
    function: Function,
    config: &LaunchConfig,
    params: &mut [*mut c_void],
) -> sys::CUDA_KERNEL_NODE_PARAMS {
    let (g, b) = (config.grid, config.block);
    sys::CUDA_KERNEL_NODE_PARAMS {
        func: function.0 as usize as sys::CUfunction,
        gridDimX: g.0,
        gridDimY: g.1,
        gridDimZ: g.2,
        blockDimX: b.0,
        blockDimY: b.1,
        blockDimZ: b.2,
        sharedMemBytes: config.shared_mem_bytes,
        kernelParams: kernel_params(params),
        extra: std::ptr::null_mut(),
        kern: std::ptr::null_mut(),
        // Null: the context current on this thread (the caller bound the device's).
        ctx: std::ptr::null_mut(),
    }
}

impl GraphLaunches {
    pub(crate) fn new(devices: usize) -> Self {
        GraphLaunches {
            devices: (0..devices).map(|_| Mutex::new(HashMap::new())).collect(),
        }
    }

    /// Launches `function` through the cached graph of (function, geometry, stream) on device
    /// `ordinal`, whose context must be current. `Ok(false)`: no graph could be built for it, and
    /// nothing was launched (the caller launches plainly).
    ///
    /// # Safety
    /// As for `Gpu::launch`: `params` matches the kernel's signature.
    pub(crate) unsafe fn launch(
        &self,
        ordinal: usize,
        function: Function,
        config: &LaunchConfig,
        stream: Stream,
        params: &mut [*mut c_void],
    ) -> Result<bool> {
        let Some(map) = self.devices.get(ordinal) else {
            return Ok(false);
        };
        let key = Key {
            function: function.0,
            grid: config.grid,
            block: config.block,
            shared_mem_bytes: config.shared_mem_bytes,
            stream: stream.0,
        };
        let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
        let entry = match map.get_mut(&key) {
            Some(entry) => {
                let changed = match &entry.sizes {
                    Some(sizes) => {
                        check_count(sizes, params)?;
                        // SAFETY: the caller guarantees `params` matches the kernel, and the
                        // count was just checked.
                        unsafe { capture_params(params, sizes, &mut entry.params) }
                    }
                    None => true,
                };
                if changed {
                    let p = node_params(function, config, params);
                    // SAFETY: `p` points at the caller's parameter values for this call; the
                    // driver copies them, and earlier launches keep their own.
                    let set = unsafe {
                        cu!(cuGraphExecKernelNodeSetParams_v2(
                            entry.exec, entry.node, &p
                        ))
                    };
                    if let Err(e) = set {
                        // The node keeps older values than `entry.params` says: drop the graph
                        // and let the caller launch plainly.
                        tracing::info!(target: "mscclpp::gpu", "dropping a cached launch graph, launching plainly: {e}");
                        if let Some(stale) = map.remove(&key) {
                            stale.destroy();
                        }
                        return Ok(false);
                    }
                }
                entry
            }
            None => {
                if map.len() >= MAX_GRAPHS_PER_DEVICE {
                    map.drain().for_each(|(_, g)| g.destroy());
                }
                // SAFETY: as for this function.
                let Some(built) = (unsafe { build(function, config, params) })? else {
                    return Ok(false);
                };
                map.entry(key).or_insert(built)
            }
        };
        // SAFETY: an executable graph of the current context; `stream` is the caller's.
        unsafe {
            cu!(cuGraphLaunch(
                entry.exec,
                stream.0 as usize as sys::CUstream
            ))
        }?;
        Ok(true)
    }

    /// Destroys every cached graph of device `ordinal`, under its context `ctx` (made current for
    /// the purpose; the thread's current context is restored after).
    pub(crate) fn clear(&self, ordinal: usize, ctx: sys::CUcontext) {
        let Some(map) = self.devices.get(ordinal) else {
            return;
        };
        let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
        if map.is_empty() {
            return;
        }
        let mut previous: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle; then makes a retained context current.
        let bound = unsafe { cu!(cuCtxGetCurrent(&mut previous)) }
            .and_then(|()| unsafe { cu!(cuCtxSetCurrent(ctx)) });
        if let Err(e) = bound {
            tracing::warn!(target: "mscclpp::gpu", "dropping the launch graphs of device {ordinal}: {e}");
            return;
        }
        map.drain().for_each(|(_, g)| g.destroy());
        // SAFETY: restores the handle the thread had (possibly null).
        if let Err(e) = unsafe { cu!(cuCtxSetCurrent(previous)) } {
            tracing::warn!(target: "mscclpp::gpu", "restoring the current context: {e}");
        }
    }
}

/// A kernel's parameters are passed as one pointer each: a different count would make the driver
/// read past the caller's array.
fn check_count(sizes: &[usize], params: &[*mut c_void]) -> Result<()> {
    if sizes.len() == params.len() {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!(
            "a launch passed {} parameters to a kernel that takes {}",
            params.len(),
            sizes.len()
        )))
    }
}

/// A new one-node graph for this launch, instantiated; `None` (logged) when the driver refuses,
/// for example while another thread captures in global mode; an error when `params` has the
/// wrong count.
///
/// # Safety
/// As for `Gpu::launch`.
unsafe fn build(
    function: Function,
    config: &LaunchConfig,
    params: &mut [*mut c_void],
) -> Result<Option<CachedGraph>> {
    let f = function.0 as usize as sys::CUfunction;
    let sizes = param_sizes(f);
    let mut values = Vec::new();
    if let Some(sizes) = &sizes {
        check_count(sizes, params)?;
        // SAFETY: the caller guarantees `params` matches the kernel; the count is checked.
        unsafe { capture_params(params, sizes, &mut values) };
    }
    let p = node_params(function, config, params);
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let refused = |e: mscclpp_core::Error| {
        tracing::info!(target: "mscclpp::gpu", "no cached launch graph, launching plainly: {e}");
    };
    // SAFETY: writes one graph handle.
    if let Err(e) = unsafe { cu!(cuGraphCreate(&mut graph, 0)) } {
        refused(e);
        return Ok(None);
    }
    let mut node: sys::CUgraphNode = std::ptr::null_mut();
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: `graph` is new; `p` holds this call's parameters, which the driver copies.
    let made = unsafe {
        cu!(cuGraphAddKernelNode_v2(
            &mut node,
            graph,
            std::ptr::null(),
            0,
            &p
        ))
    }
    // SAFETY: writes one executable graph handle.
    .and_then(|()| unsafe { cu!(cuGraphInstantiateWithFlags(&mut exec, graph, 0)) });
    if let Err(e) = made {
        refused(e);
        // SAFETY: the graph is ours and not used again.
        unsafe { sys::cuGraphDestroy(graph) };
        return Ok(None);
    }
    Ok(Some(CachedGraph {
        graph,
        exec,
        node,
        sizes,
        params: values,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captured_parameters_report_changes_only() {
        let (mut a, mut b) = (7u64, 3u32);
        let params: Vec<*mut c_void> =
            vec![(&mut a as *mut u64).cast(), (&mut b as *mut u32).cast()];
        let sizes = [8, 4];
        let mut held = Vec::new();
        // SAFETY: each pointer points at a live value of the stated size.
        assert!(unsafe { capture_params(&params, &sizes, &mut held) });
        assert_eq!(held.len(), 12);
        assert!(!unsafe { capture_params(&params, &sizes, &mut held) });
        b = 4;
        let params: Vec<*mut c_void> =
            vec![(&mut a as *mut u64).cast(), (&mut b as *mut u32).cast()];
        assert!(unsafe { capture_params(&params, &sizes, &mut held) });
        assert_eq!(&held[8..], &4u32.to_ne_bytes());
    }
}
