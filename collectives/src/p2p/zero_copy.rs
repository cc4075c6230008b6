//! The host half of the engine's zero-copy path for large messages (kernels/p2p.cu, "Zero copy").
//!
//! A receiver registers the allocation behind a large receive and offers it to the sender; the
//! sender maps it, copies its address into its device table (`P2pState::zc_table`) on the stream of
//! its next group (never while that stream is being captured: the offer waits for a later group)
//! and confirms; receives into a confirmed allocation then carry its zero-copy word, and the sender's
//! kernel writes them straight into the buffer. Neither side ever waits for the other: offers and
//! confirmations travel on the bootstrap and are polled (`try_recv`) when a group has a large op
//! towards that peer, so a buffer's first messages go through the slots and later ones, graph
//! replays included, straight into it. Nothing is unmapped while the engine lives (a captured
//! graph may still post a key): at most [`ZC_ENTRIES`] allocations are offered per engine, later
//! ones keep to the slots.
//!
//! A table entry is written once and never replaced (a send in flight may read it at any time),
//! and a receive carries a key only once its sender confirmed it: confirmations name the offering
//! engine's random id, so an engine built later on the same communicator never takes an earlier
//! one's for its own, and an earlier engine's offer that took a key's entry first leaves that key
//! unconfirmed (its messages keep to the slots).

use mscclpp_core::communicator::{Communicator, RegisteredMemory};
use mscclpp_core::gpu::{DevicePtr, Gpu, HostMapped, Stream};
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::collectives::MAX_RANKS;
use mscclpp_kernels_cu::p2p::{zc_word, P2pOpArgs, KIND_COPY, KIND_RECV, KIND_SEND, ZC_ENTRIES};
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Messages from this size on may go zero copy: above every layout's slots per peer (896 KiB at
/// 2 ranks), where the slots' round trips bound a message, and where the send's wait for the
/// receiver's post costs little against the bytes.
pub const ZERO_COPY_MIN_BYTES: usize = 1 << 20;

/// Bootstrap tags: a receiver's offer (engine id, key, memory), a sender's confirmation (the
/// offering engine's id, key).
const TAG_OFFER: u64 = 0x7032_7a00;
const TAG_MAPPED: u64 = 0x7032_7a01;

/// One allocation this engine offered (its key is its index).
struct Export {
    base: DevicePtr,
    size: usize,
    /// The allocation's buffer id: a new allocation at the same address is another export.
    id: u64,
    /// The registration (its exported handle lives as long as it does).
    mem: RegisteredMemory,
    /// Ranks it was offered to, and ranks that mapped it.
    offered: u64,
    mapped: u64,
}

#[derive(Default)]
struct State {
    exports: Vec<Export>,
    /// Allocations that could not be registered (allocation base, buffer id): not tried again.
    refused: HashSet<(DevicePtr, u64)>,
    /// The table's entries, (peer, key): each written once, never replaced.
    installed: HashSet<(usize, usize)>,
    /// Peers' memory mapped here, kept until the engine goes.
    imports: Vec<RegisteredMemory>,
    /// Whether running out of keys was logged.
    full_logged: bool,
    /// Receives marked with a zero-copy word so far.
    receives: u64,
}

/// One engine's zero-copy state: its table, its offers and the peers' memory it mapped.
pub(crate) struct ZeroCopy {
    /// The device table (`P2pState::zc_table`): `[rank][key]` addresses of peers' offered
    /// allocations as mapped here (0: not mapped).
    table: DevicePtr,
    /// Pinned host copy of the table, the source of the copies into it.
    staging: HostMapped,
    id: u64,
    state: Mutex<State>,
    gpu: Arc<dyn Gpu>,
}

// SAFETY: `staging` is pinned host memory owned until drop; the host writes its entries with
// atomics under the state's lock, and only copies on the device read them.
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
            table,
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

    /// Marks the planned ops of one group: sends of [`ZERO_COPY_MIN_BYTES`] or more may go zero
    /// copy; receives that large, each the only op of its channel in the group, into an allocation
    /// their sender has mapped get its word. Polls the offers (unless `stream` is being captured)
    /// and confirmations of those ops' peers, and offers new allocations; never waits for a peer.
    pub fn mark(&self, comm: &Communicator, ops: &mut [P2pOpArgs], stream: Stream) -> Result<()> {
        let large = |op: &P2pOpArgs| op.bytes as usize >= ZERO_COPY_MIN_BYTES;
        if !ops.iter().any(|op| large(op) && op.kind != KIND_COPY) {
            return Ok(());
        }
        let mut state = self.state.lock().map_err(|_| {
            Error::Internal("the p2p zero-copy state was poisoned by a panic".into())
        })?;
        // A table copy would join the capture; the offers wait for a later group instead.
        let capturing = self.gpu.is_capturing(stream)?;
        let (mut polled_offers, mut polled_confirmations) = (0u64, 0u64);
        for op in ops.iter_mut().filter(|op| large(op)) {
            let peer = op.peer as usize;
            if op.kind == KIND_SEND {
                if !capturing && polled_offers & (1 << peer) == 0 {
                    polled_offers |= 1 << peer;
                    self.take_offers(comm, &mut state, peer, stream)?;
                }
                // Without a mapped buffer of the peer's no receive can carry a word for us (only
                // mapped ones are confirmed): the send keeps to the slots without waiting for the
                // receiver's post.
                op.aux = u64::from(state.installed.iter().any(|&(p, _)| p == peer));
            } else if op.kind == KIND_RECV && op.msg_offset == 0 && op.last == 1 {
                if polled_confirmations & (1 << peer) == 0 {
                    polled_confirmations |= 1 << peer;
                    self.take_confirmations(comm, &mut state, peer)?;
                }
                op.aux = self.word(comm, &mut state, peer, op.ptr, op.bytes as usize)?;
                state.receives += u64::from(op.aux != 0);
            }
        }
        Ok(())
    }

    /// Maps every offer `peer` sent so far, copies it into the table on `stream` and confirms it.
    fn take_offers(
        &self,
        comm: &Communicator,
        state: &mut State,
        peer: usize,
        stream: Stream,
    ) -> Result<()> {
        while let Some(msg) = comm.bootstrap().try_recv(peer, TAG_OFFER)? {
            let malformed = || Error::Peer {
                rank: peer,
                message: format!("sent a malformed zero-copy offer ({} bytes)", msg.len()),
            };
            let (engine, key) = header(&msg).ok_or_else(malformed)?;
            if key >= ZC_ENTRIES {
                return Err(malformed());
            }
            if state.installed.contains(&(peer, key)) {
                // An offer of an earlier engine of the peer's took this entry: this one stays
                // unconfirmed, its messages keep to the slots.
                continue;
            }
            let mem = match comm.import_message(peer, &msg[16..]) {
                Ok(mem) => mem,
                Err(e) => {
                    // Unconfirmed, the peer keeps this allocation's messages in the slots.
                    tracing::warn!(target: "mscclpp::coll",
                        "rank {}: mapping rank {peer}'s receive buffer for zero-copy sends failed \
                         (its messages keep to the slots): {e}", comm.rank());
                    continue;
                }
            };
            let index = peer * ZC_ENTRIES + key;
            let staged = self.staged(index);
            staged.store(mem.ptr(), Ordering::Release);
            self.gpu.memcpy_async(
                self.table + 8 * index as u64,
                staged.as_ptr() as DevicePtr,
                8,
                stream,
            )?;
            state.imports.push(mem);
            state.installed.insert((peer, key));
            comm.bootstrap()
                .send(peer, TAG_MAPPED, &message_header(engine, key))?;
        }
        Ok(())
    }

    /// Records every confirmation `peer` sent so far of this engine's offers.
    fn take_confirmations(
        &self,
        comm: &Communicator,
        state: &mut State,
        peer: usize,
    ) -> Result<()> {
        while let Some(msg) = comm.bootstrap().try_recv(peer, TAG_MAPPED)? {
            let (engine, key) = header(&msg).ok_or_else(|| Error::Peer {
                rank: peer,
                message: format!(
                    "sent a malformed zero-copy confirmation ({} bytes)",
                    msg.len()
                ),
            })?;
            if engine != self.id {
                continue;
            }
            if let Some(export) = state.exports.get_mut(key) {
                export.mapped |= 1 << peer;
            }
        }
        Ok(())
    }

    /// The zero-copy word of a receive of `bytes` at `ptr` from `peer` once `peer` mapped its
    /// allocation, else 0, offering the allocation first where it was not yet.
    fn word(
        &self,
        comm: &Communicator,
        state: &mut State,
        peer: usize,
        ptr: DevicePtr,
        bytes: usize,
    ) -> Result<u64> {
        let Some(key) = self.export_of(comm, state, ptr, bytes) else {
            return Ok(0);
        };
        let export = &mut state.exports[key];
        if export.mapped & (1 << peer) != 0 {
            return Ok(zc_word(key, ptr - export.base).unwrap_or(0));
        }
        if export.offered & (1 << peer) == 0 {
            let mut msg = message_header(self.id, key);
            msg.extend(Communicator::memory_message(&export.mem)?);
            comm.bootstrap().send(peer, TAG_OFFER, &msg)?;
            export.offered |= 1 << peer;
        }
        Ok(0)
    }

    /// The key of the export holding `[ptr, ptr + bytes)`, registering its allocation if it is
    /// new; `None` where it cannot be registered or the keys ran out.
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
        if let Some(key) = state
            .exports
            .iter()
            .position(|e| e.id == id && holds(e.base, e.size))
        {
            return Some(key);
        }
        if state.exports.len() >= ZC_ENTRIES {
            if !state.full_logged {
                state.full_logged = true;
                tracing::info!(target: "mscclpp::coll",
                    "rank {}: {ZC_ENTRIES} receive allocations already offered for zero copy; \
                     receives into new ones keep to the slots", comm.rank());
            }
            return None;
        }
        let alloc = self.gpu.allocation_of(ptr).ok()?;
        if state.refused.contains(&(alloc.ptr, id)) || !holds(alloc.ptr, alloc.size) {
            return None;
        }
        match comm.register(&alloc, alloc.ptr, alloc.size) {
            Ok(mem) => {
                state.exports.push(Export {
                    base: alloc.ptr,
                    size: alloc.size,
                    id,
                    mem,
                    offered: 0,
                    mapped: 0,
                });
                Some(state.exports.len() - 1)
            }
            Err(e) => {
                tracing::debug!(target: "mscclpp::coll",
                    "rank {}: receive buffer {ptr:#x} cannot be offered for zero copy (its \
                     messages keep to the slots): {e}", comm.rank());
                state.refused.insert((alloc.ptr, id));
                None
            }
        }
    }

    fn staged(&self, index: usize) -> &AtomicU64 {
        assert!(index < MAX_RANKS * ZC_ENTRIES);
        // SAFETY: inside the staging table (checked), 8-byte aligned pinned memory that lives as
        // long as `self`.
        unsafe { &*(self.staging.host_ptr as *const AtomicU64).add(index) }
    }
}

/// The first 16 bytes of an offer or a confirmation: engine id, key.
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

    #[test]
    fn headers_round_trip_and_short_ones_are_refused() {
        let m = message_header(0xdead_beef_0123_4567, 63);
        assert_eq!(header(&m), Some((0xdead_beef_0123_4567, 63)));
        assert_eq!(header(&m[..15]), None);
    }
}
