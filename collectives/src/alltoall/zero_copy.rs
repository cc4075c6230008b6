//! `default_alltoall_zero_copy` and the exchange engine behind all-to-all-v, gather and scatter:
//! one kernel (`alltoallv_zero_copy` in kernels/alltoall.cu) that pushes every rank's chunks
//! straight into the receivers' registered outputs. Receivers publish their receive tables on the
//! device, so callers pass only their own counts and displacements (host arrays), and a sender and
//! receiver that disagree are caught on the device (`DEVICE_ERROR_COUNT_MISMATCH`) with nothing
//! sent between them; [`check_local`] catches what one rank can see on the host first, and the
//! debug host check ([`AlltoallZeroCopy::with_host_check`]) names the two ranks that disagree.
//!
//! Each call is one kernel on the caller's stream with no host synchronisation, so it is legal
//! during CUDA-graph capture; the outputs are registered through the [`RegistrationCache`] (host
//! only) on first use, which is collective: every rank calls with its buffers in the same pattern.
//!
//! Resources, owned here until the communicator-wide ones land (native.rs rewrite): per-block
//! semaphores (`MAX_ALLTOALL_BLOCKS` x peers), a 16 KiB table scratch per rank and a 4 KiB
//! stand-in output.

use super::split::{check_local, check_matrix, uniform_chunk, Split};
use crate::geometry::{self, resident_blocks};
use crate::resources::{
    param_ptr, BlockSemaphores, DeviceBuffer, KernelTable, RegistrationCache, SharedScratch,
};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::{DevicePtr, Stream};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::alltoall::{
    AlltoallArgs, AlltoallDeviceArgs, MAX_ALLTOALL_BLOCKS, TABLE_SCRATCH_BYTES,
};
use mscclpp_kernels_cu::collectives::{CollectiveFile, PeerPtrs, MAX_RANKS};
use std::sync::Arc;

pub use mscclpp_core::algorithm_collection::native_names::ALLTOALL_ZERO_COPY;

/// Default threads per block (at least one per peer for the barriers).
const DEFAULT_THREADS: u32 = 512;

/// Blocks of an exchange whose per-rank sizes differ (all-to-all-v): every rank must launch the
/// same grid, and no rank knows the others' sizes, so it cannot follow the message size.
const EXCHANGE_BLOCKS: u32 = 32;

/// Bytes of the buffer registered in place of an empty output (a buffer of its own, so that no
/// allocation is registered twice).
const STANDIN_BYTES: usize = 4096;

/// One buffer of one rank's side of an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffer {
    pub ptr: DevicePtr,
    pub bytes: usize,
}

/// The zero-copy exchange engine of one communicator. See the module docs.
pub struct AlltoallZeroCopy {
    // Field order is drop order: device resources go before the communicator.
    kernels: KernelTable,
    registrations: RegistrationCache,
    semaphores: BlockSemaphores,
    /// Owned for its lifetime only: the kernel reaches it through `table_peers`.
    _tables: SharedScratch,
    table_peers: PeerPtrs,
    /// Registered in place of an empty output (see `output_or_standin`).
    standin: DeviceBuffer,
    max_blocks: u32,
    host_check: bool,
    comm: Arc<Communicator>,
}

impl AlltoallZeroCopy {
    /// Collective: reserves the semaphores and the table scratch on every rank.
    pub fn new(comm: Arc<Communicator>) -> Result<Self> {
        if comm.size() > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "{ALLTOALL_ZERO_COPY} on {} ranks: at most {MAX_RANKS} ranks on one host",
                comm.size()
            )));
        }
        let sm = comm.gpu().properties(comm.device())?.multiprocessors.max(1);
        let max_blocks = (MAX_ALLTOALL_BLOCKS as u32)
            .min(sm)
            .min(resident_blocks(sm, DEFAULT_THREADS));
        let semaphores = BlockSemaphores::new(&comm, max_blocks)?;
        let tables = SharedScratch::new(&comm, TABLE_SCRATCH_BYTES)?;
        let table_peers = PeerPtrs::from_slice(&tables.rank_ptrs())?;
        let standin = DeviceBuffer::zeroed(comm.gpu(), STANDIN_BYTES)?;
        Ok(AlltoallZeroCopy {
            kernels: KernelTable::default(),
            registrations: RegistrationCache::default(),
            semaphores,
            _tables: tables,
            table_peers,
            standin,
            max_blocks,
            host_check: false,
            comm,
        })
    }

    /// Debug mode: before every exchange the ranks gather each other's counts over the bootstrap
    /// (host only, so still legal during capture, but a round trip per call) and fail with an
    /// error naming the sender, the receiver and both counts when they disagree. Every rank must
    /// choose the same.
    pub fn with_host_check(mut self, on: bool) -> Self {
        self.host_check = on;
        self
    }

    /// The debug host check (see [`Self::with_host_check`]).
    /// `splits` is `None` where this rank's own arguments are invalid (it then reports that).
    fn check_across_ranks(&self, splits: Option<(&Split, &Split)>) -> Result<()> {
        let mut mine = Vec::new();
        if let Some((send, recv)) = splits {
            for c in send.counts.iter().chain(&recv.counts) {
                mine.extend_from_slice(&(*c as u64).to_le_bytes());
            }
        }
        let all = self.comm.bootstrap().all_gather(&mine)?;
        if splits.is_none() {
            return Ok(());
        }
        let n = self.comm.size();
        if let Some(r) = all.iter().position(Vec::is_empty) {
            return Err(Error::InvalidArgument(format!(
                "rank {}: rank {r} called the exchange with invalid arguments (its error names them)",
                self.comm.rank()
            )));
        }
        let (mut sends, mut recvs) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (r, bytes) in all.iter().enumerate() {
            let counts: Vec<usize> = bytes
                .chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()) as usize)
                .collect();
            if counts.len() != 2 * n {
                return Err(Error::Internal(format!(
                    "rank {r} sent {} bytes of counts, expected {}",
                    bytes.len(),
                    16 * n
                )));
            }
            let split = |c: &[usize]| Split {
                counts: c.to_vec(),
                displs: vec![0; n],
            };
            sends.push(split(&counts[..n]));
            recvs.push(split(&counts[n..]));
        }
        check_matrix(&sends, &recvs)
    }

    pub fn comm(&self) -> &Arc<Communicator> {
        &self.comm
    }

    /// Largest grid a call may ask for.
    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    /// All-to-all-v with this rank's host-side splits (bytes): sends `send.counts[p]` bytes at
    /// `send.displs[p]` of `input` to rank `p`, which stores them at its own receive displacement
    /// for this rank. Every rank must call (collective), each with the same `blocks` (`None`: the
    /// fixed default) and `threads`.
    #[allow(clippy::too_many_arguments)]
    pub fn alltoallv(
        &self,
        input: Buffer,
        output: Buffer,
        send: &Split,
        recv: &Split,
        stream: Stream,
        blocks: Option<u32>,
        threads: Option<u32>,
    ) -> Result<()> {
        self.exchange(
            input,
            output,
            send,
            recv,
            stream,
            blocks.or(Some(EXCHANGE_BLOCKS.min(self.max_blocks))),
            threads,
        )
    }

    /// Gather: every rank's `bytes` of `input` land in `root`'s output in rank order. `output` is
    /// only read on the root (others may pass an empty buffer).
    pub fn gather(
        &self,
        input: Buffer,
        output: Buffer,
        bytes: usize,
        root: usize,
        stream: Stream,
    ) -> Result<()> {
        let (rank, n) = (self.comm.rank(), self.comm.size());
        self.check_root("gather", root)?;
        let send = Split::only(n, root, bytes);
        let recv = if rank == root {
            Split::uniform(n, bytes)
        } else {
            Split::only(n, root, 0)
        };
        let blocks = geometry::bandwidth_blocks(bytes.saturating_mul(n), self.max_blocks);
        self.exchange(input, output, &send, &recv, stream, Some(blocks), None)
    }

    /// Scatter: chunk `p` (`bytes` at `p * bytes`) of `root`'s input lands in rank `p`'s output.
    /// `input` is only read on the root.
    pub fn scatter(
        &self,
        input: Buffer,
        output: Buffer,
        bytes: usize,
        root: usize,
        stream: Stream,
    ) -> Result<()> {
        let (rank, n) = (self.comm.rank(), self.comm.size());
        self.check_root("scatter", root)?;
        let send = if rank == root {
            Split::uniform(n, bytes)
        } else {
            Split::only(n, root, 0)
        };
        let recv = Split::only(n, root, bytes);
        let blocks = geometry::bandwidth_blocks(bytes.saturating_mul(n), self.max_blocks);
        self.exchange(input, output, &send, &recv, stream, Some(blocks), None)
    }

    fn check_root(&self, what: &str, root: usize) -> Result<()> {
        if root >= self.comm.size() {
            return Err(Error::InvalidArgument(format!(
                "rank {}: {what} root {root} is not a rank of {}",
                self.comm.rank(),
                self.comm.size()
            )));
        }
        Ok(())
    }

    /// The stand-in registered for a rank whose output is empty: registration is collective, so
    /// every rank registers something; nothing is written to it (all its receive counts are 0).
    fn output_or_standin(&self, output: Buffer) -> Buffer {
        if output.ptr == 0 || output.bytes == 0 {
            Buffer {
                ptr: self.standin.ptr(),
                bytes: STANDIN_BYTES,
            }
        } else {
            output
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn exchange(
        &self,
        input: Buffer,
        output: Buffer,
        send: &Split,
        recv: &Split,
        stream: Stream,
        blocks: Option<u32>,
        threads: Option<u32>,
    ) -> Result<()> {
        let (rank, n) = (self.comm.rank(), self.comm.size());
        let local = check_local(rank, n, send, input.bytes, recv, output.bytes);
        if self.host_check {
            // Every rank joins the gather, so one rank's bad arguments fail all of them at once.
            self.check_across_ranks(local.is_ok().then_some((send, recv)))?;
        }
        local?;
        let null = |what: &str| {
            Error::InvalidArgument(format!(
                "rank {rank}: null {what} pointer for a non-empty side"
            ))
        };
        if send.total() > 0 && input.ptr == 0 {
            return Err(null("input"));
        }
        if recv.total() > 0 && output.ptr == 0 {
            return Err(null("output"));
        }
        let mut args = AlltoallArgs {
            input: input.ptr,
            outputs: self.rank_outputs(output)?,
            tables: self.table_peers,
            sems: self.semaphores.ptr(),
            error_word: self.comm.error_word_device_ptr(),
            max_spin: 0,
            rank: rank as u32,
            nranks: n as u32,
            ..AlltoallArgs::default()
        };
        for p in 0..n {
            args.send_counts[p] = send.counts[p] as u64;
            args.send_displs[p] = send.displs[p] as u64;
            args.recv_counts[p] = recv.counts[p] as u64;
            args.recv_displs[p] = recv.displs[p] as u64;
        }
        // SAFETY: `AlltoallArgs` is the kernel's one parameter (layout checked by the NVRTC test's
        // static_asserts); its addresses are the caller's checked buffers, the peers' registered
        // outputs and our own live semaphores and table scratch.
        unsafe { self.launch("alltoallv_zero_copy", &mut args, stream, blocks, threads) }
    }

    /// All-to-all-v with the send counts in device memory, as MoE routing produces them (no host
    /// round trip, so it can sit inside a CUDA graph with the routing): `send_counts` holds
    /// `nranks` u64 counts in units of `unit_bytes` (e.g. one token's row), both buffers are
    /// packed in rank order, and the kernel writes what this rank received from each rank (units)
    /// to `recv_counts` (`nranks` u64). Counts that overflow a buffer are a device error
    /// (`DEVICE_ERROR_COUNT_MISMATCH`) and move nothing to that destination. Collective; every rank
    /// passes the same `blocks` (`None`: the fixed default).
    #[allow(clippy::too_many_arguments)]
    pub fn alltoallv_device_counts(
        &self,
        input: Buffer,
        output: Buffer,
        send_counts: DevicePtr,
        recv_counts: DevicePtr,
        unit_bytes: usize,
        stream: Stream,
        blocks: Option<u32>,
    ) -> Result<()> {
        let rank = self.comm.rank();
        if unit_bytes == 0 || send_counts == 0 || recv_counts == 0 {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: alltoallv with device counts needs a unit size (got {unit_bytes}) \
                 and both count arrays (send {send_counts:#x}, receive {recv_counts:#x})"
            )));
        }
        let mut args = AlltoallDeviceArgs {
            input: input.ptr,
            input_bytes: if input.ptr == 0 {
                0
            } else {
                input.bytes as u64
            },
            outputs: self.rank_outputs(output)?,
            tables: self.table_peers,
            send_counts,
            recv_counts,
            unit_bytes: unit_bytes as u64,
            output_bytes: if output.ptr == 0 {
                0
            } else {
                output.bytes as u64
            },
            sems: self.semaphores.ptr(),
            error_word: self.comm.error_word_device_ptr(),
            max_spin: 0,
            rank: rank as u32,
            nranks: self.comm.size() as u32,
        };
        let blocks = blocks.or(Some(EXCHANGE_BLOCKS.min(self.max_blocks)));
        // SAFETY: `AlltoallDeviceArgs` is the kernel's one parameter (layout checked by the NVRTC test's
        // static_asserts); the count arrays are the caller's device memory of `nranks` u64 each,
        // the kernel never touches more of a buffer than its given size, and the rest are our own
        // live resources.
        unsafe { self.launch("alltoallv_device_counts", &mut args, stream, blocks, None) }
    }

    /// Every rank's output, registered (collective; see `output_or_standin`).
    fn rank_outputs(&self, output: Buffer) -> Result<PeerPtrs> {
        let registered = self.output_or_standin(output);
        let outputs = self
            .registrations
            .rank_ptrs(&self.comm, registered.ptr, registered.bytes)?;
        PeerPtrs::from_slice(&outputs)
    }

    /// Launches `entry` of the all-to-all unit with its one argument struct `args`.
    ///
    /// # Safety
    /// `A` must be the entry point's parameter type and every address in it valid for the call.
    unsafe fn launch<A>(
        &self,
        entry: &'static str,
        args: &mut A,
        stream: Stream,
        blocks: Option<u32>,
        threads: Option<u32>,
    ) -> Result<()> {
        let cfg = geometry::launch_config(blocks, threads, 1, DEFAULT_THREADS, self.max_blocks)?;
        let f = self.kernels.function(
            self.comm.gpu().as_ref(),
            CollectiveFile::AllToAll,
            None,
            entry,
        )?;
        let cfg = cfg.with_programmatic(true).with_cached_graph(true);
        let mut params = [param_ptr(args)];
        // SAFETY: per this function's contract.
        unsafe { self.comm.gpu().launch(f, cfg, stream, &mut params) }
    }
}

impl Algorithm for AlltoallZeroCopy {
    fn name(&self) -> &str {
        ALLTOALL_ZERO_COPY
    }

    fn collective(&self) -> Collective {
        Collective::AllToAll
    }

    /// `input_bytes` is this rank's whole send buffer, cut into one equal chunk per rank (in
    /// whole elements); the output receives one chunk from each rank, in rank order.
    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        uniform_chunk(ALLTOALL_ZERO_COPY, args, self.comm.rank(), self.comm.size()).map(|_| ())
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        let n = self.comm.size();
        let chunk = uniform_chunk(ALLTOALL_ZERO_COPY, args, self.comm.rank(), n)?;
        if chunk == 0 {
            return Ok(());
        }
        let split = Split::uniform(n, chunk);
        let blocks = args.nblocks.or(Some(geometry::bandwidth_blocks(
            args.input_bytes,
            self.max_blocks,
        )));
        self.exchange(
            Buffer {
                ptr: args.input,
                bytes: args.input_bytes,
            },
            Buffer {
                ptr: args.output,
                bytes: args.output_bytes,
            },
            &split,
            &split,
            args.stream,
            blocks,
            args.nthreads,
        )
    }
}
