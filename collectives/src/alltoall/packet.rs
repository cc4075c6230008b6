//! `default_alltoall_packet`: small all-to-alls through LL128 lines in the peers' scratch
//! (`alltoall_packet` in kernels/alltoall.cu). No barriers and no registration: any buffers (in
//! place too: no peer writes this rank's output, and each lane stores only what it loaded first,
//! see the kernel), one kernel on the caller's stream, and a device call counter that keeps graph
//! replays in step.
//!
//! Resources are the collection's ([`CollectionResources`]): up to [`PACKET_SCRATCH_BYTES`] of its
//! LL128 part (`nranks` slots in each half, the halves alternating by its shared call counter) and
//! that counter. [`AlltoallPacket::new`] builds a small collection of its own (one 4 MiB
//! allocation) for an engine used apart from the default collection.

use super::split::uniform_chunk;
use crate::geometry::{self, Residency, LL128_LINE_BYTES, LL128_PAYLOAD};
use crate::resources::{param_ptr, CollectionResources, KernelTable, ScratchPart, ScratchRegion};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::native_names::ALLTOALL_PACKET;
use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::Function;
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::alltoall::AlltoallPacketArgs;
use mscclpp_kernels_cu::collectives::{CollectiveFile, MAX_PACKET_BLOCKS, MAX_RANKS};
use std::sync::Arc;

/// Scratch per rank it uses at most: 2 halves x nranks slots; 4 MiB holds chunks up to 960 KiB at
/// 2 ranks and 240 KiB at 8, above what the selector gives it (`alltoall_packet_max_chunk`), in
/// the default collection's LL128 part (18 MiB), so it costs no memory of its own.
pub const PACKET_SCRATCH_BYTES: usize = 4 << 20;

/// `scratch_bytes` of the collection a stand-alone engine builds ([`AlltoallPacket::new`]): one
/// 4 MiB allocation, whose LL128 halves (1.125 MiB each) carry chunks up to 540 KiB at 2 ranks
/// and 135 KiB at 8 (larger ones are refused by name).
pub(crate) const STANDALONE_SCRATCH_BYTES: usize = 1 << 20;

const DEFAULT_THREADS: u32 = 512;

/// Blocks of [`SMALL_THREADS`] threads for calls that send at most [`SMALL_WORK_BYTES`] per rank:
/// a few LL128 lines need few warps, and smaller blocks start and finish sooner, so at least
/// [`SMALL_MIN_BLOCKS`] small blocks beat one large one there (the timings are in
/// docs/algorithms.md, "Geometry").
const SMALL_THREADS: u32 = 128;
const SMALL_WORK_BYTES: usize = 128 << 10;
const SMALL_MIN_BLOCKS: u32 = 4;

/// Default (blocks, threads) for a call that sends `work` bytes per rank on a GPU of `sm` SMs.
fn default_geometry(work: usize, sm: u32) -> (u32, u32) {
    if work <= SMALL_WORK_BYTES {
        let blocks = geometry::packet_blocks(work, SMALL_THREADS, sm);
        (blocks.max(SMALL_MIN_BLOCKS), SMALL_THREADS)
    } else {
        (
            geometry::packet_blocks(work, DEFAULT_THREADS, sm),
            DEFAULT_THREADS,
        )
    }
}

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
    resources: Arc<CollectionResources>,
    /// The collection's LL128 part.
    region: ScratchRegion,
    /// Slot stride: `nranks` slots fit in each half of `region`.
    slot_bytes: usize,
    residency: Residency,
    comm: Arc<Communicator>,
}

impl AlltoallPacket {
    /// Collective: an engine with a small collection of resources of its own (scratch and call
    /// counter: one 4 MiB allocation per rank), for use apart from a default collection (which
    /// lends its own through [`Self::with_resources`]).
    pub fn new(comm: Arc<Communicator>) -> Result<Self> {
        let resources = CollectionResources::new(&comm, STANDALONE_SCRATCH_BYTES, 0)?;
        Self::with_resources(comm, Arc::new(resources))
    }

    /// The engine of a collection: borrows `resources` (see the module docs). Its calls follow the
    /// collection's rule on streams (`CollectionResources`). Not collective.
    pub fn with_resources(
        comm: Arc<Communicator>,
        resources: Arc<CollectionResources>,
    ) -> Result<Self> {
        let n = comm.size();
        if n > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "{ALLTOALL_PACKET} on {n} ranks: at most {MAX_RANKS} ranks on one host"
            )));
        }
        let residency = Residency::of(&comm)?;
        let region = resources.region(ScratchPart::Ll128);
        let slot_bytes = slot_bytes(PACKET_SCRATCH_BYTES.min(2 * region.half_bytes()), n);
        Ok(AlltoallPacket {
            kernels: KernelTable::default(),
            resources,
            region,
            slot_bytes,
            residency,
            comm,
        })
    }

    /// Largest chunk (bytes per peer) this object takes: [`max_chunk_bytes`] of
    /// [`PACKET_SCRATCH_BYTES`] unless the collection's LL128 part is smaller.
    pub fn max_chunk_bytes(&self) -> usize {
        self.slot_bytes / LL128_LINE_BYTES * LL128_PAYLOAD
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

impl AlltoallPacket {
    /// The kernel, compiled and loaded on first use.
    fn kernel(&self) -> Result<Function> {
        self.kernels.function(
            self.comm.gpu().as_ref(),
            CollectiveFile::AllToAll,
            None,
            "alltoall_packet",
        )
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

    fn prepare(&self, args: &ExecuteArgs) -> Result<()> {
        if self.chunk(args)? > 0 {
            self.kernel()?;
        }
        Ok(())
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        let chunk = self.chunk(args)?;
        if chunk == 0 {
            return Ok(());
        }
        let n = self.comm.size();
        let work = chunk.saturating_mul(n.saturating_sub(1).max(1));
        let (default_blocks, default_threads) = default_geometry(work, self.residency.sm);
        let threads = args.nthreads.unwrap_or(default_threads);
        let blocks = match args.nthreads {
            // Blocks follow the threads the caller asked for.
            Some(t) => geometry::packet_blocks(work, t, self.residency.sm),
            None => default_blocks,
        };
        let cfg = geometry::launch_config(
            args.nblocks,
            args.nthreads,
            blocks,
            default_threads,
            self.residency
                .max_blocks(threads)
                .min(MAX_PACKET_BLOCKS as u32),
        )?;
        let mut kargs = AlltoallPacketArgs {
            input: args.input,
            output: args.output,
            bytes: chunk as u64,
            peer_scratch: self.region.peers,
            local_scratch: self.region.local,
            slot_bytes: self.slot_bytes as u64,
            half_bytes: self.region.half_bytes() as u64,
            state: self.resources.state_ptr(),
            error_word: self.comm.error_word_device_ptr(),
            max_spin: 0,
            rank: self.comm.rank() as u32,
            nranks: n as u32,
        };
        let f = self.kernel()?;
        let cfg = cfg
            .with_programmatic(self.comm.fast_launches())
            .with_cached_graph(self.comm.fast_launches());
        let mut params = [param_ptr(&mut kargs)];
        // SAFETY: `params` matches the kernel's one `AlltoallPacketArgs` parameter (layout checked
        // by the NVRTC test's static_asserts); the addresses are the caller's checked buffers and
        // the collection's live scratch and call counter.
        unsafe { self.comm.gpu().launch(f, cfg, args.stream, &mut params) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_calls_take_small_blocks() {
        // 1 KiB at 2 ranks (512 bytes to the peer): four blocks of 128 threads.
        assert_eq!(
            default_geometry(512, 132),
            (SMALL_MIN_BLOCKS, SMALL_THREADS)
        );
        // 128 KiB per rank: as many 128-thread blocks as the packets need.
        let (blocks, threads) = default_geometry(SMALL_WORK_BYTES, 132);
        assert_eq!(threads, SMALL_THREADS);
        assert_eq!(
            blocks,
            geometry::packet_blocks(SMALL_WORK_BYTES, SMALL_THREADS, 132)
        );
        // Beyond: 512-thread blocks, as before.
        assert_eq!(
            default_geometry(SMALL_WORK_BYTES + 1, 132).1,
            DEFAULT_THREADS
        );
    }

    #[test]
    fn slots_are_whole_lines_and_capacities_follow() {
        assert_eq!(slot_bytes(PACKET_SCRATCH_BYTES, 2), 1 << 20);
        assert_eq!(max_chunk_bytes(PACKET_SCRATCH_BYTES, 2), 960 << 10);
        assert_eq!(max_chunk_bytes(PACKET_SCRATCH_BYTES, 8), 240 << 10);
        let s = slot_bytes(1000, 3);
        assert_eq!(s % LL128_LINE_BYTES, 0);
        assert!(2 * 3 * s <= 1000);
    }
}
