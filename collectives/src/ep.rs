//! Expert-parallel dispatch and combine, intranode (`kernels/ep_intranode.cu`, whose top comment
//! is the protocol): [`EpBuffer`] owns one rank's NVLink buffer (symmetric memory every peer
//! maps), the barrier semaphores of `ep_notify` and `ep_reset`, and the kernels, and launches them
//! after checking what the device cannot: the buffer is large enough for the call's layout, and
//! the grid can be resident beside the grids of the ranks sharing the GPU.

use crate::geometry::Residency;
use crate::resources::{launch_with_args, BlockSemaphores, KernelTable, SharedScratch};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::{DevicePtr, LaunchConfig, Stream};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::collectives::{CollectiveFile, PeerPtrs, MAX_RANKS};
pub use mscclpp_kernels_cu::ep::EpArgs;
use mscclpp_kernels_cu::ep::{
    combine_blocks, dispatch_blocks, BufferLayout, BLOCK_THREADS, MAX_CHUNK, MAX_LOCAL_EXPERTS,
};
use std::sync::Arc;

/// The four kernels, in the order a dispatch-combine round uses them: `Notify` (counts, then the
/// ring reset) before a dispatch, `Reset` before a cached dispatch or a combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpKernel {
    Notify,
    Reset,
    Dispatch,
    Combine,
}

impl EpKernel {
    pub fn parse(name: &str) -> Result<EpKernel> {
        Ok(match name {
            "notify" => EpKernel::Notify,
            "reset" => EpKernel::Reset,
            "dispatch" => EpKernel::Dispatch,
            "combine" => EpKernel::Combine,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "EP kernel {other:?} (expected notify, reset, dispatch or combine)"
                )))
            }
        })
    }

    fn entry(self) -> &'static str {
        match self {
            EpKernel::Notify => "ep_notify",
            EpKernel::Reset => "ep_reset",
            EpKernel::Dispatch => "ep_dispatch",
            EpKernel::Combine => "ep_combine",
        }
    }

    fn blocks(self, channels: u32, nranks: u32) -> u32 {
        match self {
            EpKernel::Notify | EpKernel::Reset => 1,
            EpKernel::Dispatch => dispatch_blocks(channels, nranks),
            EpKernel::Combine => combine_blocks(channels, nranks),
        }
    }
}

/// One rank's expert-parallel state on a communicator of at most 8 ranks.
pub struct EpBuffer {
    comm: Arc<Communicator>,
    buffer: SharedScratch,
    sems: BlockSemaphores,
    kernels: KernelTable,
    bytes: usize,
    residency: Residency,
}

impl EpBuffer {
    /// Collective: allocates and zeroes `bytes` of NVLink buffer on every rank and maps every
    /// peer's.
    pub fn new(comm: &Arc<Communicator>, bytes: usize) -> Result<EpBuffer> {
        if comm.size() > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "expert parallelism within one NVLink domain takes at most {MAX_RANKS} ranks, \
                 not {}",
                comm.size()
            )));
        }
        Ok(EpBuffer {
            comm: comm.clone(),
            buffer: SharedScratch::new(comm, bytes.max(16))?,
            sems: BlockSemaphores::new(comm, 1)?,
            kernels: KernelTable::default(),
            bytes,
            residency: Residency::of(comm)?,
        })
    }

    /// This rank's buffer (DeepEP's `get_local_buffer_tensor`).
    pub fn local_ptr(&self) -> DevicePtr {
        self.buffer.local_ptr()
    }

    /// The error a kernel of this communicator left (a wait that gave up, an inconsistent
    /// handle), or an abort, prefixed with `op`; a wait that gave up names the peers that no
    /// longer answer ([`Communicator::check`]).
    pub fn check(&self, op: &str) -> Result<()> {
        self.comm.check(op)
    }

    /// Enqueues `kernel` on `stream`. `args` carries the call's tensors and shape (the fields a
    /// caller knows); this fills in the buffers, the semaphores, the error word, the layout and
    /// the ranks. Errors, before anything is enqueued: a shape the layout refuses, a buffer too
    /// small for it, a grid that might not be resident, a chunk out of range.
    pub fn launch(&self, kernel: EpKernel, mut args: EpArgs, stream: Stream) -> Result<()> {
        if let Some(e) = self.comm.async_error() {
            return Err(e);
        }
        let (n, rank) = (self.comm.size(), self.comm.rank());
        if args.experts_per_rank as usize > MAX_LOCAL_EXPERTS {
            return Err(Error::InvalidArgument(format!(
                "{} experts per rank: at most {MAX_LOCAL_EXPERTS}",
                args.experts_per_rank
            )));
        }
        if args.chunk == 0 || args.chunk > MAX_CHUNK || args.chunk > args.ring_slots {
            return Err(Error::InvalidArgument(format!(
                "num_max_nvl_chunked_send_tokens={}: must be in 1..={} and at most \
                 num_max_nvl_chunked_recv_tokens={}",
                args.chunk,
                MAX_CHUNK.min(args.ring_slots.max(1)),
                args.ring_slots
            )));
        }
        let layout = BufferLayout::new(
            n,
            args.num_channels as usize,
            args.ring_slots as usize,
            args.hidden_bytes as usize,
            args.num_topk as usize,
        )?;
        if layout.bytes > self.bytes as u64 {
            return Err(Error::InvalidArgument(format!(
                "num_nvl_bytes={} is too small: {} channels of {}-slot rings for {}-byte tokens \
                 with top-{} need {} bytes",
                self.bytes,
                args.num_channels,
                args.ring_slots,
                args.hidden_bytes,
                args.num_topk,
                layout.bytes
            )));
        }
        let blocks = kernel.blocks(args.num_channels, n as u32);
        check_residency(blocks, args.num_channels, self.residency)?;
        let mut bufs = PeerPtrs::default();
        for (slot, ptr) in bufs.p.iter_mut().zip(self.buffer.rank_ptrs()) {
            *slot = ptr;
        }
        args.bufs = bufs;
        args.sems = self.sems.ptr();
        args.error_word = self.comm.error_word_device_ptr();
        args.max_spin = 0;
        args.meta_offset = layout.meta_offset;
        args.ctrl_offset = layout.ctrl_offset;
        args.ring_offset = layout.ring_offset;
        args.slot_bytes = layout.slot_bytes;
        args.rank = rank as u32;
        args.nranks = n as u32;
        let gpu = self.comm.gpu();
        let f = self.kernels.function(
            gpu.as_ref(),
            CollectiveFile::EpIntranode,
            None,
            kernel.entry(),
        )?;
        launch_with_args(
            gpu.as_ref(),
            f,
            LaunchConfig::linear(blocks, BLOCK_THREADS),
            stream,
            args,
        )
    }
}

/// Refuses a grid whose blocks might not all be resident with the grids of the ranks sharing the
/// GPU: a dispatch's or combine's blocks wait for each other (a rank's own ring) and for the
/// peers', so they are meeting blocks ([`Residency::max_meeting_blocks`], which already counts
/// this rank's share of a shared GPU). The error names `num_sms`, DeepEP's knob for the grid.
fn check_residency(blocks: u32, channels: u32, residency: Residency) -> Result<()> {
    let limit = residency.max_meeting_blocks(BLOCK_THREADS);
    if blocks > limit {
        return Err(Error::InvalidArgument(format!(
            "num_sms={} makes {blocks} blocks of {BLOCK_THREADS} threads per rank, more than the \
             {limit} this rank's share of the GPU keeps resident at once (the blocks of the ranks \
             sharing it wait for each other): lower num_sms (Buffer.set_num_sms)",
            2 * channels
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_parse_by_name() {
        assert_eq!(EpKernel::parse("combine").unwrap(), EpKernel::Combine);
        let e = EpKernel::parse("low_latency").unwrap_err().to_string();
        assert!(e.contains("\"low_latency\""), "{e}");
    }

    #[test]
    fn grids_are_checked_against_the_share_of_the_gpu() {
        // 8 MPS ranks on one H200 (16 SMs each): 16 * 4 blocks of 256 threads, half under MPS.
        let mps = Residency {
            sm: 16,
            shares_device: false,
            mps: true,
        };
        assert_eq!(EpKernel::Dispatch.blocks(10, 8), 160);
        let e = check_residency(160, 10, mps).unwrap_err().to_string();
        assert!(
            e.contains("num_sms=20") && e.contains("160 blocks") && e.contains("32"),
            "{e}"
        );
        check_residency(EpKernel::Dispatch.blocks(2, 8), 2, mps).expect("2 channels fit");
        let whole = Residency {
            sm: 132,
            shares_device: false,
            mps: false,
        };
        check_residency(EpKernel::Dispatch.blocks(10, 8), 10, whole).expect("a whole H200");
        assert_eq!(EpKernel::Notify.blocks(10, 8), 1);
    }
}
