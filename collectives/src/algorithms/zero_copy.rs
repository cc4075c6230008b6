//! The zero-copy kernel family (`coll::ZeroCopyArgs`): kernels on the user's buffers, whose
//! addresses every call agrees on with every peer (`crate::user_buffers`), with block barriers
//! through the collection's semaphores.

use crate::geometry;
use crate::native::{NativeBase, DEFAULT_THREADS};
use crate::user_buffers::UserBuffer;
use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::device::{PeerPtrs, ZeroCopyArgs};
use mscclpp_core::gpu::DevicePtr;
use mscclpp_core::Result;

/// Collective: every rank's address of its user buffer `ptr` (`bytes` long) for this call, as a
/// kernel argument (for kinds that touch one buffer of their peers').
pub fn peers(base: &NativeBase, ptr: DevicePtr, bytes: usize) -> Result<PeerPtrs> {
    base.agree(&[UserBuffer::new(ptr, bytes)])?.peers(0)
}

/// Launches the kind's kernel for a checked call, with the collective-specific fields of
/// `kernel_args` (buffers, count, root) filled by the caller and the rest here.
pub fn launch(base: &NativeBase, args: &ExecuteArgs, kernel_args: ZeroCopyArgs) -> Result<()> {
    let f = base.function(args)?;
    let (sems, _) = base.semaphores()?;
    let threads = args.nthreads.unwrap_or(DEFAULT_THREADS);
    let max_blocks = base.max_blocks(threads);
    let cfg = geometry::launch_config(
        args.nblocks,
        args.nthreads,
        geometry::bandwidth_blocks(args.input_bytes, max_blocks),
        DEFAULT_THREADS,
        max_blocks,
    )?;
    let comm = base.comm();
    let kernel_args = ZeroCopyArgs {
        sems,
        error_word: comm.error_word_device_ptr(),
        rank: comm.rank() as u32,
        nranks: comm.size() as u32,
        ..kernel_args
    };
    base.launch(f, cfg, args, kernel_args)
}
