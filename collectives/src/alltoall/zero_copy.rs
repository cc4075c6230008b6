//! `default_alltoall_zero_copy` and the exchange engine behind all-to-all-v, gather and scatter:
//! one kernel (`alltoallv_zero_copy` in kernels/alltoall.cu) that pushes every rank's chunks
//! straight into the receivers' registered outputs (or, for gather, `alltoallv_zero_copy_pull`,
//! which pulls them from the senders' registered inputs). Every rank publishes its counts on the
//! device, so callers pass only their own counts and displacements (host arrays), and senders and
//! receivers that disagree are caught on the device by every rank alike: nothing is sent anywhere,
//! every rank's communicator fails with `DEVICE_ERROR_COUNT_MISMATCH` and
//! [`AlltoallZeroCopy::check_device_errors`] names the two ranks on every rank. [`check_local`]
//! catches what one rank can see on the host first, and the debug host check
//! ([`AlltoallZeroCopy::with_host_check`]) refuses the call before any launch.
//!
//! Each call is one kernel on the caller's stream with no host synchronisation, so it is legal
//! during CUDA-graph capture; the registered side's addresses are agreed by every rank on every
//! call (`crate::user_buffers`, host only). So that every rank has a buffer to agree on whatever
//! the other ranks pass, the registered side is one every rank has: all-to-all(-v) and scatter
//! push into the receivers' outputs (every rank receives), gather pulls from the senders' inputs
//! (every rank sends; the non-roots' outputs are never touched, and may be null).
//!
//! Resources are the collection's ([`CollectionResources`]): the first blocks of its semaphore
//! table, its `AlltoallState` and its staging part, the start for the tables, the rest
//! ([`CollectionResources::alltoall_stage`]) for copies (see there why sharing them is safe).
//! [`AlltoallZeroCopy::new`] builds a small collection of its own (one 2 MiB allocation) for an
//! engine used apart from the default collection.
//!
//! In place (all-to-all and all-to-all-v with one buffer for both sides, as NCCL's `ncclAlltoAll`
//! allows): a peer's bytes land where this rank's bytes for that peer wait to be sent. Each rank
//! plans its side from its own arguments ([`InPlace`]):
//! - a send extent that fits the stage is copied whole into the stage first and sent from there
//!   (the kernel and the peers see an out-of-place call), so a rank in place and a peer out of
//!   place may meet in one call;
//! - beyond the stage, where each region the rank sends to a peer is also the one it receives that
//!   peer's bytes into (always so for all-to-all), the pair swaps: `alltoallv_zero_copy_swap`
//!   loads each byte on both sides before storing either, with nothing staged. Both ranks of every
//!   pair must do so, so each rank says in the call's buffer agreement whether it swaps: when
//!   every rank does, every rank launches the swap; when only some do, every rank fails with the
//!   same error naming a rank that swaps and one that does not, before anything moves;
//! - any other in-place call beyond the stage (all-to-all-v whose send and receive regions
//!   differ) is refused by name, through the agreement so that the peers fail with it.
//!
//! Small gathers and scatters ([`rooted_via_stage`], decided from the chunk size and world size,
//! the same on every rank) register nothing: every sender copies what it sends into its stage and
//! the receivers pull it from there, so such calls need no buffer agreement (one bootstrap
//! all-gather fewer per call).

use super::split::{check_local, check_matrix, mismatch_message, uniform_chunk, Side, Split};
use crate::geometry::{self, Residency};
use crate::resources::{param_ptr, CollectionResources, KernelTable, ScratchRegion};
use crate::user_buffers::{Agreed, UserBuffer, UserBufferTable};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::{DevicePtr, LaunchConfig, Stream};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::alltoall::{
    AlltoallArgs, AlltoallDeviceArgs, AlltoallState, MAX_ALLTOALL_BLOCKS,
};
use mscclpp_kernels_cu::collectives::{CollectiveFile, PeerPtrs, MAX_RANKS};
use std::sync::Arc;

pub use mscclpp_core::algorithm_collection::native_names::ALLTOALL_ZERO_COPY;

/// Default threads per block (at least one per peer for the barriers).
const DEFAULT_THREADS: u32 = 512;

/// Blocks of an exchange whose per-rank sizes differ (all-to-all-v): every rank must launch the
/// same grid, and no rank knows the others' sizes, so it cannot follow the message size.
const EXCHANGE_BLOCKS: u32 = 32;

/// `scratch_bytes` of the collection a stand-alone engine builds ([`AlltoallZeroCopy::new`]): the
/// smallest whose staging part holds the tables at 8 ranks (one 2 MiB allocation in all).
pub(crate) const STANDALONE_SCRATCH_BYTES: usize = 128 << 10;

/// How this rank runs its side of an all-to-all(-v) whose input and output may be one buffer
/// ([`in_place_plan`]). Its peers run the same whatever this rank chooses (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InPlace {
    /// Distinct buffers (or nothing sent or nothing received): as it is.
    No,
    /// One buffer: its first `bytes` (the whole send extent) are copied into the stage first, and
    /// the exchange sends from the copy.
    Copy { bytes: usize },
    /// One buffer whose send regions are its receive regions, beyond the stage: every pair swaps
    /// its two regions, provided every rank swaps (module docs). `bytes` is the send extent.
    Swap { bytes: usize },
}

/// [`InPlace`] for `rank` of `nranks` sending `send` from `input` and receiving `recv` into
/// `output`, with a stage of `stage_bytes`; the error (naming the rank, the call `what` and the
/// sizes) where the buffers overlap other than exactly, or an in-place send extent beyond the
/// stage has receive regions other than its send regions. No device access (tested on the CPU).
pub fn in_place_plan(
    what: &str,
    rank: usize,
    (input, send): (Buffer, &Split),
    (output, recv): (Buffer, &Split),
    stage_bytes: usize,
) -> Result<InPlace> {
    if send.total() == 0 || recv.total() == 0 || input.ptr == 0 || output.ptr == 0 {
        return Ok(InPlace::No);
    }
    let overlap = input.ptr < output.ptr.saturating_add(output.bytes as u64)
        && output.ptr < input.ptr.saturating_add(input.bytes as u64);
    if !overlap {
        return Ok(InPlace::No);
    }
    if input.ptr != output.ptr {
        return Err(Error::Unsupported(format!(
            "rank {rank}: {what} with overlapping send and receive buffers other than in place \
             (send {:#x}, receive {:#x})",
            input.ptr, output.ptr
        )));
    }
    let extent = send.extent(rank, Side::Send)?;
    if extent <= stage_bytes {
        return Ok(InPlace::Copy { bytes: extent });
    }
    if send == recv {
        return Ok(InPlace::Swap { bytes: extent });
    }
    Err(Error::Unsupported(format!(
        "rank {rank}: {what} in place of {extent} bytes with receive regions other than its send \
         regions: such a call is served up to the collection's all-to-all stage ({stage_bytes} \
         bytes), whose copy of the input the exchange sends from, and beyond it only where each \
         peer's bytes land where this rank's bytes for that peer were; pass distinct send and \
         receive buffers"
    )))
}

/// Whether a gather or scatter of `bytes` per rank on `nranks` ranks goes through the senders'
/// stages (`stage_bytes` each) instead of registered buffers: when the root's whole side fits.
/// Every rank decides alike (the chunk and the world size are the call's, and every rank's
/// collection is built with the same scratch size, as the selector's packet limits also assume).
pub fn rooted_via_stage(bytes: usize, nranks: usize, stage_bytes: usize) -> bool {
    bytes
        .checked_mul(nranks)
        .is_some_and(|total| total <= stage_bytes)
}

/// How an exchange reaches the device beside its buffers ([`AlltoallZeroCopy::exchange`]).
#[derive(Debug, Clone, Copy, Default)]
struct Staging {
    /// Bytes of the input copied into this rank's stage just before the launch (0: none); the
    /// kernel's side of the input is the copy (push: it sends from it; pull: the peers read it).
    copy_input: usize,
    /// Pull: the peers read every rank's stage, not registered inputs (nothing is registered).
    peers_read_stage: bool,
    /// Push in place beyond the stage ([`InPlace::Swap`]): this rank's send extent, said in the
    /// agreement (0: this rank does not swap).
    swap: usize,
}

/// One buffer of one rank's side of an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffer {
    pub ptr: DevicePtr,
    pub bytes: usize,
}

/// The rooted exchanges of the engine ([`AlltoallZeroCopy::rooted`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rooted {
    /// Every rank's chunk of its input lands in the root's output in rank order. The root pulls
    /// from the registered inputs, so every rank's input is what is registered (module docs).
    Gather,
    /// Chunk `p` (`bytes` at `p * bytes`) of the root's input lands in rank `p`'s output; every
    /// rank's output is what is registered (module docs).
    Scatter,
}

impl Rooted {
    pub fn name(self) -> &'static str {
        match self {
            Rooted::Gather => "gather",
            Rooted::Scatter => "scatter",
        }
    }
}

/// Which side of an exchange is registered and addressed by the peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Senders store into the receivers' registered outputs (`alltoallv_zero_copy`).
    Push,
    /// Receivers load from the senders' registered inputs (`alltoallv_zero_copy_pull`).
    Pull,
    /// Every rank in place: each pair swaps its regions in the registered buffers
    /// (`alltoallv_zero_copy_swap`).
    Swap,
}

impl Direction {
    /// The kernel entry point of an exchange in this direction.
    fn entry(self) -> &'static str {
        match self {
            Direction::Push => "alltoallv_zero_copy",
            Direction::Pull => "alltoallv_zero_copy_pull",
            Direction::Swap => "alltoallv_zero_copy_swap",
        }
    }
}

/// The zero-copy exchange engine of one communicator. See the module docs.
pub struct AlltoallZeroCopy {
    // Field order is drop order: device resources go before the communicator.
    kernels: KernelTable,
    user_buffers: UserBufferTable,
    resources: Arc<CollectionResources>,
    /// Every rank's table space (in `resources`' staging part).
    tables: PeerPtrs,
    /// Every rank's copy space, the rest of the staging part.
    stage: ScratchRegion,
    max_blocks: u32,
    host_check: bool,
    comm: Arc<Communicator>,
}

impl AlltoallZeroCopy {
    /// Collective: an engine with a small collection of resources of its own (semaphores, tables,
    /// state: one 2 MiB allocation per rank), for use apart from a default collection (which lends
    /// its own through [`Self::with_resources`]). Two engines built this way may run on unordered
    /// streams at once.
    pub fn new(comm: Arc<Communicator>) -> Result<Self> {
        let max_blocks = Self::grid_limit(&comm)?;
        let resources = CollectionResources::new(&comm, STANDALONE_SCRATCH_BYTES, max_blocks)?;
        Self::with_resources(comm, Arc::new(resources))
    }

    /// The engine of a collection: borrows `resources` (see the module docs). Its calls follow the
    /// collection's rule on streams (`CollectionResources`). Not collective.
    pub fn with_resources(
        comm: Arc<Communicator>,
        resources: Arc<CollectionResources>,
    ) -> Result<Self> {
        let max_blocks = Self::grid_limit(&comm)?.min(resources.semaphore_blocks());
        if max_blocks == 0 {
            return Err(Error::InvalidArgument(format!(
                "{ALLTOALL_ZERO_COPY}: the collection reserved no semaphores"
            )));
        }
        let tables = resources.alltoall_tables()?.peers;
        let stage = resources.alltoall_stage();
        Ok(AlltoallZeroCopy {
            kernels: KernelTable::default(),
            user_buffers: UserBufferTable::new("all-to-all exchange"),
            resources,
            tables,
            stage,
            max_blocks,
            host_check: false,
            comm,
        })
    }

    /// Largest grid on this communicator's GPU: co-resident, and within the table slots.
    fn grid_limit(comm: &Communicator) -> Result<u32> {
        if comm.size() > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "{ALLTOALL_ZERO_COPY} on {} ranks: at most {MAX_RANKS} ranks on one host",
                comm.size()
            )));
        }
        let residency = Residency::of(comm)?;
        Ok((MAX_ALLTOALL_BLOCKS as u32)
            .min(residency.sm)
            .min(residency.max_blocks(DEFAULT_THREADS)))
    }

    /// The communicator's device error (as [`Communicator::check_device_errors`]), naming the two
    /// ranks (and both counts) where an exchange of this engine found senders and receivers
    /// disagreeing: every rank of that exchange fails with the same pair. Reads the report with a
    /// blocking copy, so call it after synchronising the stream, as that check.
    pub fn check_device_errors(&self) -> Result<()> {
        let Err(e) = self.comm.check_device_errors() else {
            return Ok(());
        };
        let mut bytes = vec![0u8; std::mem::size_of::<AlltoallState>()];
        self.comm
            .gpu()
            .copy_from_device(&mut bytes, self.resources.alltoall_state_ptr())?;
        let Some(state) = AlltoallState::from_le_bytes(&bytes).filter(|s| s.found != 0) else {
            return Err(e);
        };
        let m = state.mismatch;
        let what = match (m.sender, m.receiver) {
            (u32::MAX, r) => format!(
                "the senders to rank {r} send {} bytes in all, beyond its output's {}",
                m.sent, m.expected
            ),
            (s, u32::MAX) => format!(
                "rank {s}'s counts take {} bytes, beyond its input's {}",
                m.sent, m.expected
            ),
            (s, r) => {
                mismatch_message(s as usize, r as usize, m.sent as usize, m.expected as usize)
            }
        };
        Err(Error::InvalidArgument(format!(
            "{e}: {what}; nothing was sent"
        )))
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
    /// fixed default) and `threads`. Every rank passes an output buffer (non-null, even of 0
    /// bytes where it receives nothing): the outputs are what is registered (module docs).
    /// In place (`input` and `output` one buffer) as [`InPlace`] says: any splits whose send
    /// extent fits [`Self::stage_bytes`], larger ones where `send` and `recv` give the same regions
    /// on every rank.
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
        self.push(
            "alltoallv",
            (input, send),
            (output, recv),
            stream,
            blocks.or(Some(EXCHANGE_BLOCKS.min(self.max_blocks))),
            threads,
        )
    }

    /// Bytes of this rank's stage (the collection's staging part after the tables): the largest
    /// in-place send extent copied whole, and the root's side of the largest gather or scatter that
    /// registers nothing ([`rooted_via_stage`]).
    pub fn stage_bytes(&self) -> usize {
        self.stage.bytes
    }

    /// This rank's [`InPlace`] for a push exchange of `input`/`send` into `output`/`recv`.
    pub fn in_place(
        &self,
        what: &str,
        input: (Buffer, &Split),
        output: (Buffer, &Split),
    ) -> Result<InPlace> {
        in_place_plan(what, self.comm.rank(), input, output, self.stage.bytes)
    }

    /// A push exchange (all-to-all, all-to-all-v), in place as [`Self::in_place`] says.
    fn push(
        &self,
        what: &str,
        (input, send): (Buffer, &Split),
        (output, recv): (Buffer, &Split),
        stream: Stream,
        blocks: Option<u32>,
        threads: Option<u32>,
    ) -> Result<()> {
        // A refusal still joins the call's buffer agreement, where peers out of place wait.
        let plan = self.in_place(what, (input, send), (output, recv));
        let plan = plan.map_err(|e| self.user_buffers.refuse(&self.comm, AGREED_BUFFERS, e))?;
        let staging = match plan {
            InPlace::No => Staging::default(),
            InPlace::Copy { bytes } => Staging {
                copy_input: bytes,
                ..Staging::default()
            },
            InPlace::Swap { bytes } => Staging {
                swap: bytes,
                ..Staging::default()
            },
        };
        self.exchange(
            what,
            Direction::Push,
            input,
            output,
            send,
            recv,
            stream,
            blocks,
            threads,
            staging,
        )
    }

    /// Gather or scatter (`op`) of `bytes` per rank with `root`: see [`Rooted`] for which buffer
    /// each reads and which side is registered; up to [`rooted_via_stage`] nothing is registered:
    /// every sender copies its side into its stage and the receivers pull it from there. A buffer a
    /// rank off the root does not use (gather's output, scatter's input) is never read, so it may
    /// be empty or null. In place as NCCL defines it (the root's own chunk at its own slot of its
    /// larger buffer) needs nothing more: only the root's own chunk meets itself. Every rank passes
    /// the same `blocks` and `threads` (`None`: the engine's choice, [`gather_blocks`]).
    #[allow(clippy::too_many_arguments)]
    pub fn rooted(
        &self,
        op: Rooted,
        input: Buffer,
        output: Buffer,
        bytes: usize,
        root: usize,
        stream: Stream,
        blocks: Option<u32>,
        threads: Option<u32>,
    ) -> Result<()> {
        let (rank, n) = (self.comm.rank(), self.comm.size());
        self.check_root(op.name(), root)?;
        // The same on every rank: nothing to move anywhere.
        if bytes == 0 {
            return Ok(());
        }
        // The root's side holds a chunk per rank; every other side one chunk, to or from the root.
        let one = Split::only(n, root, bytes);
        let all = if rank == root {
            Split::uniform(n, bytes)
        } else {
            Split::only(n, root, 0)
        };
        let (send, recv) = match op {
            Rooted::Gather => (one, all),
            Rooted::Scatter => (all, one),
        };
        let (direction, staging) = if rooted_via_stage(bytes, n, self.stage.bytes) {
            let staging = Staging {
                copy_input: send.extent(rank, Side::Send)?,
                peers_read_stage: true,
                swap: 0,
            };
            (Direction::Pull, staging)
        } else {
            let direction = match op {
                Rooted::Gather => Direction::Pull,
                Rooted::Scatter => Direction::Push,
            };
            (direction, Staging::default())
        };
        self.exchange(
            op.name(),
            direction,
            input,
            output,
            &send,
            &recv,
            stream,
            blocks.or(Some(gather_blocks(bytes, n, self.max_blocks))),
            threads,
            staging,
        )
    }

    /// [`rooted`](Self::rooted)'s host work before launching (see `prepare_exchange`) for `bytes`
    /// per rank: loading the kernel of the way the call goes (through the stages up to
    /// [`rooted_via_stage`], else the root pulls for a gather and pushes for a scatter).
    pub fn prepare_rooted(&self, op: Rooted, bytes: usize, root: usize) -> Result<()> {
        self.check_root(op.name(), root)?;
        if rooted_via_stage(bytes, self.comm.size(), self.stage.bytes) {
            return self.prepare_exchange(Direction::Pull);
        }
        match op {
            Rooted::Gather => self.prepare_exchange(Direction::Pull),
            Rooted::Scatter => self.prepare_exchange(Direction::Push),
        }
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

    /// One exchange; `what` names the call in errors. `staging` says what goes through the
    /// stages (a copy made here, after every check and just before the launch, so that a refused
    /// call leaves nothing in the stage's window behind).
    #[allow(clippy::too_many_arguments)]
    fn exchange(
        &self,
        what: &str,
        direction: Direction,
        input: Buffer,
        output: Buffer,
        send: &Split,
        recv: &Split,
        stream: Stream,
        blocks: Option<u32>,
        threads: Option<u32>,
        staging: Staging,
    ) -> Result<()> {
        let (rank, n) = (self.comm.rank(), self.comm.size());
        // The geometry is checked with the splits, before anything collective, so that a bad
        // request fails on the rank that made it without leaving the others in a registration.
        let local = check_local(rank, n, send, input.bytes, recv, output.bytes)
            .and_then(|()| exchange_geometry(what, rank, blocks, threads, self.max_blocks));
        if self.host_check {
            // Every rank joins the gather, so one rank's bad arguments fail all of them at once.
            self.check_across_ranks(local.is_ok().then_some((send, recv)))?;
        }
        let cfg = local?;
        let null = |side: &str| {
            Error::InvalidArgument(format!(
                "rank {rank}: {what}: null {side} pointer for a non-empty side"
            ))
        };
        if send.total() > 0 && input.ptr == 0 {
            return Err(null("input"));
        }
        if recv.total() > 0 && output.ptr == 0 {
            return Err(null("output"));
        }
        if staging.copy_input > self.stage.bytes {
            return Err(Error::Internal(format!(
                "rank {rank}: {what}: {staging:?} exceeds the stage's {} bytes",
                self.stage.bytes
            )));
        }
        let (mut local, registered) = match direction {
            Direction::Pull => (output.ptr, input),
            Direction::Push | Direction::Swap => (input.ptr, output),
        };
        if staging.copy_input > 0 && direction == Direction::Push {
            local = self.stage.local;
        }
        let (remote, direction) = if staging.peers_read_stage {
            (self.stage.peers, direction)
        } else {
            let swap = (staging.swap > 0).then_some(Buffer {
                ptr: input.ptr,
                bytes: staging.swap,
            });
            let (remote, every_rank_swaps) = self.registered(what, registered, swap)?;
            (
                remote,
                if every_rank_swaps {
                    Direction::Swap
                } else {
                    direction
                },
            )
        };
        let entry = direction.entry();
        let mut args = AlltoallArgs {
            local,
            remote,
            tables: self.tables,
            sems: self.resources.semaphores_ptr(),
            state: self.resources.alltoall_state_ptr(),
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
        if staging.copy_input > 0 {
            // Stream order puts the copy before the kernel, whose start barrier comes before any
            // peer's store into this rank's output or read of its stage.
            self.comm.gpu().memcpy_async(
                self.stage.local,
                input.ptr,
                staging.copy_input,
                stream,
            )?;
        }
        // SAFETY: `AlltoallArgs` is the kernel's one parameter (layout checked by the NVRTC test's
        // static_asserts); its addresses are the caller's checked buffers, the peers' registered
        // buffers and the collection's live semaphores, tables and state.
        unsafe { self.launch(entry, &mut args, stream, cfg) }
    }

    /// All-to-all-v with the send counts in device memory, as MoE routing produces them (no host
    /// round trip, so it can sit inside a CUDA graph with the routing): `send_counts` holds
    /// `nranks` u64 counts in units of `unit_bytes` (e.g. one token's row), both buffers are
    /// packed in rank order, and the kernel writes what this rank received from each rank (units)
    /// to `recv_counts` (`nranks` u64). Counts that overflow a buffer anywhere are a device error
    /// on every rank (`DEVICE_ERROR_COUNT_MISMATCH`, described by [`Self::check_device_errors`])
    /// and move nothing at all. Collective; every rank passes the same `blocks` (`None`: the fixed
    /// default) and an output buffer (non-null: the outputs are what is registered). Not in place
    /// (refused before anything collective).
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
        let blocks = blocks.or(Some(EXCHANGE_BLOCKS.min(self.max_blocks)));
        let cfg = exchange_geometry(
            "alltoallv with device counts",
            rank,
            blocks,
            None,
            self.max_blocks,
        )?;
        let overlap = input.ptr != 0
            && input.ptr < output.ptr.saturating_add(output.bytes as u64)
            && output.ptr < input.ptr.saturating_add(input.bytes as u64);
        if overlap {
            return Err(Error::Unsupported(format!(
                "rank {rank}: alltoallv with device counts in place (no rank knows on the host \
                 what its peers store where; pass distinct buffers)"
            )));
        }
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
            outputs: self
                .registered("alltoallv with device counts", output, None)?
                .0,
            tables: self.tables,
            send_counts,
            recv_counts,
            unit_bytes: unit_bytes as u64,
            output_bytes: output.bytes as u64,
            sems: self.resources.semaphores_ptr(),
            state: self.resources.alltoall_state_ptr(),
            error_word: self.comm.error_word_device_ptr(),
            max_spin: 0,
            rank: rank as u32,
            nranks: self.comm.size() as u32,
        };
        // SAFETY: `AlltoallDeviceArgs` is the kernel's one parameter (layout checked by the NVRTC test's
        // static_asserts); the count arrays are the caller's device memory of `nranks` u64 each,
        // the kernel never touches more of a buffer than its given size, and the rest are the
        // collection's live resources.
        unsafe { self.launch("alltoallv_device_counts", &mut args, stream, cfg) }
    }

    /// The host work of an exchange in `direction` that must come before any rank of this
    /// process launches (`Algorithm::prepare`): loading the kernel. The buffers are agreed in the
    /// call itself, once per call on every rank.
    /// A push may turn into a swap on every rank (decided in the call), so both are loaded.
    fn prepare_exchange(&self, direction: Direction) -> Result<()> {
        let entries: &[Direction] = match direction {
            Direction::Push | Direction::Swap => &[Direction::Push, Direction::Swap],
            Direction::Pull => &[Direction::Pull],
        };
        for d in entries {
            self.kernels.function(
                self.comm.gpu().as_ref(),
                CollectiveFile::AllToAll,
                None,
                d.entry(),
            )?;
        }
        Ok(())
    }

    /// Collective: every rank's `buffer` (the registered side of this call; see the module docs
    /// for why every rank has one), agreed for this call, and whether every rank swaps in place
    /// (`swap`: this rank's in-place region where it does, [`InPlace::Swap`]). A rank that passed
    /// no buffer fails every rank, naming it, and so does a call where only some ranks swap.
    fn registered(
        &self,
        what: &str,
        buffer: Buffer,
        swap: Option<Buffer>,
    ) -> Result<(PeerPtrs, bool)> {
        let swap = swap.map_or(UserBuffer::new(0, 0), |b| UserBuffer::new(b.ptr, b.bytes));
        let agreed = self.user_buffers.agree(
            &self.comm,
            &[UserBuffer::new(buffer.ptr, buffer.bytes), swap],
        )?;
        if let Some(rank) = (0..agreed.ranks()).find(|&r| agreed.passed(r, 0).ptr == 0) {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: {ALLTOALL_ZERO_COPY}: a null buffer where every rank passes one \
                 (pass a buffer even of 0 bytes)"
            )));
        }
        let every_rank_swaps = every_rank_swaps(what, self.comm.rank(), &agreed)?;
        Ok((agreed.peers(0)?, every_rank_swaps))
    }

    /// Launches `entry` of the all-to-all unit with its one argument struct `args` on the grid
    /// `cfg` ([`exchange_geometry`]).
    ///
    /// # Safety
    /// `A` must be the entry point's parameter type and every address in it valid for the call.
    unsafe fn launch<A>(
        &self,
        entry: &'static str,
        args: &mut A,
        stream: Stream,
        cfg: LaunchConfig,
    ) -> Result<()> {
        let f = self.kernels.function(
            self.comm.gpu().as_ref(),
            CollectiveFile::AllToAll,
            None,
            entry,
        )?;
        let cfg = cfg
            .with_programmatic(self.comm.fast_launches())
            .with_cached_graph(self.comm.fast_launches());
        let mut params = [param_ptr(args)];
        // SAFETY: per this function's contract.
        unsafe { self.comm.gpu().launch(f, cfg, stream, &mut params) }
    }
}

/// Buffers each rank describes in an exchange's agreement: its registered side, and its in-place
/// region where it swaps (else null).
const AGREED_BUFFERS: usize = 2;

/// Whether every rank of `agreed` (an exchange's, [`AGREED_BUFFERS`]) swaps in place: true when
/// all do, false when none does, and the same error on every rank, naming a rank that swaps and
/// one that does not, when only some do (neither kernel could serve them: the swap needs both
/// ranks of a pair, and a push into a swapping rank would overwrite what it has yet to send).
fn every_rank_swaps(what: &str, rank: usize, agreed: &Agreed) -> Result<bool> {
    let swaps = |r: usize| agreed.passed(r, 1).ptr != 0;
    let ranks = 0..agreed.ranks();
    match (
        ranks.clone().find(|&r| swaps(r)),
        ranks.clone().find(|&r| !swaps(r)),
    ) {
        (None, _) => Ok(false),
        (Some(_), None) => Ok(true),
        (Some(s), Some(o)) => Err(Error::Unsupported(format!(
            "rank {rank}: {what}: rank {s} is in place beyond its all-to-all stage ({} bytes \
             sent) and rank {o} is not: in place beyond the stage needs every rank in place",
            agreed.passed(s, 1).bytes
        ))),
    }
}

/// Default blocks of a gather or scatter of `bytes` per rank on `nranks`: by the bytes the root
/// moves in all, the same on every rank.
pub fn gather_blocks(bytes: usize, nranks: usize, max_blocks: u32) -> u32 {
    geometry::bandwidth_blocks(bytes.saturating_mul(nranks), max_blocks)
}

/// The grid of one exchange named `what` on `rank`: the caller's `blocks` and `threads` where given
/// (`blocks` in 1..=`max_blocks`, `threads` a multiple of 32 up to 1024, as every native
/// algorithm), else `DEFAULT_THREADS`; errors name the rank and the call.
fn exchange_geometry(
    what: &str,
    rank: usize,
    blocks: Option<u32>,
    threads: Option<u32>,
    max_blocks: u32,
) -> Result<LaunchConfig> {
    geometry::launch_config(blocks, threads, 1, DEFAULT_THREADS, max_blocks).map_err(|e| match e {
        Error::LaunchShape(m) => Error::LaunchShape(format!("rank {rank}: {what}: {m}")),
        e => e,
    })
}

impl Algorithm for AlltoallZeroCopy {
    fn name(&self) -> &str {
        ALLTOALL_ZERO_COPY
    }

    fn collective(&self) -> Collective {
        Collective::AllToAll
    }

    /// `input_bytes` is this rank's whole send buffer, cut into one equal chunk per rank (in
    /// whole elements); the output receives one chunk from each rank, in rank order. In place
    /// (one buffer) as [`InPlace`] says: copied whole into the stage, swapped beyond it.
    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        let n = self.comm.size();
        let chunk = uniform_chunk(ALLTOALL_ZERO_COPY, args, self.comm.rank(), n)?;
        let split = Split::uniform(n, chunk);
        let (input, output) = uniform_buffers(args);
        self.in_place(ALLTOALL_ZERO_COPY, (input, &split), (output, &split))
            .map(|_| ())
    }

    fn prepare(&self, args: &ExecuteArgs) -> Result<()> {
        let chunk = uniform_chunk(ALLTOALL_ZERO_COPY, args, self.comm.rank(), self.comm.size())?;
        if chunk == 0 {
            return Ok(());
        }
        self.prepare_exchange(Direction::Push)
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
        let (input, output) = uniform_buffers(args);
        self.push(
            ALLTOALL_ZERO_COPY,
            (input, &split),
            (output, &split),
            args.stream,
            blocks,
            args.nthreads,
        )
    }
}

/// The (input, output) buffers of a uniform all-to-all's `args`.
fn uniform_buffers(args: &ExecuteArgs) -> (Buffer, Buffer) {
    (
        Buffer {
            ptr: args.input,
            bytes: args.input_bytes,
        },
        Buffer {
            ptr: args.output,
            bytes: args.output_bytes,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_grid_follows_the_roots_bytes() {
        assert_eq!(gather_blocks(1, 8, 64), 1);
        // 8 ranks x 1 MiB at the root: 128 blocks of 64 KiB, capped at the engine's grid.
        assert_eq!(gather_blocks(1 << 20, 8, 256), 128);
        assert_eq!(gather_blocks(1 << 20, 8, 64), 64);
        assert_eq!(gather_blocks(usize::MAX, 8, 64), 64);
    }

    fn one(bytes: usize) -> Buffer {
        Buffer {
            ptr: 0x10_0000,
            bytes,
        }
    }

    #[test]
    fn in_place_plans_copy_what_fits_the_stage_swap_symmetric_regions_and_refuse_the_rest() {
        let n = 4;
        let stage = 1 << 20;
        let u = |c: usize| Split::uniform(n, c);
        let plan = |input: Buffer, output: Buffer, send: &Split, recv: &Split| {
            in_place_plan("alltoall", 2, (input, send), (output, recv), stage)
        };
        // Apart, adjacent, or with nothing sent or received: as it is.
        let other = Buffer {
            ptr: 0x20_0000,
            bytes: 64,
        };
        assert_eq!(plan(one(64), other, &u(16), &u(16)).unwrap(), InPlace::No);
        let next = Buffer {
            ptr: 0x10_0000 + 64,
            bytes: 64,
        };
        assert_eq!(plan(one(64), next, &u(16), &u(16)).unwrap(), InPlace::No);
        assert_eq!(plan(one(64), one(64), &u(0), &u(0)).unwrap(), InPlace::No);
        // One buffer: copied whole while the send extent fits the stage (any splits)...
        assert_eq!(
            plan(one(64), one(64), &u(16), &u(16)).unwrap(),
            InPlace::Copy { bytes: 64 }
        );
        assert_eq!(
            plan(one(stage), one(stage), &u(stage / n), &u(stage / n)).unwrap(),
            InPlace::Copy { bytes: stage }
        );
        let skewed_recv = Split::packed(vec![8, 24, 16, 16], 2, Side::Recv).unwrap();
        assert_eq!(
            plan(one(64), one(64), &u(16), &skewed_recv).unwrap(),
            InPlace::Copy { bytes: 64 }
        );
        // ... swapped beyond it where the send regions are the receive regions ...
        let big = stage + 16 * n;
        assert_eq!(
            plan(one(big), one(big), &u(big / n), &u(big / n)).unwrap(),
            InPlace::Swap { bytes: big }
        );
        let symmetric =
            Split::packed(vec![big / 2, big / 4, big / 8, big / 8], 2, Side::Send).unwrap();
        assert_eq!(
            plan(one(big), one(big), &symmetric, &symmetric).unwrap(),
            InPlace::Swap { bytes: big }
        );
        // ... and refused by name where they differ.
        let e = plan(
            one(big),
            one(big),
            &Split::packed(vec![big / 2, big / 2, 0, 0], 2, Side::Send).unwrap(),
            &Split::packed(vec![big / 4; 4], 2, Side::Recv).unwrap(),
        )
        .unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
        let m = e.to_string();
        assert!(
            m.contains("rank 2") && m.contains(&format!("{big} bytes")),
            "{m}"
        );
        assert!(m.contains(&format!("({stage} bytes)")), "{m}");
        assert!(
            m.contains("receive regions other than its send regions"),
            "{m}"
        );
        // Overlap other than in place.
        let shifted = Buffer {
            ptr: 0x10_0000 + 16,
            bytes: 64,
        };
        let e = plan(one(64), shifted, &u(16), &u(16)).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e}");
    }

    #[test]
    fn rooted_calls_go_through_the_stage_while_the_roots_side_fits() {
        let stage = 7 << 20;
        // nccl-tests' 128-byte scatter at 2 ranks (64 bytes a rank), up to the stage's size.
        assert!(rooted_via_stage(64, 2, stage));
        assert!(rooted_via_stage(stage / 8, 8, stage));
        assert!(!rooted_via_stage(stage / 8 + 1, 8, stage));
        assert!(!rooted_via_stage(usize::MAX / 2, 4, stage));
        assert!(!rooted_via_stage(1, 2, 0));
    }

    #[test]
    fn requested_geometry_is_taken_or_refused_by_name() {
        let c = exchange_geometry("gather", 1, Some(3), Some(128), 64).expect("request");
        assert_eq!((c.grid.0, c.block.0), (3, 128));
        let c = exchange_geometry("gather", 1, Some(64), None, 64).expect("default threads");
        assert_eq!((c.grid.0, c.block.0), (64, DEFAULT_THREADS));
        for (blocks, threads, bad) in [
            (Some(0), None, "nblocks 0"),
            (Some(65), None, "nblocks 65"),
            (Some(1), Some(100), "nthreads 100"),
            (Some(1), Some(2048), "nthreads 2048"),
        ] {
            let e = exchange_geometry("scatter", 3, blocks, threads, 64).unwrap_err();
            let m = e.to_string();
            assert!(matches!(e, Error::LaunchShape(_)), "{m}");
            assert!(m.contains("rank 3: scatter: ") && m.contains(bad), "{m}");
        }
    }
}
