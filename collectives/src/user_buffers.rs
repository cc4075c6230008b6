//! Which of the peers' user buffers a zero-copy call touches: agreed by every rank on every call.
//!
//! The rule. A kernel that reads or writes a peer's user buffer (a framework tensor, anything the
//! caller passed) uses the address that peer passed to the same call, never one remembered from an
//! earlier call. Every call therefore starts with one all-gather in which each rank
//! describes the buffers it passed ([`UserBufferTable::agree`]): its address and size, the
//! allocation holding it (base and buffer id) and that allocation's export handle. Each rank then
//! maps whichever peer allocations it has not mapped yet and computes every peer's address from
//! what the peer said. Nothing here is a decision one rank makes alone: a rank whose buffer is new
//! and a rank whose buffer was seen before take part in the same all-gather, and what each maps is
//! a local matter (an import needs only the owner's export handle, which the owner keeps while
//! the allocation lives). So a caching allocator that gives every rank its own history of
//! addresses (PyTorch's), frees between calls, `empty_cache()` on some ranks, or views at any
//! offset into a larger allocation cannot make two ranks disagree.
//!
//! Why this is needed: the earlier cache looked up this rank's own (address, size) alone. One
//! rank could then hit an entry whose peer addresses pointed where the peer's tensor used to be
//! (inside a segment still live, holding some other tensor: wrong data read, and someone else's
//! memory written), while the peer missed and waited in a registration exchange the first rank
//! never joined.
//!
//! Costs. A hit costs one driver query per buffer (its buffer id) and the all-gather, a few
//! hundred bytes per rank, host only (`Communicator::agreement_all_gather`: through a shared page
//! when every rank is on one host, a few microseconds once all have arrived, else the bootstrap):
//! nothing is added on the device, and a call captured in a
//! CUDA graph pays it once, at capture. Mapping is per allocation, not per tensor, so the tensors
//! of one framework segment share one mapping. The promise `MSCCLPP_NCCL_SYMMETRIC_MEMORY=1` (the
//! user guarantees that every rank calls with buffers in the same pattern: a buffer new on one
//! rank is new on every rank) skips the all-gather for a set of buffers agreed before, as MSCCL++
//! does under the same variable.
//!
//! Lifetimes. An export lives while its allocation does: when a rank finds one of its allocations
//! freed (its buffer id gone, checked whenever it exports a new one), it drops the export and
//! names its id in its next description; every peer then closes its mapping. The peers' kernels
//! that used it had finished: the owner freed it after its own calls on it completed, and every
//! zero-copy kernel ends in a barrier with every peer after its last access of their buffers.

use mscclpp_core::communicator::{Communicator, RegisteredMemory};
use mscclpp_core::env::Env;
use mscclpp_core::gpu::DevicePtr;
use mscclpp_core::{Error, Result};
use mscclpp_kernels_cu::collectives::PeerPtrs;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use crate::resources::lock;

/// A buffer a caller passed: its address in this process and the bytes the call may touch.
/// A null address (a buffer the collective does not use on this rank, say a reduce's output off
/// the root) is described as such, and peers see 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UserBuffer {
    pub ptr: DevicePtr,
    pub bytes: usize,
}

impl UserBuffer {
    pub fn new(ptr: DevicePtr, bytes: usize) -> UserBuffer {
        UserBuffer { ptr, bytes }
    }
}

/// What every rank passed to one call, and where each of those buffers is addressed here.
#[derive(Debug, Clone)]
pub struct Agreed {
    buffers: usize,
    /// `[rank * buffers + buffer]`.
    entries: Vec<Entry>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// The rank's buffer as this process addresses it (a peer on another host: its own address).
    here: DevicePtr,
    /// The buffer as the rank passed it.
    theirs: UserBuffer,
}

impl Agreed {
    /// Every rank's address of buffer `buffer` (the index in the list given to `agree`), by rank.
    pub fn ptrs(&self, buffer: usize) -> Vec<DevicePtr> {
        self.entries
            .iter()
            .skip(buffer)
            .step_by(self.buffers)
            .map(|e| e.here)
            .collect()
    }

    /// [`ptrs`](Self::ptrs) as a kernel argument.
    pub fn peers(&self, buffer: usize) -> Result<PeerPtrs> {
        PeerPtrs::from_slice(&self.ptrs(buffer))
    }

    /// Buffer `buffer` as rank `rank` passed it (its own address and size).
    pub fn passed(&self, rank: usize, buffer: usize) -> UserBuffer {
        self.entries[rank * self.buffers + buffer].theirs
    }

    /// Ranks that took part.
    pub fn ranks(&self) -> usize {
        self.entries.len() / self.buffers.max(1)
    }

    /// An agreement on what each rank passed (`passed[rank][buffer]`), every buffer addressed
    /// here where its rank passed it: for tests of decisions made from an agreement.
    #[cfg(test)]
    pub(crate) fn of_passed(passed: &[Vec<UserBuffer>]) -> Agreed {
        Agreed {
            buffers: passed.first().map_or(0, Vec::len),
            entries: passed
                .iter()
                .flatten()
                .map(|&b| Entry {
                    here: b.ptr,
                    theirs: b,
                })
                .collect(),
        }
    }
}

/// One of this rank's allocations, exported for the peers.
struct Export {
    size: usize,
    id: u64,
    /// The export (its handle lives as long as it does) and its description as peers map it.
    _mem: RegisteredMemory,
    message: Vec<u8>,
}

/// This rank's side of [`Agreed`] calls: its exports, the peers' allocations mapped here, and
/// (under the symmetric-memory promise) the agreements made before.
#[derive(Default)]
struct State {
    /// This rank's exported allocations by base address.
    exports: BTreeMap<DevicePtr, Export>,
    /// Buffer ids of exports dropped since the last description (their allocations were freed).
    retired: Vec<u64>,
    /// Peers' allocations mapped here, by (rank, buffer id).
    imports: HashMap<(usize, u64), RegisteredMemory>,
    /// Under the promise: agreements by what this rank passed (buffers and their ids).
    promised: HashMap<Vec<(UserBuffer, u64)>, Arc<Agreed>>,
}

/// Which call a description belongs to: every rank's must be the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Call {
    tag: u64,
    number: u64,
    buffers: usize,
}

/// The user buffers of one algorithm's calls (see the module docs). Calls on one table are
/// serialised by its lock, as calls of one communicator are by NCCL's rules.
pub struct UserBufferTable {
    /// Names the collective in every description, with the communicator's number of the call
    /// (`Communicator::next_agreement`): ranks that reach this all-gather from different
    /// collectives or calls (they called collectives in different orders) fail naming both,
    /// instead of taking each other's buffers. Algorithms of one collective share the name, since
    /// the ranks of one call may run different ones (`default_allreduce_copy_engine` runs the
    /// zero-copy kernel of the in-place ranks' algorithm).
    name: String,
    tag: u64,
    state: Mutex<State>,
}

/// What one rank says of one buffer, as it travels: address, bytes, allocation base, buffer id
/// (0 for a null buffer), then its export's description.
const BUFFER_HEADER: usize = 4 * 8 + 4;

impl UserBufferTable {
    /// The table of an algorithm of collective `name`.
    pub fn new(name: impl Into<String>) -> UserBufferTable {
        let name = name.into();
        // FNV-1a: stable across processes and builds.
        let tag = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        UserBufferTable {
            name,
            tag,
            state: Mutex::new(State::default()),
        }
    }

    /// Collective (every rank of `comm` calls it for the same call, with the same number of
    /// buffers): every rank's address of each of `buffers`, agreed as the module docs say.
    pub fn agree(&self, comm: &Communicator, buffers: &[UserBuffer]) -> Result<Arc<Agreed>> {
        let mut state = lock(&self.state)?;
        let mine: Result<Vec<_>> = buffers
            .iter()
            .map(|&b| state.export(comm, b).map(|(base, id)| (b, base, id)))
            .collect();
        let mine = match mine {
            Ok(mine) => mine,
            Err(e) => return Err(self.refuse(comm, buffers.len(), e)),
        };
        let promised = Env::get()?.nccl_symmetric_memory;
        let key: Vec<(UserBuffer, u64)> = mine.iter().map(|&(b, _, id)| (b, id)).collect();
        if promised {
            if let Some(found) = state.promised.get(&key) {
                return Ok(found.clone());
            }
        }
        let call = Call {
            tag: self.tag,
            number: comm.next_agreement(),
            buffers: buffers.len(),
        };
        let message = state.describe(call, &mine);
        let all = comm.agreement_all_gather(&message)?;
        let agreed = Arc::new(state.map_all(comm, &self.name, call, &all)?);
        if promised {
            state.promised.insert(key, agreed.clone());
        }
        Ok(agreed)
    }
}

impl UserBufferTable {
    /// Collective, in place of [`Self::agree`] with `buffers` buffers, for a rank that cannot take
    /// part in this call (`why`): the peers are in the all-gather already, so they learn why at
    /// once and fail naming this rank, instead of waiting for the bootstrap timeout. Returns `why`.
    pub fn refuse(&self, comm: &Communicator, buffers: usize, why: Error) -> Error {
        let call = Call {
            tag: self.tag,
            number: comm.next_agreement(),
            buffers,
        };
        let _ = comm.agreement_all_gather(&describe_failure(call, &why));
        why
    }
}

impl State {
    /// The allocation base and buffer id of `b` (0, 0 for a null buffer), exporting its
    /// allocation if this is its first use.
    fn export(&mut self, comm: &Communicator, b: UserBuffer) -> Result<(DevicePtr, u64)> {
        if b.ptr == 0 {
            return Ok((0, 0));
        }
        let gpu = comm.gpu();
        let id = gpu.buffer_id(b.ptr).map_err(|e| not_device_memory(b, e))?;
        let known = self
            .exports
            .range(..=b.ptr)
            .next_back()
            .filter(|(base, e)| e.id == id && b.ptr + b.bytes as u64 <= **base + e.size as u64);
        if let Some((&base, _)) = known {
            return Ok((base, id));
        }
        // A new allocation: first drop the exports whose allocations are gone (one may have
        // stood at this very address), so their peers unmap them.
        let dead: Vec<DevicePtr> = self
            .exports
            .iter()
            .filter(|(&base, e)| gpu.buffer_id(base).ok() != Some(e.id))
            .map(|(&base, _)| base)
            .collect();
        for base in dead {
            if let Some(e) = self.exports.remove(&base) {
                self.retired.push(e.id);
            }
        }
        let alloc = gpu
            .allocation_of(b.ptr)
            .map_err(|e| not_device_memory(b, e))?;
        let end = alloc.ptr + alloc.size as u64;
        if b.ptr.checked_add(b.bytes as u64).map_or(true, |e| e > end) {
            return Err(Error::InvalidArgument(format!(
                "rank {}: buffer {:#x} of {} bytes runs past the end of its allocation \
                 [{:#x}, {end:#x})",
                comm.rank(),
                b.ptr,
                b.bytes,
                alloc.ptr
            )));
        }
        let mem = comm.register(&alloc, alloc.ptr, alloc.size).map_err(|e| {
            Error::InvalidArgument(format!(
                "rank {}: exporting the allocation of user buffer {:#x} ({} bytes) for a \
                     zero-copy collective: {e}",
                comm.rank(),
                b.ptr,
                b.bytes
            ))
        })?;
        let message = Communicator::memory_message(&mem)?;
        self.exports.insert(
            alloc.ptr,
            Export {
                size: alloc.size,
                id,
                _mem: mem,
                message,
            },
        );
        Ok((alloc.ptr, id))
    }

    /// This rank's description of `mine` (buffer, allocation base, id) and of its retired exports,
    /// which are then told.
    fn describe(&mut self, call: Call, mine: &[(UserBuffer, DevicePtr, u64)]) -> Vec<u8> {
        let mut out = Vec::with_capacity(24 + mine.len() * (BUFFER_HEADER + 512));
        header(&mut out, call, mine.len() as u32, self.retired.len());
        for &(b, base, id) in mine {
            let message = self.exports.get(&base).map_or(&[][..], |e| &e.message[..]);
            for word in [b.ptr, b.bytes as u64, base, id] {
                out.extend_from_slice(&word.to_le_bytes());
            }
            out.extend_from_slice(&(message.len() as u32).to_le_bytes());
            out.extend_from_slice(message);
        }
        for id in self.retired.drain(..) {
            out.extend_from_slice(&id.to_le_bytes());
        }
        out
    }

    /// Every rank's buffers from their descriptions `all` (by rank), mapping peers' allocations
    /// not mapped yet and unmapping the ones their owners retired.
    fn map_all(
        &mut self,
        comm: &Communicator,
        name: &str,
        call: Call,
        all: &[Vec<u8>],
    ) -> Result<Agreed> {
        let me = comm.rank();
        let mut entries = Vec::with_capacity(all.len() * call.buffers);
        for (rank, bytes) in all.iter().enumerate() {
            let said = Description::parse(rank, bytes, name, call)?;
            for id in &said.retired {
                self.imports.remove(&(rank, *id));
            }
            for b in said.buffers {
                let here = if rank == me || b.buffer.ptr == 0 {
                    b.buffer.ptr
                } else {
                    self.peer_address(comm, rank, &b)?
                };
                entries.push(Entry {
                    here,
                    theirs: b.buffer,
                });
            }
        }
        Ok(Agreed {
            buffers: call.buffers,
            entries,
        })
    }

    /// Where this process addresses `rank`'s buffer `b`, mapping its allocation on first use.
    fn peer_address(
        &mut self,
        comm: &Communicator,
        rank: usize,
        b: &BufferSaid<'_>,
    ) -> Result<DevicePtr> {
        let key = (rank, b.id);
        let mem = match self.imports.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let mem = comm.map_message(rank, b.export).map_err(|e| Error::Peer {
                    rank,
                    message: format!(
                        "mapping its buffer {:#x} ({} bytes) for a zero-copy collective: {e}",
                        b.buffer.ptr, b.buffer.bytes
                    ),
                })?;
                v.insert(mem)
            }
        };
        Ok(mem.ptr() + (b.buffer.ptr - b.base))
    }
}

/// What a rank that cannot describe its buffers sends instead (`FAILED` buffers), with why.
fn describe_failure(call: Call, e: &Error) -> Vec<u8> {
    let why = e.to_string();
    let mut out = Vec::with_capacity(24 + why.len());
    header(&mut out, call, FAILED, 0);
    out.extend_from_slice(why.as_bytes());
    out
}

/// The head of every description: the call (tag, number), the buffer count (or [`FAILED`]) and
/// how many retired ids follow the buffers.
fn header(out: &mut Vec<u8>, call: Call, buffers: u32, retired: usize) {
    out.extend_from_slice(&call.tag.to_le_bytes());
    out.extend_from_slice(&call.number.to_le_bytes());
    out.extend_from_slice(&buffers.to_le_bytes());
    out.extend_from_slice(&(retired as u32).to_le_bytes());
}

/// The buffer count of a rank that could not describe its buffers.
const FAILED: u32 = u32::MAX;

fn not_device_memory(b: UserBuffer, e: Error) -> Error {
    Error::InvalidArgument(format!(
        "buffer {:#x} ({} bytes) is not device memory this GPU can share: {e}",
        b.ptr, b.bytes
    ))
}

/// One rank's description as parsed: its buffers, and the ids of exports it retired.
struct Description<'a> {
    buffers: Vec<BufferSaid<'a>>,
    retired: Vec<u64>,
}

struct BufferSaid<'a> {
    buffer: UserBuffer,
    base: DevicePtr,
    id: u64,
    export: &'a [u8],
}

impl<'a> Description<'a> {
    /// `rank`'s description, which must be of this rank's `call` (of algorithm `name`); anything
    /// else is an error naming the rank.
    fn parse(rank: usize, bytes: &'a [u8], name: &str, call: Call) -> Result<Description<'a>> {
        let bad = |what: String| Error::Peer {
            rank,
            message: format!("sent a malformed buffer description ({what})"),
        };
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&'a [u8]> {
            let part = bytes
                .get(at..at + n)
                .ok_or_else(|| bad(format!("{} bytes, cut at {at}", bytes.len())))?;
            at += n;
            Ok(part)
        };
        let u32_at = |b: &[u8]| u32::from_le_bytes(b.try_into().unwrap_or([0; 4])) as usize;
        let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
        let (tag, number) = (u64_at(take(8)?), u64_at(take(8)?));
        let count = u32_at(take(4)?);
        let retired = u32_at(take(4)?);
        if count == FAILED as usize {
            let why = String::from_utf8_lossy(bytes.get(at..).unwrap_or_default());
            return Err(Error::Peer {
                rank,
                message: format!("could not take part in call {number} of {name}: {why}"),
            });
        }
        if (tag, number, count) != (call.tag, call.number, call.buffers) {
            let what = if tag == call.tag {
                format!("its call {number} of {name} ({count} buffers)")
            } else {
                "a call of another collective".to_string()
            };
            return Err(Error::Peer {
                rank,
                message: format!(
                    "described its buffers for {what} where this rank made call {} of {name} \
                     ({} buffers): the ranks called collectives in different orders",
                    call.number, call.buffers
                ),
            });
        }
        let mut buffers = Vec::with_capacity(count);
        for _ in 0..count {
            let words = take(32)?;
            let word = |i: usize| u64_at(&words[8 * i..8 * i + 8]);
            let len = u32_at(take(4)?);
            let export = take(len)?;
            let bytes = usize::try_from(word(1)).map_err(|_| bad("a size too large".into()))?;
            let (ptr, base) = (word(0), word(2));
            if ptr != 0 && (ptr < base || export.is_empty()) {
                return Err(bad(format!(
                    "buffer {ptr:#x} outside its allocation {base:#x}"
                )));
            }
            buffers.push(BufferSaid {
                buffer: UserBuffer { ptr, bytes },
                base,
                id: word(3),
                export,
            });
        }
        let retired = (0..retired)
            .map(|_| take(8).map(u64_at))
            .collect::<Result<Vec<u64>>>()?;
        if at != bytes.len() {
            return Err(bad(format!("{} bytes left over", bytes.len() - at)));
        }
        Ok(Description { buffers, retired })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CALL: Call = Call {
        tag: 77,
        number: 5,
        buffers: 2,
    };

    fn description(buffers: &[(u64, u64, u64, u64, &[u8])], retired: &[u64]) -> Vec<u8> {
        let mut out = Vec::new();
        header(&mut out, CALL, buffers.len() as u32, retired.len());
        for &(ptr, bytes, base, id, export) in buffers {
            for w in [ptr, bytes, base, id] {
                out.extend_from_slice(&w.to_le_bytes());
            }
            out.extend_from_slice(&(export.len() as u32).to_le_bytes());
            out.extend_from_slice(export);
        }
        for id in retired {
            out.extend_from_slice(&id.to_le_bytes());
        }
        out
    }

    /// The error `parse` gives, as text.
    fn refusal(rank: usize, bytes: &[u8], name: &str, call: Call) -> String {
        match Description::parse(rank, bytes, name, call) {
            Ok(_) => panic!("rank {rank}'s description was taken"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_description_round_trips() {
        let bytes = description(
            &[(0x1010, 64, 0x1000, 7, b"{desc}"), (0, 0, 0, 0, b"")],
            &[3, 5],
        );
        let d = Description::parse(1, &bytes, "algo", CALL).unwrap();
        assert_eq!(d.buffers.len(), 2);
        assert_eq!(d.buffers[0].buffer, UserBuffer::new(0x1010, 64));
        assert_eq!((d.buffers[0].base, d.buffers[0].id), (0x1000, 7));
        assert_eq!(d.buffers[0].export, b"{desc}");
        assert_eq!(d.buffers[1].buffer.ptr, 0);
        assert_eq!(d.retired, vec![3, 5]);
    }

    #[test]
    fn a_different_call_on_a_peer_is_named() {
        let two = [(0x1010, 64, 0x1000, 7, &b"x"[..]), (0, 0, 0, 0, &b""[..])];
        let bytes = description(&two[..1], &[]);
        let e = refusal(3, &bytes, "algo", CALL);
        assert!(e.contains("rank 3"), "{e}");
        assert!(e.contains("its call 5 of algo (1 buffers)"), "{e}");
        let bytes = description(&two, &[]);
        let later = Call { number: 6, ..CALL };
        let e = refusal(2, &bytes, "algo", later);
        assert!(e.contains("different orders"), "{e}");
        let other = Call { tag: 78, ..CALL };
        let e = refusal(2, &bytes, "algo", other);
        assert!(e.contains("another collective"), "{e}");
    }

    #[test]
    fn a_peer_that_could_not_describe_its_buffers_is_named_with_its_reason() {
        let why = Error::InvalidArgument("buffer 0x10 is not device memory".into());
        let bytes = describe_failure(CALL, &why);
        let e = refusal(5, &bytes, "AllReduce", CALL);
        assert!(e.contains("rank 5"), "{e}");
        assert!(e.contains("call 5 of AllReduce"), "{e}");
        assert!(e.contains("not device memory"), "{e}");
    }

    #[test]
    fn tables_of_different_collectives_have_different_tags() {
        let a = UserBufferTable::new("AllReduce");
        let b = UserBufferTable::new("AllGather");
        assert_ne!(a.tag, b.tag);
        assert_eq!(a.tag, UserBufferTable::new("AllReduce").tag);
    }

    #[test]
    fn malformed_descriptions_are_errors_not_panics() {
        let one = Call { buffers: 1, ..CALL };
        let parse = |bytes: &[u8]| Description::parse(0, bytes, "algo", one).is_err();
        let good = description(&[(0x1010, 64, 0x1000, 7, b"xy")], &[9]);
        assert!(!parse(&good));
        for cut in 0..good.len() {
            assert!(parse(&good[..cut]), "cut at {cut}");
        }
        let mut long = good.clone();
        long.push(0);
        assert!(parse(&long));
        // An address below its allocation, or a live buffer with no export to map.
        assert!(parse(&description(&[(0x0f00, 64, 0x1000, 7, b"x")], &[])));
        assert!(parse(&description(&[(0x1010, 64, 0x1000, 7, b"")], &[])));
    }

    #[test]
    fn agreed_addresses_are_read_by_buffer_and_rank() {
        let e = |here, ptr| Entry {
            here,
            theirs: UserBuffer::new(ptr, 8),
        };
        // Two ranks, two buffers each.
        let a = Agreed {
            buffers: 2,
            entries: vec![e(10, 10), e(11, 11), e(20, 200), e(21, 210)],
        };
        assert_eq!(a.ranks(), 2);
        assert_eq!(a.ptrs(0), vec![10, 20]);
        assert_eq!(a.ptrs(1), vec![11, 21]);
        assert_eq!(a.passed(1, 1), UserBuffer::new(210, 8));
    }
}
