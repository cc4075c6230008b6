//! `default_allreduce_copy_engine`: an all-reduce for large messages whose data the copy engines
//! move, not the SMs. New in mscclpp-rs (MSCCL++ has no copy-engine all-reduce).
//!
//! Why: on NVLink the copy engines write a peer faster than SM loads from a peer reach in the
//! zero-copy kernel. Reductions stay on the SMs, overlapped with the copies, and only touch local
//! memory. Each copy costs several microseconds beyond its bytes, even back to back on the copy
//! stream, so pieces must be large: where the peers' pieces land decides how large they can be
//! ([`Staging`]). Beyond the copies, a call pays for its first barrier, the hand-off to the
//! all-gather after the last piece's barrier and the join with the end barrier
//! (docs/performance.md has the timings).
//!
//! Every rank owns the share `[rank * per, (rank + 1) * per)` of the message (clamped to it), cut
//! into pieces. One call, on the caller's stream S and this algorithm's copy stream C, every
//! transfer a push (NVLink carries writes faster than reads):
//! 1. Reduce-scatter, pushed: C forks from S. For each piece k, C copies piece k of every peer's
//!    share of our input into that peer's staging place for piece k (in a scratch ring, first
//!    waiting, from piece SLOTS on, until every peer has reduced what that slot held). S waits for
//!    those copies, then a barrier with every peer tells it that every rank's piece k has landed,
//!    then S reduces our input's piece k and the peers' staged pieces, in rank order, into our
//!    output.
//! 2. All-gather, pushed, in two copies per peer: behind the last piece's reduce-scatter copies,
//!    C copies every earlier piece of our reduced share (reduced meanwhile) into every peer's
//!    output, then the last piece once S has reduced it. The copy engines stay busy while the
//!    last piece is reduced, and each extra copy would cost a copy-engine start. Staged in the
//!    output, these copies overwrite the peers' staging places, so they wait first for a barrier
//!    saying every peer has reduced those pieces (the barrier of the last piece, and one more
//!    after the last reduction).
//! 3. S joins C and ends with a barrier: every peer's pushes into our output have landed.
//!
//! Why it is safe without other waits:
//! - Output staging: sender s's piece k of our share lands where s's reduced piece k will be
//!   gathered, `output[share s, piece k]`, which nothing else reads or writes during the call
//!   (input and output are disjoint); the gather into it waits for our reduction (above).
//! - Slot reuse (scratch ring): the barrier of piece m passes only once every peer has sent its
//!   signal of piece m, which its stream issues after reducing piece m - 1; so after barrier
//!   k - SLOTS + 1 nobody reads slot `k % SLOTS` any more. With three slots C waits for a barrier
//!   two pieces back, which has long passed in steady state: the copy engines never wait for the
//!   barrier round trip.
//! - All-gather writes: our share of a peer's output is read by nobody during the call except, in
//!   place, by that peer's own reduce-scatter pushes (it is its input too). Its pushes of piece k
//!   are complete once the barrier of piece k has passed, and we gather piece k only after
//!   reducing it, which follows that barrier.
//! - Across calls: the ring is the collection's staging and LL128 parts of the scratch, shared with
//!   the scratch pipelines and the LL128 packet kinds (`resources::CollectionResources`), so a call
//!   first barriers with every peer (each has finished whatever it ran before on the scratch), and
//!   before its end barrier zeroes what it wrote of our LL128 part (raw data there could pass for
//!   an LL128 flag; 0 never does). The first barrier costs a few microseconds, the zeroing a few
//!   more where a call's pieces reach the LL128 part (large calls), on calls of tens of MiB.
//!
//! Every barrier is a kernel on S (bounded spins that report through the error word), and all
//! signals go out on S in one order, so counting semaphores cannot mix them up. The whole sequence
//! is capturable in a CUDA graph: C joins the capture through the fork event.

use crate::resources::{launch_with_args, CollectionResources};
use mscclpp_core::algorithm_collection;
use mscclpp_core::communicator::Communicator;
use mscclpp_core::device::CopyEngineArgs;
use mscclpp_core::gpu::{DevicePtr, Event, Function, Gpu, LaunchConfig, Stream};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::collectives::PeerPtrs;
use std::sync::{Arc, Mutex};

/// Where the peers' pieces of our share land before we reduce them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Staging {
    /// In our output, at the place of the sender's own share (which it will all-gather there
    /// later): no extra memory, so pieces can be as large as the schedule wants
    /// ([`OUTPUT_PIECES`]).
    /// Needs an out-of-place call with disjoint buffers and equal shares (every share lands in a
    /// place of its own size). A call's fixed cost beyond its bytes loses to the zero-copy kernel
    /// for smaller messages (`copy_engine_threshold` in the selector). Filling that time with the
    /// zero-copy kernel on part of the message beside the copies (its own stream) gained little
    /// where the selector would take this algorithm, still behind the zero-copy kernel alone, and
    /// lost for the largest messages: the copies already keep the links busy.
    Output,
    /// In a ring of [`SLOTS`] slots cut from the collection's scratch, each with room for one piece
    /// from every peer: any call, but pieces of at most a slot (~2.9 MiB at 4 ranks, as the
    /// communicator keeps to 32 MiB), so more copy starts: the zero-copy kernel beats it at the
    /// sizes the selector would give it, where output-sized pieces did not.
    ScratchRing,
}

impl Staging {
    /// Output staging where the call allows it (see [`Staging::Output`]), else the scratch ring.
    pub fn for_call(
        in_place: bool,
        disjoint: bool,
        count: usize,
        elem_bytes: usize,
        nranks: usize,
    ) -> Staging {
        let equal_shares =
            algorithm_collection::copy_engine_equal_shares(count * elem_bytes, nranks);
        if !in_place && disjoint && equal_shares {
            Staging::Output
        } else {
            Staging::ScratchRing
        }
    }
}

/// Pieces a share is cut into when staged in the output. Two suffice: the reduction of a piece
/// (beside the copies) hides behind the next piece's copies, and fewer pieces mean fewer copies
/// and barriers. One piece leaves the last reduction exposed; four add copies and barriers and
/// timed slower than two.
pub const OUTPUT_PIECES: usize = 2;

/// Largest piece from one peer in the scratch ring. Halving the pieces costs less per copy than a
/// copy's whole cost beyond its bytes (module docs): in the ring the copies partly overlap its
/// waits.
const MAX_PIECE_BYTES: usize = 32 << 20;

/// Pieces a share is cut into at least in the scratch ring (while they stay above
/// [`PIECE_ALIGN`]): the first reduction waits for one piece, and with a single piece nothing
/// overlaps.
const MIN_PIECES: usize = 4;

/// Pieces are whole multiples of this (and so of every element size and of 16-byte vectors).
const PIECE_ALIGN: usize = 64 << 10;

/// Slots of the scratch ring. A copy into a slot waits for the barrier two pieces back (see the
/// module docs); two slots would make every piece wait for the previous one's barrier round trip.
pub const SLOTS: usize = 3;

/// `allreduce_ce_sync` mode: signal every peer, then wait for every peer.
const BARRIER: u32 = 3;

/// Bytes of a scratch slot's place for one peer (the largest piece) when the ring is cut from
/// `scratch_bytes` for `nranks` ranks; 0 if the scratch is too small for one aligned piece each.
pub fn slot_bytes(scratch_bytes: usize, nranks: usize) -> usize {
    let per_peer = scratch_bytes / (SLOTS * peer_count(nranks));
    (per_peer / PIECE_ALIGN * PIECE_ALIGN).min(MAX_PIECE_BYTES)
}

/// Bytes of one piece for a share of `share_bytes` with slots of `slot_bytes`: `MIN_PIECES`
/// pieces or more, each as large as the slot allows.
pub fn piece_bytes(share_bytes: usize, slot_bytes: usize) -> usize {
    let want = share_bytes
        .div_ceil(MIN_PIECES)
        .next_multiple_of(PIECE_ALIGN);
    want.clamp(PIECE_ALIGN, slot_bytes.max(PIECE_ALIGN))
}

/// Bytes of one piece for a share of `share_bytes` staged in the output: [`OUTPUT_PIECES`] pieces,
/// whole multiples of `PIECE_ALIGN` (the last one shorter).
pub fn output_piece_bytes(share_bytes: usize) -> usize {
    share_bytes
        .div_ceil(OUTPUT_PIECES)
        .next_multiple_of(PIECE_ALIGN)
        .max(PIECE_ALIGN)
}

fn peer_count(nranks: usize) -> usize {
    nranks.saturating_sub(1).max(1)
}

/// Where `sender`'s piece lands in `receiver`'s scratch slot: the sender's peer index there.
fn sender_index(sender: usize, receiver: usize) -> usize {
    if sender < receiver {
        sender
    } else {
        sender - 1
    }
}

/// Elements of each rank's share: a whole number of 16-byte vectors, as in the zero-copy kernel.
pub fn share_elements(count: usize, elem_bytes: usize, nranks: usize) -> usize {
    let vec = (16 / elem_bytes).max(1);
    count.div_ceil(vec).div_ceil(nranks.max(1)) * vec
}

/// The copy stream and the events that order it against the caller's stream. One copy stream
/// measured best: two streams taking turns were slower, and one stream per peer (the copies to
/// every peer at once) much slower.
struct Pipeline {
    copy_stream: Stream,
    fork: Event,
    /// Recorded on the copy stream after the pushes of a piece; the caller's stream waits for it.
    copied: Event,
    /// Recorded on the caller's stream once every peer has reduced the piece a slot held.
    slot_free: [Event; SLOTS],
    /// Recorded on the caller's stream after the reduction of each piece.
    reduced: Event,
    /// Output staging: recorded on the caller's stream once every peer has reduced the pieces the
    /// next all-gather copies overwrite.
    peers_reduced: Event,
    /// Recorded on the copy stream at the end of a call; the caller's stream waits for it.
    join: Event,
}

impl Pipeline {
    fn new(gpu: &dyn Gpu) -> Result<Pipeline> {
        let copy_stream = gpu.create_stream()?;
        let mut events = Vec::new();
        for _ in 0..5 + SLOTS {
            match gpu.create_event() {
                Ok(e) => events.push(e),
                Err(e) => {
                    // Undo what was made; a failure here is secondary to the one reported.
                    destroy(gpu, "copy-engine all-reduce", copy_stream, &events);
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
            peers_reduced: events[4],
            slot_free: std::array::from_fn(|i| events[5 + i]),
        })
    }

    fn events(&self) -> Vec<Event> {
        let mut all = vec![
            self.fork,
            self.copied,
            self.reduced,
            self.join,
            self.peers_reduced,
        ];
        all.extend_from_slice(&self.slot_free);
        all
    }
}

/// Destroys the stream and events of algorithm `who`, logging (not returning) failures: used on
/// teardown paths (here and by the hierarchical all-reduce's second stream).
pub(crate) fn destroy(gpu: &dyn Gpu, who: &str, stream: Stream, events: &[Event]) {
    for &ev in events {
        if let Err(e) = gpu.destroy_event(ev) {
            tracing::warn!(target: "mscclpp::algo", "{who}: destroying an event: {e}");
        }
    }
    if let Err(e) = gpu.destroy_stream(stream) {
        tracing::warn!(target: "mscclpp::algo", "{who}: destroying a stream: {e}");
    }
}

/// What one call needs besides the communicator.
pub struct CallPlan<'a> {
    pub reduce: Function,
    pub sync: Function,
    /// Device array of D2D semaphores, one per peer index.
    pub semaphores: DevicePtr,
    /// The communicator's error word.
    pub error_word: DevicePtr,
    /// Every rank's input and output (registered), by rank.
    pub inputs: &'a [DevicePtr],
    pub outputs: &'a [DevicePtr],
    pub count: usize,
    pub elem_bytes: usize,
    pub stream: Stream,
    pub reduce_config: LaunchConfig,
    pub staging: Staging,
}

/// The copy-engine resources of one algorithm object. See the module docs.
pub struct CopyEngine {
    gpu: Arc<dyn Gpu>,
    /// Every rank's scratch ring, by rank (ours included).
    scratch_ptrs: Vec<DevicePtr>,
    slot_bytes: usize,
    /// Where in the ring the LL128 packet part begins: what a call wrote beyond it is zeroed.
    packet_offset: usize,
    /// Locked for a whole call: the copy stream and events are shared by every caller.
    pipeline: Mutex<Pipeline>,
    // Last: released after the copy stream is drained (Drop) and after the other fields.
    _scratch: Arc<CollectionResources>,
}

impl CopyEngine {
    /// Its ring is the collection's `scratch` (every rank's, mapped here).
    pub fn new(comm: &Arc<Communicator>, scratch: Arc<CollectionResources>) -> Result<CopyEngine> {
        let gpu = comm.gpu().clone();
        let n = comm.size();
        let (ring, packet_offset) = scratch.copy_engine_ring();
        let slot = slot_bytes(ring.bytes, n);
        if slot == 0 {
            return Err(Error::InvalidArgument(format!(
                "default_allreduce_copy_engine: a ring of {} bytes holds no {PIECE_ALIGN}-byte \
                 piece per peer in each of {SLOTS} slots for {n} ranks",
                ring.bytes
            )));
        }
        let pipeline = Pipeline::new(gpu.as_ref())?;
        Ok(CopyEngine {
            gpu,
            scratch_ptrs: ring.peers.p[..n].to_vec(),
            slot_bytes: slot,
            packet_offset,
            pipeline: Mutex::new(pipeline),
            _scratch: scratch,
        })
    }

    /// Bytes of one peer's place in a slot (the largest piece).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Address of `sender`'s piece in slot `slot` of `receiver`'s scratch ring.
    fn slot_ptr(&self, receiver: usize, slot: usize, sender: usize, nranks: usize) -> DevicePtr {
        let index = slot * peer_count(nranks) + sender_index(sender, receiver);
        self.scratch_ptrs[receiver] + (index * self.slot_bytes) as u64
    }

    /// Bytes of one piece of a share of `share_bytes` staged as `staging`.
    pub fn piece_bytes(&self, share_bytes: usize, staging: Staging) -> usize {
        match staging {
            Staging::Output => output_piece_bytes(share_bytes),
            Staging::ScratchRing => piece_bytes(share_bytes, self.slot_bytes),
        }
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
        let in_output = plan.staging == Staging::Output;
        let piece = self.piece_bytes(per * es, plan.staging) / es;
        // Every rank runs the same number of pieces (and so of barriers): those of a full share.
        let npieces = per.div_ceil(piece);
        // Elements [lo, hi) of pieces [first, last) of `owner`'s share; empty past its end.
        let pieces = |owner: usize, first: usize, last: usize| -> (usize, usize) {
            let end = ((owner + 1) * per).min(plan.count);
            let at = |k: usize| (owner * per + k * piece).min(end);
            (at(first), at(last))
        };
        // Rotated from our rank: at each turn every rank pushes to a different peer, so no GPU's
        // links serve several copies while others idle.
        let peers: Vec<usize> = (1..nranks).map(|i| (rank + i) % nranks).collect();
        let c = p.copy_stream;
        // Where `sender`'s piece k of `receiver`'s share is staged.
        let staged = |receiver: usize, k: usize, sender: usize| -> DevicePtr {
            if in_output {
                plan.outputs[receiver] + ((sender * per + k * piece) * es) as u64
            } else {
                self.slot_ptr(receiver, k % SLOTS, sender, nranks)
            }
        };
        let barrier = || -> Result<()> {
            let args = CopyEngineArgs {
                sems: plan.semaphores,
                error_word: plan.error_word,
                npeers: peers.len() as u32,
                mode: BARRIER,
                ..CopyEngineArgs::default()
            };
            launch_with_args(
                gpu,
                plan.sync,
                LaunchConfig::linear(1, 32),
                plan.stream,
                args,
            )
        };
        // All-gather of pieces [first, last) of our share, after the latest recorded reduction.
        let gather = |first: usize, last: usize| -> Result<()> {
            let (lo, hi) = pieces(rank, first, last);
            if hi <= lo {
                return Ok(());
            }
            gpu.stream_wait_event(c, p.reduced)?;
            let at = (lo * es) as u64;
            for &peer in &peers {
                let to = plan.outputs[peer] + at;
                gpu.memcpy_async(to, plan.outputs[rank] + at, (hi - lo) * es, c)?;
            }
            Ok(())
        };
        // The scratch is shared: every peer must be done with what it ran on it before.
        barrier()?;
        gpu.record_event(p.fork, plan.stream)?;
        gpu.stream_wait_event(c, p.fork)?;
        // C waits until every peer has reduced what the next all-gather copies overwrite (output
        // staging), after the barrier just enqueued on S.
        let peers_reduced = || -> Result<()> {
            gpu.record_event(p.peers_reduced, plan.stream)?;
            gpu.stream_wait_event(c, p.peers_reduced)
        };
        for k in 0..npieces {
            // Reduce-scatter of piece k: our input's piece k of every peer's share into its
            // staging place.
            if !in_output && k >= SLOTS {
                gpu.stream_wait_event(c, p.slot_free[k % SLOTS])?;
            }
            for &peer in &peers {
                let (lo, hi) = pieces(peer, k, k + 1);
                if hi > lo {
                    let to = staged(peer, k, rank);
                    gpu.memcpy_async(to, plan.inputs[rank] + (lo * es) as u64, (hi - lo) * es, c)?;
                }
            }
            gpu.record_event(p.copied, c)?;
            // Behind the last piece's copies, the all-gather of every earlier piece (reduced
            // while those copies ran), so the copy engines do not idle while the last piece is
            // reduced. Earlier gathers would cost a copy-engine start each and gain nothing.
            let gather_earlier = k >= 1 && k + 1 == npieces;
            if gather_earlier && !in_output {
                gather(0, k)?;
            }
            gpu.stream_wait_event(plan.stream, p.copied)?;
            // Every rank's piece k has landed, and every peer has reduced piece k - 1.
            barrier()?;
            if gather_earlier && in_output {
                peers_reduced()?;
                gather(0, k)?;
            }
            if !in_output && k >= 1 {
                gpu.record_event(p.slot_free[(k - 1) % SLOTS], plan.stream)?;
            }
            let (lo, hi) = pieces(rank, k, k + 1);
            if hi > lo {
                let mut srcs = PeerPtrs::default();
                srcs.p[rank] = plan.inputs[rank] + (lo * es) as u64;
                for &peer in &peers {
                    srcs.p[peer] = staged(rank, k, peer);
                }
                // Every source and the output hold `hi - lo` elements (our share of registered
                // buffers, or a slot of our scratch, which holds a whole piece).
                let args = CopyEngineArgs {
                    srcs,
                    output: plan.outputs[rank] + (lo * es) as u64,
                    count: (hi - lo) as u64,
                    error_word: plan.error_word,
                    nsrc: nranks as u32,
                    nranks: nranks as u32,
                    ..CopyEngineArgs::default()
                };
                launch_with_args(gpu, plan.reduce, plan.reduce_config, plan.stream, args)?;
            }
            gpu.record_event(p.reduced, plan.stream)?;
        }
        // The last piece (or, with one piece, the whole share).
        if in_output {
            // Every peer has reduced its last piece.
            barrier()?;
            peers_reduced()?;
        }
        gather(npieces - 1, npieces)?;
        // Every peer's pieces in our ring are reduced: clear what reached the LL128 part.
        let written = npieces.min(SLOTS) * peer_count(nranks) * self.slot_bytes;
        if !in_output && written > self.packet_offset {
            let at = self.scratch_ptrs[rank] + self.packet_offset as u64;
            gpu.memset_async(at, 0, written - self.packet_offset, plan.stream)?;
        }
        // Join; the barrier publishes our pushes (and the zeroing).
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
        // Copies may still use the scratch: let them finish before it is freed.
        if let Err(e) = self.gpu.synchronize_stream(p.copy_stream) {
            tracing::warn!(target: "mscclpp::algo", "copy-engine all-reduce: waiting for the copy stream: {e}");
        }
        destroy(
            self.gpu.as_ref(),
            "copy-engine all-reduce",
            p.copy_stream,
            &p.events(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_fit_the_scratch_and_stay_aligned() {
        // The default collection's shared scratch (4 x 8 MiB).
        let scratch = 32 << 20;
        for n in 1..=8 {
            let slot = slot_bytes(scratch, n);
            assert_eq!(slot % PIECE_ALIGN, 0, "{n} ranks");
            assert!(slot > 0 && slot <= MAX_PIECE_BYTES, "{n} ranks");
            assert!(SLOTS * peer_count(n) * slot <= scratch, "{n} ranks");
            for share in [1usize, 4096, 3 << 20, 64 << 20, 1 << 30] {
                let piece = piece_bytes(share, slot);
                assert_eq!(piece % PIECE_ALIGN, 0, "{n} ranks, share {share}");
                assert!(piece <= slot, "{n} ranks, share {share}");
            }
        }
        // 2 ranks: three slots of 10.625 MiB (pieces were 32 MiB with the former own 96 MiB ring).
        assert_eq!(slot_bytes(scratch, 2), 170 * PIECE_ALIGN);
        // The default collection's ring, staging + LL128 (25.875 MiB): 8.625 MiB pieces at 2 ranks.
        assert_eq!(slot_bytes((26 << 20) - (128 << 10), 2), 138 * PIECE_ALIGN);
        assert_eq!(slot_bytes(96 << 20, 2), 32 << 20);
        assert_eq!(slot_bytes(PIECE_ALIGN, 2), 0);
        // Small shares: at least MIN_PIECES pieces; large ones: pieces as large as a slot.
        let slot2 = slot_bytes(scratch, 2);
        assert_eq!(piece_bytes(32 << 20, slot2), 8 << 20);
        assert_eq!(piece_bytes(512 << 20, slot2), slot2);
    }

    #[test]
    fn output_staging_only_where_every_share_has_a_place_of_its_own_size() {
        let out = Staging::for_call;
        // 4 ranks of bf16: shares of whole 16-byte vectors, equal when count is a multiple of 32.
        assert_eq!(out(false, true, 1 << 20, 2, 4), Staging::Output);
        assert_eq!(out(false, true, (1 << 20) + 8, 2, 4), Staging::ScratchRing);
        assert_eq!(out(true, false, 1 << 20, 2, 4), Staging::ScratchRing);
        assert_eq!(out(false, false, 1 << 20, 2, 4), Staging::ScratchRing);
        assert_eq!(out(false, true, 3 << 20, 4, 3), Staging::Output);
        // OUTPUT_PIECES aligned pieces covering the share; tiny shares take one piece.
        for share in [16usize, 4096, 3 << 20, 64 << 20, 256 << 20] {
            let piece = output_piece_bytes(share);
            assert_eq!(piece % PIECE_ALIGN, 0);
            assert!(piece * OUTPUT_PIECES >= share && share.div_ceil(piece) <= OUTPUT_PIECES);
        }
        assert_eq!(output_piece_bytes(256 << 20), (256 << 20) / OUTPUT_PIECES);
    }

    #[test]
    fn every_sender_has_its_own_place_in_each_receiver() {
        for n in 2..=8 {
            for receiver in 0..n {
                let mut seen: Vec<usize> = (0..n)
                    .filter(|&s| s != receiver)
                    .map(|s| sender_index(s, receiver))
                    .collect();
                seen.sort_unstable();
                assert_eq!(
                    seen,
                    (0..n - 1).collect::<Vec<_>>(),
                    "{n} ranks, receiver {receiver}"
                );
            }
        }
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
