//! `default_alltoall_packet`: small all-to-alls through LL128 lines in the peers' scratch
//! (`alltoall_packet` in kernels/alltoall.cu). No barriers and no registration: any buffers, one
//! kernel on the caller's stream, and a device call counter that keeps graph replays in step.
//!
//! Resources, owned here until the communicator-wide ones land (native.rs rewrite): a packet
//! scratch of [`PACKET_SCRATCH_BYTES`] per rank and an 8 KiB call counter.

use super::split::uniform_chunk;
use crate::geometry::{self, LL128_LINE_BYTES, LL128_PAYLOAD};
use crate::resources::{param_ptr, DeviceBuffer, KernelTable, SharedScratch};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::native_names::ALLTOALL_PACKET;
use mscclpp_core::communicator::Communicator;
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::alltoall::AlltoallPacketArgs;
use mscclpp_kernels_cu::collectives::{
    CallState, CollectiveFile, PeerPtrs, MAX_PACKET_BLOCKS, MAX_RANKS,
};
use std::sync::Arc;

/// Scratch per rank: 2 halves x nranks slots; 2 MiB holds chunks up to 480 KiB at 2 ranks and
/// 120 KiB at 8.
pub const PACKET_SCRATCH_BYTES: usize = 2 << 20;

const DEFAULT_THREADS: u32 = 512;

/// Slot stride (whole LL128 lines) of a `scratch_bytes` scratch on `nranks` ranks.
pub fn slot_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    scratch_bytes / (2 * nranks.max(1)) / LL128_LINE_BYTES * LL128_LINE_BYTES
}

/// Largest chunk (bytes per peer) a slot carries.
pub fn max_chunk_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    slot_bytes(scratch_bytes, nranks) / LL128_LINE_BYTES * LL128_PAYLOAD
}

/// The packet all-to-all of one communicator.
pub struct AlltoallPacket {
    // Field order is drop order: device resources go before the communicator.
    kernels: KernelTable,
    scratch: SharedScratch,
    scratch_peers: PeerPtrs,
    state: DeviceBuffer,
    sm: u32,
    comm: Arc<Communicator>,
}

impl AlltoallPacket {
    /// Collective: allocates and exchanges the scratch on every rank.
    pub fn new(comm: Arc<Communicator>) -> Result<Self> {
        if comm.size() > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "{ALLTOALL_PACKET} on {} ranks: at most {MAX_RANKS} ranks on one host",
                comm.size()
            )));
        }
        let sm = comm.gpu().properties(comm.device())?.multiprocessors.max(1);
        let scratch = SharedScratch::new(&comm, PACKET_SCRATCH_BYTES)?;
        let scratch_peers = PeerPtrs::from_slice(&scratch.rank_ptrs())?;
        // Zeroed memory is CallState::default(): every per-block slot at call 0.
        let state = DeviceBuffer::zeroed(comm.gpu(), std::mem::size_of::<CallState>())?;
        Ok(AlltoallPacket {
            kernels: KernelTable::default(),
            scratch,
            scratch_peers,
            state,
            sm,
            comm,
        })
    }

    /// Largest chunk (bytes per peer) this object takes.
    pub fn max_chunk_bytes(&self) -> usize {
        max_chunk_bytes(PACKET_SCRATCH_BYTES, self.comm.size())
    }

    fn chunk(&self, args: &ExecuteArgs) -> Result<usize> {
        let (rank, n) = (self.comm.rank(), self.comm.size());
        let chunk = uniform_chunk(ALLTOALL_PACKET, args, rank, n)?;
        if chunk > self.max_chunk_bytes() {
            return Err(Error::Unsupported(format!(
                "rank {rank}: {ALLTOALL_PACKET}: chunks of {chunk} bytes exceed its scratch's {} \
                 per peer on {n} ranks",
                self.max_chunk_bytes()
            )));
        }
        if chunk > 0 && (args.input == 0 || args.output == 0) {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: {ALLTOALL_PACKET}: null input or output pointer"
            )));
        }
        Ok(chunk)
    }
}

impl Algorithm for AlltoallPacket {
    fn name(&self) -> &str {
        ALLTOALL_PACKET
    }

    fn collective(&self) -> Collective {
        Collective::AllToAll
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        self.chunk(args).map(|_| ())
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        let chunk = self.chunk(args)?;
        if chunk == 0 {
            return Ok(());
        }
        let n = self.comm.size();
        let threads = args.nthreads.unwrap_or(DEFAULT_THREADS);
        let work = chunk.saturating_mul(n.saturating_sub(1).max(1));
        let cfg = geometry::launch_config(
            args.nblocks,
            args.nthreads,
            geometry::packet_blocks(work, threads, self.sm),
            DEFAULT_THREADS,
            geometry::resident_blocks(self.sm, threads).min(MAX_PACKET_BLOCKS as u32),
        )?;
        let mut kargs = AlltoallPacketArgs {
            input: args.input,
            output: args.output,
            bytes: chunk as u64,
            peer_scratch: self.scratch_peers,
            local_scratch: self.scratch.local_ptr(),
            slot_bytes: slot_bytes(PACKET_SCRATCH_BYTES, n) as u64,
            state: self.state.ptr(),
            error_word: self.comm.error_word_device_ptr(),
            max_spin: 0,
            rank: self.comm.rank() as u32,
            nranks: n as u32,
        };
        let f = self.kernels.function(
            self.comm.gpu().as_ref(),
            CollectiveFile::AllToAll,
            None,
            "alltoall_packet",
        )?;
        let cfg = cfg.with_programmatic(true).with_cached_graph(true);
        let mut params = [param_ptr(&mut kargs)];
        // SAFETY: `params` matches the kernel's one `AlltoallPacketArgs` parameter (layout checked
        // by the NVRTC test's static_asserts); the addresses are the caller's checked buffers and our own
        // live scratch and call counter.
        unsafe { self.comm.gpu().launch(f, cfg, args.stream, &mut params) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_whole_lines_and_capacities_follow() {
        assert_eq!(slot_bytes(PACKET_SCRATCH_BYTES, 2), 512 << 10);
        assert_eq!(max_chunk_bytes(PACKET_SCRATCH_BYTES, 2), 480 << 10);
        assert_eq!(max_chunk_bytes(PACKET_SCRATCH_BYTES, 8), 120 << 10);
        let s = slot_bytes(1000, 3);
        assert_eq!(s % LL128_LINE_BYTES, 0);
        assert!(2 * 3 * s <= 1000);
    }
}
