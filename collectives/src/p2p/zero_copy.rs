//! The host half of the engine's zero-copy path for large messages (kernels/p2p.cu, "Zero copy").
//!
//! A receiver registers the allocation behind a large receive and offers it to the sender; the
//! sender maps it, writes its address into its pinned host table (the first kernel that needs the
//! entry copies it into the device table, `P2pState::zc_table`) and answers; receives into an
//! allocation the sender mapped then carry its zero-copy word, and the sender's kernel writes them
//! straight into the buffer. Offers and answers travel on the bootstrap and are polled
//! (`try_recv`) when a group has a large op towards that peer. Eager groups never wait: a buffer's
//! first messages go through the slots and later ones straight into it. A group being captured
//! (a graph keeps what its capture saw) sends its offers, then to each peer it receives from a
//! numbered note saying that this capture's offers to it are all sent, before it answers
//! anything; it then waits, up to [`CAPTURE_HANDSHAKE`], for its offers' answers and for the note
//! of the same number from each peer it sends to, answering its peers' offers meanwhile and once
//! more at its end. So ranks that capture exchanges on new buffers (as a framework's graph pool
//! gives them) in pairs, all-pairs, rings or chains all leave with their buffers mapped, however
//! far apart they arrive within the bound: a rank leaves only once it has heard every peer it
//! waits for, and hearing a note is having answered the offers before it. The numbers keep a
//! rank that runs ahead of a sender (a chain or a ring waits in one direction only) from ending
//! the sender's wait for a later group with a note that belongs to an earlier one.
//!
//! Keys and entries. An engine offers at most [`ZC_ENTRIES`] allocations in use at once: key `k`
//! takes table entry `k % ZC_ENTRIES`, and once the receiver finds an offered allocation freed
//! (its buffer id gone, as a framework's allocator frees and allocates again) a new allocation
//! takes that entry with the next key of it (`k + ZC_ENTRIES`). The sender then maps the new one
//! in the entry and unmaps the old: every receive into the old one completed before it was freed
//! (freeing memory a kernel still uses is the program's error, as for any buffer; cudaFree waits
//! for the device), and so did the sender's writes into it, since a receive ends only once they
//! all landed. A graph captured with the old key still posts it; its sends find
//! the entry tagged with the new key and take the slots. Receives into allocations beyond the
//! entries in use keep to the slots.
//!
//! An entry is one word, tag and address, so a send in flight reads the old one or the new one,
//! and a receive carries a key only once its sender mapped it: answers name the offering engine's
//! random id, so an engine built later on the same communicator never takes an earlier one's for
//! its own, and an offer for an entry an earlier engine's offer holds is refused (its messages keep
//! to the slots).

use mscclpp_core::communicator::{Communicator, RegisteredMemory};
use mscclpp_core::gpu::{DevicePtr, Gpu, HostMapped, Stream};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::collectives::MAX_RANKS;
use mscclpp_kernels_cu::p2p::{
    zc_entry, zc_word, P2pOpArgs, KIND_COPY, KIND_RECV, KIND_SEND, ZC_ENTRIES, ZC_KEYS,
};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Messages from this size on may go zero copy: above every layout's slots per peer (896 KiB at
/// 2 ranks), where the slots' round trips bound a message, and where the send's wait for the
/// receiver's post costs little against the bytes.
pub const ZERO_COPY_MIN_BYTES: usize = 1 << 20;

/// How long the host of a group being captured waits for the answers to its new buffers' offers:
/// a peer answers as soon as its host is in its own group, after mapping the buffer (~100 ms each
/// for four ranks under MPS on one H200, a few ms without); past this a captured receive keeps to
/// the slots.
pub const CAPTURE_HANDSHAKE: Duration = Duration::from_secs(1);

/// Bootstrap tags: a receiver's offer (engine id, key, memory), a sender's answer (the offering
/// engine's id, key, [`MAPPED`] or [`REFUSED`]).
const TAG_OFFER: u64 = 0x7032_7a00;
const TAG_MAPPED: u64 = 0x7032_7a01;
const MAPPED: u8 = 1;
const REFUSED: u8 = 0;
/// The key of a note on the offer tag (followed by its number): a capture's offers to the peer
/// are all sent.
const NOTE: usize = usize::MAX;

/// How often at most a receive into a new allocation looks for a freed one's entry while every
/// entry is in use (a search asks the driver about each).
const REUSE_SEARCH: Duration = Duration::from_millis(10);

/// One allocation this engine offered (in entry `key % ZC_ENTRIES`).
struct Export {
    key: usize,
    base: DevicePtr,
    size: usize,
    /// The allocation's buffer id: a new allocation at the same address is another export.
    id: u64,
    /// The registration (its exported handle lives as long as it does).
    mem: RegisteredMemory,
    /// Ranks it was offered to, ranks that mapped it, and ranks that answered they will not.
    offered: u64,
    mapped: u64,
    refused: u64,
}

/// A peer's allocation mapped here for zero-copy sends, in one entry of its row of the table.
struct Import {
    /// The offering engine's id and its key.
    engine: u64,
    key: usize,
    /// The mapping, kept until a later key of the same engine's takes the entry.
    _mem: RegisteredMemory,
}

#[derive(Default)]
struct State {
    /// This engine's offers, at most one per entry.
    exports: Vec<Export>,
    /// Allocations that could not be registered (allocation base, buffer id): not tried again.
    unregistrable: HashSet<(DevicePtr, u64)>,
    /// The table's entries in use, by (peer, entry).
    imports: HashMap<(usize, usize), Import>,
    /// When a search for a freed allocation's entry last found none.
    entries_full_since: Option<Instant>,
    /// Whether every entry being in use was logged.
    full_logged: bool,
    /// Receives marked with a zero-copy word so far.
    receives: u64,
    /// Per peer: the number of the last note it sent us, of the last note we sent it (captures
    /// with large receives from it), and captures with large sends to it (the note each waits
    /// for has that number).
    notes_heard: [u64; MAX_RANKS],
    notes_sent: [u64; MAX_RANKS],
    captured_sends: [u64; MAX_RANKS],
}

/// One engine's zero-copy state: its table, its offers and the peers' memory it mapped.
pub(crate) struct ZeroCopy {
    /// The host table (`P2pArgs::zc_staging`): `[rank][entry]` of `zc_entry` (the key's tag and
    /// the address of the peer's offered allocation as mapped here; 0: none), pinned and mapped
    /// for kernels.
    staging: HostMapped,
    id: u64,
    state: Mutex<State>,
    gpu: Arc<dyn Gpu>,
}

// SAFETY: `staging` is pinned host memory owned until drop; the host writes its entries with
// atomics under the state's lock, kernels only read them.
unsafe impl Send for ZeroCopy {}
unsafe impl Sync for ZeroCopy {}

impl ZeroCopy {
    /// `table`: the device address of the engine's `P2pState::zc_table`, emptied here: an
    /// engine built on a collection's region finds its predecessor's entries there, addresses it
    /// unmapped.
    pub fn new(gpu: Arc<dyn Gpu>, table: DevicePtr) -> Result<Self> {
        let bytes = MAX_RANKS * ZC_ENTRIES * 8;
        gpu.copy_to_device(table, &vec![0; bytes])?;
        let staging = gpu.alloc_host_mapped(bytes)?;
        // SAFETY: `bytes` of pinned memory just allocated, read by nothing yet.
        unsafe { std::ptr::write_bytes(staging.host_ptr, 0, bytes) };
        Ok(ZeroCopy {
            staging,
            id: rand::random(),
            state: Mutex::new(State::default()),
            gpu,
        })
    }

    /// Receives launched with a zero-copy word so far (the sender writes each straight into its
    /// buffer unless it was launched before its table entry was copied, or its size differs).
    pub fn receives(&self) -> u64 {
        self.state.lock().map(|s| s.receives).unwrap_or(0)
    }

    /// The host table's device address (`P2pArgs::zc_staging`).
    pub fn staging(&self) -> DevicePtr {
        self.staging.device_ptr
    }

    /// Marks the planned ops of one group: sends of [`ZERO_COPY_MIN_BYTES`] or more to a peer of
    /// which a buffer is mapped may go zero copy; receives that large, each the only op of its
    /// channel in the group, into an allocation their sender has mapped get its word. Polls the
    /// offers and answers of those ops' peers and offers new allocations; waits only while
    /// `stream` is being captured (see the module docs).
    pub fn mark(&self, comm: &Communicator, ops: &mut [P2pOpArgs], stream: Stream) -> Result<()> {
        if !ops.iter().any(|op| large(op) && op.kind != KIND_COPY) {
            return Ok(());
        }
        let mut state = self.state.lock().map_err(|_| {
            Error::Internal("the p2p zero-copy state was poisoned by a panic".into())
        })?;
        let send_peers = large_peers(ops, KIND_SEND);
        let take_offers = |state: &mut State| {
            ranks_in(send_peers).try_for_each(|p| self.take_offers(comm, state, p))
        };
        let capturing = self.gpu.is_capturing(stream)?;
        let receives: Vec<usize> = (0..ops.len())
            .filter(|&i| {
                let op = &ops[i];
                large(op) && op.kind == KIND_RECV && op.msg_offset == 0 && op.last == 1
            })
            .collect();
        // Every offer goes out before any answer of ours: a peer that sees our answer then finds
        // our offer too (one link, in order), however soon its own wait ends.
        let mut words = Vec::with_capacity(receives.len());
        let poll = |state: &mut State, words: &mut Vec<Option<u64>>| -> Result<()> {
            let mut polled = 0u64;
            words.clear();
            for &i in &receives {
                let (peer, ptr, bytes) = (ops[i].peer as usize, ops[i].ptr, ops[i].bytes as usize);
                if polled & (1 << peer) == 0 {
                    polled |= 1 << peer;
                    self.take_answers(comm, state, peer)?;
                }
                words.push(self.word(comm, state, peer, ptr, bytes)?);
            }
            Ok(())
        };
        poll(&mut state, &mut words)?;
        if capturing {
            self.send_notes(comm, &mut state, ops)?;
            for p in ranks_in(send_peers) {
                state.captured_sends[p] += 1;
            }
        }
        take_offers(&mut state)?;
        // Every send peer's note is on the way, and in a chain or a ring it is the only thing of
        // that peer's we would wait for.
        let unheard = |state: &State| {
            ranks_in(send_peers).any(|p| state.notes_heard[p] < state.captured_sends[p])
        };
        // One bound for the whole group: its receives' answers come in any order.
        let started = Instant::now();
        let deadline = started + CAPTURE_HANDSHAKE;
        while capturing
            && (words.contains(&Some(0)) || unheard(&state))
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_micros(50));
            take_offers(&mut state)?;
            poll(&mut state, &mut words)?;
        }
        if capturing {
            tracing::debug!(target: "mscclpp::coll",
                "rank {}: captured p2p group's handshake took {:?} ({} of {} large receives \
                 unanswered, send peers' notes {})", comm.rank(), started.elapsed(),
                words.iter().filter(|w| **w == Some(0)).count(), words.len(),
                if unheard(&state) { "missing" } else { "all heard" });
        }
        for (&i, word) in receives.iter().zip(&words) {
            ops[i].aux = word.unwrap_or(0);
            state.receives += u64::from(ops[i].aux != 0);
        }
        if capturing {
            // A peer sends its offer before its answer to ours, on the same link: whatever it
            // offered before the answer that ended our wait is served here, not left to a later
            // group that a graph-only run never makes.
            take_offers(&mut state)?;
        }
        for op in ops
            .iter_mut()
            .filter(|op| large(op) && op.kind == KIND_SEND)
        {
            // Without a mapped buffer of the peer's no receive can carry a word for us (only
            // mapped ones are answered so): the send keeps to the slots without waiting for the
            // receiver's post.
            let peer = op.peer as usize;
            op.aux = u64::from(state.imports.keys().any(|&(p, _)| p == peer));
        }
        Ok(())
    }

    /// While a group is captured, after its offers: tells every peer it has large receives from
    /// that this capture's offers to it are all sent (its sender waits for this note).
    fn send_notes(&self, comm: &Communicator, state: &mut State, ops: &[P2pOpArgs]) -> Result<()> {
        ranks_in(large_peers(ops, KIND_RECV)).try_for_each(|p| {
            state.notes_sent[p] += 1;
            let mut note = message_header(self.id, NOTE);
            note.extend(state.notes_sent[p].to_le_bytes());
            comm.bootstrap().send(p, TAG_OFFER, &note)
        })
    }

    /// Maps every offer `peer` sent so far, writes it into the host table and answers it.
    fn take_offers(&self, comm: &Communicator, state: &mut State, peer: usize) -> Result<()> {
        while let Some(msg) = comm.bootstrap().try_recv(peer, TAG_OFFER)? {
            let malformed = || Error::Peer {
                rank: peer,
                message: format!("sent a malformed zero-copy offer ({} bytes)", msg.len()),
            };
            let (engine, key) = header(&msg).ok_or_else(malformed)?;
            if key == NOTE {
                let number = msg.get(16..24).ok_or_else(malformed)?;
                let number = u64::from_le_bytes(number.try_into().map_err(|_| malformed())?);
                state.notes_heard[peer] = state.notes_heard[peer].max(number);
                continue;
            }
            if key >= ZC_KEYS {
                return Err(malformed());
            }
            let entry = key % ZC_ENTRIES;
            // Refused, the peer keeps this allocation's messages in the slots (and a capture stops
            // waiting for the answer).
            let mut answer = message_header(engine, key);
            let held = state.imports.get(&(peer, entry));
            if held.is_some_and(|i| i.engine != engine || i.key >= key) {
                // Another engine of the peer's holds this entry (or, never on one link, a later
                // key of this one).
                answer.push(REFUSED);
            } else {
                let started = Instant::now();
                let mapped = comm.import_message(peer, &msg[16..]).and_then(|mem| {
                    let word = zc_entry(key, mem.ptr()).ok_or_else(|| {
                        Error::Unsupported(format!(
                            "its mapping at {:#x} is beyond the table's 48-bit addresses",
                            mem.ptr()
                        ))
                    })?;
                    Ok((mem, word))
                });
                match mapped {
                    Ok((mem, word)) => {
                        tracing::debug!(target: "mscclpp::coll",
                            "rank {}: mapped rank {peer}'s receive allocation {key} for zero-copy \
                             sends in {:?}", comm.rank(), started.elapsed());
                        self.staged(peer * ZC_ENTRIES + entry)
                            .store(word, Ordering::Release);
                        // The key this one follows, if any, is unmapped here (see the module docs).
                        state.imports.insert(
                            (peer, entry),
                            Import {
                                engine,
                                key,
                                _mem: mem,
                            },
                        );
                        answer.push(MAPPED);
                    }
                    Err(e) => {
                        tracing::warn!(target: "mscclpp::coll",
                            "rank {}: mapping rank {peer}'s receive buffer for zero-copy sends \
                             failed (its messages keep to the slots): {e}", comm.rank());
                        answer.push(REFUSED);
                    }
                }
            }
            comm.bootstrap().send(peer, TAG_MAPPED, &answer)?;
        }
        Ok(())
    }

    /// Records every answer `peer` sent so far to this engine's offers.
    fn take_answers(&self, comm: &Communicator, state: &mut State, peer: usize) -> Result<()> {
        while let Some(msg) = comm.bootstrap().try_recv(peer, TAG_MAPPED)? {
            let (engine, key) = header(&msg).ok_or_else(|| Error::Peer {
                rank: peer,
                message: format!("sent a malformed zero-copy answer ({} bytes)", msg.len()),
            })?;
            if engine != self.id {
                continue;
            }
            if let Some(export) = state.exports.iter_mut().find(|e| e.key == key) {
                match msg.get(16) {
                    Some(&MAPPED) => export.mapped |= 1 << peer,
                    _ => export.refused |= 1 << peer,
                }
            }
        }
        Ok(())
    }

    /// The zero-copy word of a receive of `bytes` at `ptr` from `peer` once `peer` mapped its
    /// allocation; `Some(0)` while it was offered (now, where it was not yet) but not answered;
    /// `None` where it cannot be offered.
    fn word(
        &self,
        comm: &Communicator,
        state: &mut State,
        peer: usize,
        ptr: DevicePtr,
        bytes: usize,
    ) -> Result<Option<u64>> {
        let Some(index) = self.export_of(comm, state, ptr, bytes) else {
            return Ok(None);
        };
        let export = &mut state.exports[index];
        let key = export.key;
        if export.mapped & (1 << peer) != 0 {
            return Ok(zc_word(key, ptr - export.base));
        }
        if export.refused & (1 << peer) != 0 {
            return Ok(None);
        }
        if export.offered & (1 << peer) == 0 {
            let mut msg = message_header(self.id, key);
            msg.extend(Communicator::memory_message(&export.mem)?);
            comm.bootstrap().send(peer, TAG_OFFER, &msg)?;
            tracing::debug!(target: "mscclpp::coll",
                "rank {}: offered receive allocation {key} ({} bytes) to rank {peer}",
                comm.rank(), export.size);
            export.offered |= 1 << peer;
        }
        Ok(Some(0))
    }

    /// The index of the export holding `[ptr, ptr + bytes)`, registering its allocation if it is
    /// new (in a new entry, or in a freed allocation's); `None` where it cannot be registered or
    /// every entry is in use.
    fn export_of(
        &self,
        comm: &Communicator,
        state: &mut State,
        ptr: DevicePtr,
        bytes: usize,
    ) -> Option<usize> {
        let id = self.gpu.buffer_id(ptr).ok()?;
        let holds =
            |base: DevicePtr, size: usize| ptr >= base && ptr - base + bytes as u64 <= size as u64;
        if let Some(index) = state
            .exports
            .iter()
            .position(|e| e.id == id && holds(e.base, e.size))
        {
            return Some(index);
        }
        let alloc = self.gpu.allocation_of(ptr).ok()?;
        if state.unregistrable.contains(&(alloc.ptr, id)) || !holds(alloc.ptr, alloc.size) {
            return None;
        }
        let (index, key) = if state.exports.len() < ZC_ENTRIES {
            (state.exports.len(), state.exports.len())
        } else {
            let index = self.freed_entry(comm, state)?;
            (index, state.exports[index].key + ZC_ENTRIES)
        };
        match comm.register(&alloc, alloc.ptr, alloc.size) {
            Ok(mem) => {
                let export = Export {
                    key,
                    base: alloc.ptr,
                    size: alloc.size,
                    id,
                    mem,
                    offered: 0,
                    mapped: 0,
                    refused: 0,
                };
                // A freed allocation's registration goes with its entry.
                match state.exports.get_mut(index) {
                    Some(freed) => *freed = export,
                    None => state.exports.push(export),
                }
                Some(index)
            }
            Err(e) => {
                tracing::debug!(target: "mscclpp::coll",
                    "rank {}: receive buffer {ptr:#x} cannot be offered for zero copy (its \
                     messages keep to the slots): {e}", comm.rank());
                state.unregistrable.insert((alloc.ptr, id));
                None
            }
        }
    }

    /// With every entry in use: the index of an export whose allocation was freed (its address no
    /// longer has its buffer id) and whose entry has keys left, searched at most once every
    /// [`REUSE_SEARCH`] while none is found.
    fn freed_entry(&self, comm: &Communicator, state: &mut State) -> Option<usize> {
        let now = Instant::now();
        if state
            .entries_full_since
            .is_some_and(|t| now.duration_since(t) < REUSE_SEARCH)
        {
            return None;
        }
        let freed = state.exports.iter().position(|e| {
            e.key + ZC_ENTRIES < ZC_KEYS && self.gpu.buffer_id(e.base).map_or(true, |id| id != e.id)
        });
        state.entries_full_since = freed.is_none().then_some(now);
        if freed.is_none() && !state.full_logged {
            state.full_logged = true;
            tracing::info!(target: "mscclpp::coll",
                "rank {}: {ZC_ENTRIES} receive allocations offered for zero copy are all in use; \
                 receives into others keep to the slots until one of them is freed", comm.rank());
        }
        freed
    }

    fn staged(&self, index: usize) -> &AtomicU64 {
        debug_assert!(index < MAX_RANKS * ZC_ENTRIES);
        // SAFETY: inside the staging table (checked), 8-byte aligned pinned memory that lives as
        // long as `self`.
        unsafe { &*(self.staging.host_ptr as *const AtomicU64).add(index) }
    }
}

/// Whether `op` moves enough to go zero copy ([`ZERO_COPY_MIN_BYTES`] or more).
pub(crate) fn large(op: &P2pOpArgs) -> bool {
    op.bytes as usize >= ZERO_COPY_MIN_BYTES
}

/// The peers of the large ops of `kind` among `ops`, as a bit mask of ranks.
fn large_peers(ops: &[P2pOpArgs], kind: u32) -> u64 {
    ops.iter()
        .filter(|op| large(op) && op.kind == kind)
        .fold(0u64, |m, op| m | 1 << op.peer)
}

/// The ranks of a bit mask of ranks.
fn ranks_in(mask: u64) -> impl Iterator<Item = usize> {
    (0..MAX_RANKS).filter(move |p| mask & (1 << p) != 0)
}

/// The first 16 bytes of an offer or an answer: engine id, key.
fn message_header(engine: u64, key: usize) -> Vec<u8> {
    [engine, key as u64].map(u64::to_le_bytes).concat()
}

fn header(msg: &[u8]) -> Option<(u64, usize)> {
    let word = |i: usize| Some(u64::from_le_bytes(msg.get(i..i + 8)?.try_into().ok()?));
    Some((word(0)?, usize::try_from(word(8)?).ok()?))
}

impl Drop for ZeroCopy {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.free_host_mapped(&self.staging) {
            tracing::warn!(target: "mscclpp::coll", "freeing the p2p zero-copy staging failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::bootstrap::on_loopback_ranks;
    use mscclpp_core::gpu::MemoryKind;
    use mscclpp_core::port_channel::test_gpu::HostGpu;

    /// (kind, peer) of a rank's large ops.
    type Pattern = fn(usize, usize) -> Vec<(u32, usize)>;

    fn ring(rank: usize, n: usize) -> Vec<(u32, usize)> {
        vec![(KIND_SEND, (rank + 1) % n), (KIND_RECV, (rank + n - 1) % n)]
    }

    /// Two messages each way between two ranks: receives that share a channel are not offered.
    fn twice(rank: usize, _: usize) -> Vec<(u32, usize)> {
        let peer = 1 - rank;
        vec![
            (KIND_SEND, peer),
            (KIND_SEND, peer),
            (KIND_RECV, peer),
            (KIND_RECV, peer),
        ]
    }

    fn all_pairs(rank: usize, n: usize) -> Vec<(u32, usize)> {
        (1..n)
            .flat_map(|d| [(KIND_SEND, (rank + d) % n), (KIND_RECV, (rank + n - d) % n)])
            .collect()
    }

    /// How the thread ranks of [`mark_groups`] go from one mark to the next.
    #[derive(Clone, Copy)]
    enum Between {
        /// They meet at a barrier, and a captured group gets new buffers.
        MeetOnNewBuffers,
        /// They meet at a barrier, free their buffers and take new ones (an allocator that gives
        /// memory back and asks again).
        MeetOnReplacedBuffers,
        /// Each goes on at once with the same buffers (a graph capturing many calls).
        GoOn,
    }

    /// `n` thread ranks (one process: peers' memory is used at its owner's address), each with
    /// its own zero-copy state and new 1 MiB buffers, mark the group `pattern` gives them `marks`
    /// times (see [`Between`]), rank r starting r x `skew` late; every group is marked as
    /// captured if `capturing`. Returns each rank's ops after the last mark.
    fn mark_groups(
        n: usize,
        pattern: Pattern,
        capturing: bool,
        (marks, between): (usize, Between),
        skew: Duration,
    ) -> Vec<Vec<P2pOpArgs>> {
        on_loopback_ranks(n, Duration::from_secs(20), move |rank, boot| {
            let gpu = Arc::new(HostGpu::new());
            gpu.set_capturing(capturing);
            let comm = Communicator::new(boot, gpu.clone(), 0).expect("communicator");
            let table = gpu
                .alloc(MAX_RANKS * ZC_ENTRIES * 8, MemoryKind::Plain)
                .expect("table");
            let zc = ZeroCopy::new(gpu.clone(), table.ptr).expect("zero-copy state");
            let list = pattern(rank, n);
            let mut ops: Vec<P2pOpArgs> = list
                .iter()
                .enumerate()
                .map(|(i, &(kind, peer))| P2pOpArgs {
                    ptr: gpu
                        .alloc(ZERO_COPY_MIN_BYTES, MemoryKind::Plain)
                        .expect("buffer")
                        .ptr,
                    bytes: ZERO_COPY_MIN_BYTES as u64,
                    kind,
                    peer: peer as u32,
                    // As plan::plan numbers a channel's ops.
                    msg_offset: list[..i].iter().filter(|&&o| o == (kind, peer)).count() as u32,
                    last: u32::from(!list[i + 1..].contains(&(kind, peer))),
                    ..P2pOpArgs::default()
                })
                .collect();
            std::thread::sleep(skew * rank as u32);
            for m in 0..marks {
                for op in &mut ops {
                    op.aux = 0;
                    if m == 0 {
                        continue;
                    }
                    if matches!(between, Between::MeetOnReplacedBuffers) {
                        let old = gpu.allocation_of(op.ptr).expect("allocation");
                        gpu.free(&old).expect("free");
                    }
                    if capturing && matches!(between, Between::MeetOnNewBuffers)
                        || matches!(between, Between::MeetOnReplacedBuffers)
                    {
                        // Each capture on new buffers, as a graph pool gives them.
                        op.ptr = gpu
                            .alloc(ZERO_COPY_MIN_BYTES, MemoryKind::Plain)
                            .expect("buffer")
                            .ptr;
                    }
                }
                zc.mark(&comm, &mut ops, Stream::DEFAULT).expect("mark");
                if !matches!(between, Between::GoOn) {
                    comm.bootstrap().barrier().expect("barrier");
                }
            }
            // A rank that left would fail its late peers' polls (its bootstrap closed).
            comm.bootstrap().barrier().expect("barrier");
            ops
        })
    }

    fn assert_zero_copy(groups: &[Vec<P2pOpArgs>], what: &str) {
        for (rank, ops) in groups.iter().enumerate() {
            for op in ops {
                let want = if op.kind == KIND_SEND {
                    op.aux == 1
                } else {
                    op.aux != 0
                };
                assert!(want, "{what}: rank {rank}'s {op:?} is not marked zero copy");
            }
        }
    }

    /// A capture waits for its answers while answering its peers: pairs and all-pairs groups on
    /// new buffers come out zero copy in one mark, even when ranks arrive far apart (a rank whose
    /// answers went out before its offers let a peer leave without them: all-pairs at 4 ranks on
    /// one H200 under MPS, session 27).
    #[test]
    fn captured_groups_on_new_buffers_answer_each_other() {
        let quick = Duration::ZERO;
        let late = Duration::from_millis(30);
        assert_zero_copy(
            &mark_groups(2, ring, true, (1, Between::MeetOnNewBuffers), late),
            "2-rank ring",
        );
        for skew in [quick, late] {
            assert_zero_copy(
                &mark_groups(4, all_pairs, true, (1, Between::MeetOnNewBuffers), skew),
                "4-rank all-pairs",
            );
            // The rank we send to is not one we wait for: its offer is waited for on its own,
            // also once buffers of that peer's are mapped here (a second capture).
            assert_zero_copy(
                &mark_groups(4, ring, true, (1, Between::MeetOnNewBuffers), skew),
                "4-rank ring",
            );
            assert_zero_copy(
                &mark_groups(4, ring, true, (2, Between::MeetOnNewBuffers), skew),
                "4-rank ring, again",
            );
        }
    }

    /// A graph capturing many calls of a ring: ranks drift apart (each waits for the rank it
    /// sends to only), so a rank takes its sender-side peer's notes of several later captures at
    /// once; each capture still waits for the note of its own number, never out to the bound (a
    /// wait ended by an earlier capture's note left a later one with none: 4 ranks on one H200,
    /// the bench's sendrecv captured, session 28).
    #[test]
    fn captured_rings_of_many_calls_never_wait_out_the_bound() {
        for skew in [Duration::ZERO, Duration::from_millis(30)] {
            let started = std::time::Instant::now();
            let groups = mark_groups(4, ring, true, (20, Between::GoOn), skew);
            assert_zero_copy(&groups, "the ring's twentieth captured call");
            let took = started.elapsed() - skew * 3;
            assert!(took < CAPTURE_HANDSHAKE / 2, "took {took:?}");
        }
    }

    /// Allocations freed and allocated again, far more than the table's entries: each new one
    /// takes a freed one's entry (and the sender maps it there), so captured groups keep going
    /// zero copy; while every entry's allocation lives, a new one keeps to the slots.
    #[test]
    fn freed_allocations_give_their_entries_to_new_ones() {
        let marks = 3 * ZC_ENTRIES + 5;
        assert_zero_copy(
            &mark_groups(
                2,
                ring,
                true,
                (marks, Between::MeetOnReplacedBuffers),
                Duration::ZERO,
            ),
            "a capture on the 101st allocation (earlier ones freed)",
        );
        let groups = mark_groups(
            2,
            ring,
            true,
            (ZC_ENTRIES + 1, Between::MeetOnNewBuffers),
            Duration::ZERO,
        );
        let receives = groups.iter().flatten().filter(|op| op.kind == KIND_RECV);
        assert!(
            receives.clone().all(|op| op.aux == 0),
            "the 33rd allocation alive: {groups:?}"
        );
    }

    /// Receives that share their channel are not offered; their peers' notes end the senders'
    /// waits at once instead of at the bound.
    #[test]
    fn captured_receives_without_offers_keep_no_sender_waiting() {
        let started = std::time::Instant::now();
        let groups = mark_groups(
            2,
            twice,
            true,
            (1, Between::MeetOnNewBuffers),
            Duration::ZERO,
        );
        assert!(groups.iter().flatten().all(|op| op.aux == 0), "{groups:?}");
        assert!(
            started.elapsed() < CAPTURE_HANDSHAKE / 2,
            "took {:?}",
            started.elapsed()
        );
    }

    /// Eager groups never wait: a first mark only offers (its receives keep to the slots); the
    /// offers and answers travel between later marks, which then carry the words.
    #[test]
    fn eager_groups_go_zero_copy_without_waiting() {
        let first = mark_groups(
            4,
            all_pairs,
            false,
            (1, Between::MeetOnNewBuffers),
            Duration::ZERO,
        );
        let receives = first.iter().flatten().filter(|op| op.kind == KIND_RECV);
        assert!(receives.clone().all(|op| op.aux == 0), "{first:?}");
        assert_zero_copy(
            &mark_groups(
                4,
                all_pairs,
                false,
                (10, Between::MeetOnNewBuffers),
                Duration::ZERO,
            ),
            "the tenth eager mark",
        );
    }

    #[test]
    fn headers_round_trip_and_short_ones_are_refused() {
        let m = message_header(0xdead_beef_0123_4567, 63);
        assert_eq!(header(&m), Some((0xdead_beef_0123_4567, 63)));
        assert_eq!(header(&m[..15]), None);
    }
}
