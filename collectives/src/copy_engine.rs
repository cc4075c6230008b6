//! `default_allreduce_copy_engine`: an all-reduce for large messages whose data the copy engines
//! move, not the SMs. New in mscclpp-rs (MSCCL++ has no copy-engine all-reduce).
//!
//! Why: on NVLink the copy engines write a peer at about 396 GB/s one way (391 GB/s each way when
//! both directions run at once), where SM loads from a peer top out near 342 GB/s in the zero-copy
//! kernel. Reductions stay on the SMs, overlapped with the copies, and only touch local HBM.
//!
//! Every rank owns the share `[rank * per, (rank + 1) * per)` of the message (clamped to it).
//! One call, on the caller's stream S and this algorithm's copy stream C:
//! 1. S: barrier with every peer (their inputs are ready).
//! 2. Reduce-scatter, pulled: C forks from S. For each piece k of our share (pieces of
//!    [`piece_bytes`]), C copies every peer's piece k of its input into scratch slot `k % 2`
//!    (waiting first until the reduction that last read that slot has run); S then reduces our
//!    input's piece k and the staged copies, in rank order, into our output.
//! 3. All-gather, pushed: once S has reduced every piece, C copies our share of our output into
//!    every peer's output (writes, which NVLink carries faster than reads).
//! 4. S joins C and ends with a barrier: every peer's pushes into our output have landed, and no
//!    peer still reads our input when the call returns.
//!
//! No scratch of a peer is written, so no flow control between ranks is needed. In place is safe:
//! a peer's share of its input is read only by us (step 2), and written only by us (step 3), after
//! our last read of it; our own reduction reads only our share.
//!
//! Barriers are kernels on the semaphores (bounded spins that report through the error word), so
//! the whole sequence is capturable in a CUDA graph: C joins the capture through the fork event.

use crate::resources::{param_ptr, DeviceBuffer};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::{DevicePtr, Event, Function, Gpu, LaunchConfig, Stream};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::collectives::PeerPtrs;
use std::sync::{Arc, Mutex};

/// Scratch of the staged copies: two slots of one piece from every peer.
pub const COPY_ENGINE_SCRATCH_BYTES: usize = 32 << 20;

/// Pieces are whole multiples of this (and so of every element size and of 16-byte vectors).
const PIECE_ALIGN: usize = 64 << 10;

/// Slots of the scratch ring (a copy into a slot waits for the reduction two pieces earlier).
const SLOTS: usize = 2;

/// `allreduce_ce_sync` mode: signal every peer, then wait for every peer.
const BARRIER: u32 = 3;

/// Bytes of one piece from one peer, for `nranks` ranks.
pub fn piece_bytes(nranks: usize) -> usize {
    let per_peer = COPY_ENGINE_SCRATCH_BYTES / (SLOTS * nranks.saturating_sub(1).max(1));
    (per_peer / PIECE_ALIGN).max(1) * PIECE_ALIGN
}

/// Elements of each rank's share: a whole number of 16-byte vectors, as in the zero-copy kernel.
pub fn share_elements(count: usize, elem_bytes: usize, nranks: usize) -> usize {
    let vec = (16 / elem_bytes).max(1);
    count.div_ceil(vec).div_ceil(nranks.max(1)) * vec
}

/// The copy stream and the events that order it against the caller's stream. One copy stream
/// measured best on 2xH200: spreading the pieces over two streams (two copies in flight) was about
/// 1% slower at 1 GiB.
struct Pipeline {
    copy_stream: Stream,
    fork: Event,
    /// Recorded on the copy stream after the copies of a piece; the reduction waits for it.
    copied: Event,
    /// Recorded on the caller's stream after the reduction of the last piece staged in each slot.
    slot_free: [Event; SLOTS],
    reduced: Event,
    /// Recorded on the copy stream at the end of a call; the caller's stream waits for it.
    join: Event,
}

impl Pipeline {
    fn new(gpu: &dyn Gpu) -> Result<Pipeline> {
        let copy_stream = gpu.create_stream()?;
        let mut events = Vec::new();
        for _ in 0..4 + SLOTS {
            match gpu.create_event() {
                Ok(e) => events.push(e),
                Err(e) => {
                    // Undo what was made; a failure here is secondary to the one reported.
                    destroy(gpu, copy_stream, &events);
                    return Err(e);
                }
            }
        }
        Ok(Pipeline {
            copy_stream,
            fork: events[0],
            copied: events[1],
            reduced: events[2],
            join: events[3],
            slot_free: [events[4], events[5]],
        })
    }
}

/// Destroys the stream and events, logging (not returning) failures: used on teardown paths.
fn destroy(gpu: &dyn Gpu, stream: Stream, events: &[Event]) {
    for &ev in events {
        if let Err(e) = gpu.destroy_event(ev) {
            tracing::warn!(target: "mscclpp::algo", "copy-engine all-reduce: destroying an event: {e}");
        }
    }
    if let Err(e) = gpu.destroy_stream(stream) {
        tracing::warn!(target: "mscclpp::algo", "copy-engine all-reduce: destroying a stream: {e}");
    }
}

/// What one call needs besides the communicator.
pub struct CallPlan<'a> {
    pub reduce: Function,
    pub sync: Function,
    /// Device array of D2D semaphores, one per peer index.
    pub semaphores: DevicePtr,
    /// Every rank's input and output (registered), by rank.
    pub inputs: &'a [DevicePtr],
    pub outputs: &'a [DevicePtr],
    pub count: usize,
    pub elem_bytes: usize,
    pub stream: Stream,
    pub reduce_config: LaunchConfig,
}

/// The copy-engine resources of one algorithm object. See the module docs.
pub struct CopyEngine {
    gpu: Arc<dyn Gpu>,
    scratch: DeviceBuffer,
    piece_bytes: usize,
    /// Locked for a whole call: the copy stream and events are shared by every caller.
    pipeline: Mutex<Pipeline>,
}

impl CopyEngine {
    pub fn new(comm: &Communicator) -> Result<CopyEngine> {
        let gpu = comm.gpu().clone();
        let n = comm.size();
        let piece = piece_bytes(n);
        let scratch = DeviceBuffer::zeroed(&gpu, SLOTS * n.saturating_sub(1).max(1) * piece)?;
        let pipeline = Pipeline::new(gpu.as_ref())?;
        Ok(CopyEngine {
            gpu,
            scratch,
            piece_bytes: piece,
            pipeline: Mutex::new(pipeline),
        })
    }

    /// Enqueues one all-reduce (see the module docs); `rank` of `nranks`.
    pub fn enqueue(&self, plan: &CallPlan, rank: usize, nranks: usize) -> Result<()> {
        let gpu = self.gpu.as_ref();
        let p = self
            .pipeline
            .lock()
            .map_err(|_| Error::Internal("copy-engine pipeline poisoned by a panic".into()))?;
        let es = plan.elem_bytes;
        let per = share_elements(plan.count, es, nranks);
        let begin = (rank * per).min(plan.count);
        let end = (begin + per).min(plan.count);
        // Rotated from our rank: at each turn every rank copies from (and, in the all-gather, to)
        // a different peer, so no GPU's links serve several copies while others idle.
        let peers: Vec<usize> = (1..nranks).map(|i| (rank + i) % nranks).collect();
        let barrier = || -> Result<()> {
            let mut sems = plan.semaphores;
            let mut npeers = peers.len() as u32;
            let mut mode = BARRIER;
            let mut params = [
                param_ptr(&mut sems),
                param_ptr(&mut npeers),
                param_ptr(&mut mode),
            ];
            // SAFETY: allreduce_ce_sync(const D2DSemaphoreHandle*, u32, u32); the semaphores
            // live as long as the algorithm.
            unsafe {
                gpu.launch(
                    plan.sync,
                    LaunchConfig::linear(1, 32),
                    plan.stream,
                    &mut params,
                )
            }
        };
        // 1. Every peer's input is ready.
        barrier()?;
        // 2. Reduce-scatter, piece by piece.
        let c = p.copy_stream;
        gpu.record_event(p.fork, plan.stream)?;
        gpu.stream_wait_event(c, p.fork)?;
        let piece_elems = self.piece_bytes / es;
        let mut off = begin;
        let mut k = 0usize;
        while off < end {
            let len = piece_elems.min(end - off);
            let slot = k % SLOTS;
            if k >= SLOTS {
                gpu.stream_wait_event(c, p.slot_free[slot])?;
            }
            let mut srcs = PeerPtrs::default();
            srcs.p[rank] = plan.inputs[rank] + (off * es) as u64;
            for (i, &peer) in peers.iter().enumerate() {
                let staged =
                    self.scratch.ptr() + ((slot * peers.len() + i) * self.piece_bytes) as u64;
                let from = plan.inputs[peer] + (off * es) as u64;
                gpu.memcpy_async(staged, from, len * es, c)?;
                srcs.p[peer] = staged;
            }
            gpu.record_event(p.copied, c)?;
            gpu.stream_wait_event(plan.stream, p.copied)?;
            let mut nsrc = nranks as u32;
            let mut out = plan.outputs[rank] + (off * es) as u64;
            let mut elems = len as u64;
            let mut nr = nranks as u32;
            let mut params = [
                param_ptr(&mut srcs),
                param_ptr(&mut nsrc),
                param_ptr(&mut out),
                param_ptr(&mut elems),
                param_ptr(&mut nr),
            ];
            // SAFETY: allreduce_ce_reduce(PeerPtrs, u32, void*, u64, u32); every source and the
            // output hold `len` elements (our share of registered buffers, or a scratch slot).
            unsafe { gpu.launch(plan.reduce, plan.reduce_config, plan.stream, &mut params) }?;
            gpu.record_event(p.slot_free[slot], plan.stream)?;
            off += len;
            k += 1;
        }
        // 3. All-gather: our reduced share into every peer's output.
        gpu.record_event(p.reduced, plan.stream)?;
        gpu.stream_wait_event(c, p.reduced)?;
        if end > begin {
            let at = (begin * es) as u64;
            for &peer in &peers {
                let to = plan.outputs[peer] + at;
                gpu.memcpy_async(to, plan.outputs[rank] + at, (end - begin) * es, c)?;
            }
        }
        // 4. Join; the barrier publishes our pushes and ends every peer's reads of our input.
        gpu.record_event(p.join, c)?;
        gpu.stream_wait_event(plan.stream, p.join)?;
        barrier()
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        let p = match self.pipeline.get_mut() {
            Ok(p) => p,
            Err(poisoned) => poisoned.into_inner(),
        };
        // Copies may still read the scratch: let them finish before it is freed.
        if let Err(e) = self.gpu.synchronize_stream(p.copy_stream) {
            tracing::warn!(target: "mscclpp::algo", "copy-engine all-reduce: waiting for the copy stream: {e}");
        }
        let events = [
            p.fork,
            p.copied,
            p.reduced,
            p.join,
            p.slot_free[0],
            p.slot_free[1],
        ];
        destroy(self.gpu.as_ref(), p.copy_stream, &events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_fit_the_scratch_and_stay_aligned() {
        for n in 1..=8 {
            let piece = piece_bytes(n);
            assert_eq!(piece % PIECE_ALIGN, 0, "{n} ranks");
            assert!(
                SLOTS * (n - 1).max(1) * piece <= COPY_ENGINE_SCRATCH_BYTES,
                "{n} ranks"
            );
        }
        assert_eq!(piece_bytes(2), 16 << 20);
    }

    #[test]
    fn shares_cover_the_message_in_whole_vectors() {
        for (count, es, n) in [
            (1usize, 2usize, 2usize),
            (3, 4, 2),
            (1023, 2, 8),
            (1 << 29, 2, 2),
        ] {
            let per = share_elements(count, es, n);
            assert_eq!((per * es) % 16, 0);
            assert!(per * n >= count, "{count} {es} {n}");
        }
    }
}
