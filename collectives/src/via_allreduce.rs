//! `default_allgather_via_allreduce`, `default_broadcast_via_allreduce` and
//! `default_reducescatter_via_allreduce`: all-gather, broadcast and reduce-scatter for ranks on
//! several hosts, through the all-reduce the multi-host collection built
//! (`default_allreduce_hierarchical`, or the flat `port_allreduce`), so every topology that has a
//! multi-host all-reduce has these as well. A stop-gap until cross-host primitives of their own
//! exist: each moves about twice the bytes its collective must.
//!
//! # All-gather and broadcast: a byte-wise sum of the output
//!
//! Each rank zeroes the bytes of the output it does not own and writes its own (all-gather: its
//! input into its slot; broadcast: the root its input, the others nothing); then the output is
//! all-reduced as `u8` with `sum`. Every byte has exactly one rank that may make it non-zero, and
//! `0 + ... + x + ... + 0 = x` in `u8` arithmetic for any byte, so the result is bit-exact for
//! every data type (negative zeros and NaN payloads included). The cost: an all-reduce of the
//! whole output, about twice the bytes an all-gather or a broadcast must move, and a memset.
//!
//! # Reduce-scatter: the rank-ordered pieces packed into a scratch
//! [`ReduceScatterViaAllreduce`] owns a scratch of `scratch_bytes / 4` (2 MiB by default). The
//! chunks go in segments of `scratch / nranks` bytes: for each, every rank's piece of that segment
//! (`input[r * chunk + offset ..]` for every rank r) is copied into the scratch side by side, the
//! scratch is all-reduced in place with the call's type and op, and this rank's piece is copied
//! out to its output. In place (output = this rank's chunk of the input) too: the copy out lands
//! on bytes already packed, and later segments read only later bytes.
//!
//! All on the caller's stream (stream-ordered copies and memsets, then the all-reduce): no host
//! synchronisation, legal during CUDA-graph capture. The all-reduce's kernels are loaded before
//! anything of a call is enqueued.

use crate::resources::DeviceBuffer;
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::native_names;
use mscclpp_core::communicator::Communicator;
use mscclpp_core::{AccumType, DataType, Error, ReduceOp, Result};
use mscclpp_kernels_cu::collectives::resolve_accumulator;
use std::sync::Arc;

/// The collectives served this way.
pub const COLLECTIVES: [Collective; 2] = [Collective::AllGather, Collective::Broadcast];

/// What one rank does to its output before the all-reduce: byte ranges `(offset, len)` to zero,
/// and where its own input goes (`(offset, len)` of the output; `None` where nothing is copied:
/// in place, or a broadcast's non-root). `total` is the output's bytes that are all-reduced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staging {
    pub zero: Vec<(usize, usize)>,
    pub copy: Option<(usize, usize)>,
    pub total: usize,
}

/// The name of the algorithm for `collective`, if it is one of [`COLLECTIVES`].
pub const fn name_of(collective: Collective) -> Option<&'static str> {
    match collective {
        Collective::AllGather => Some(native_names::ALLGATHER_VIA_ALLREDUCE),
        Collective::Broadcast => Some(native_names::BROADCAST_VIA_ALLREDUCE),
        _ => None,
    }
}

/// Checks `args` for `collective` as rank `rank` of `nranks` and returns what the rank stages
/// (no device access; errors name the algorithm). Pure, so it is tested on the CPU.
pub fn staging(
    collective: Collective,
    rank: usize,
    nranks: usize,
    args: &ExecuteArgs,
) -> Result<Staging> {
    let name = name_of(collective)
        .ok_or_else(|| Error::Internal(format!("no {collective} algorithm via all-reduce")))?;
    let count = args.input_count()?;
    let bytes = args.input_bytes;
    let need = |total: usize| -> Result<()> {
        if args.output_bytes < total {
            return Err(Error::InvalidArgument(format!(
                "{name}: the output holds {} bytes, the call needs {total}",
                args.output_bytes
            )));
        }
        if count > 0 && args.output == 0 {
            return Err(Error::InvalidArgument(format!(
                "{name}: null output pointer"
            )));
        }
        Ok(())
    };
    let null_input = || Error::InvalidArgument(format!("{name}: null input pointer"));
    match collective {
        Collective::AllGather => {
            let total = nranks * bytes;
            need(total)?;
            if count > 0 && args.input == 0 {
                return Err(null_input());
            }
            let own = rank * bytes;
            let in_place = args.output.checked_add(own as u64) == Some(args.input);
            let zero = [(0, own), (own + bytes, total - own - bytes)]
                .into_iter()
                .filter(|&(_, len)| len > 0)
                .collect();
            Ok(Staging {
                zero,
                copy: (!in_place && bytes > 0).then_some((own, bytes)),
                total,
            })
        }
        _ => {
            if args.root >= nranks {
                return Err(Error::InvalidArgument(format!(
                    "{name}: root {} is not a rank of {nranks}",
                    args.root
                )));
            }
            need(bytes)?;
            let root = rank == args.root;
            if root && count > 0 && args.input == 0 {
                return Err(null_input());
            }
            let copy = root && args.input != args.output && bytes > 0;
            Ok(Staging {
                zero: if root || bytes == 0 {
                    Vec::new()
                } else {
                    vec![(0, bytes)]
                },
                copy: copy.then_some((0, bytes)),
                total: bytes,
            })
        }
    }
}

/// All-gather or broadcast through a multi-host all-reduce. See the module docs.
pub struct ViaAllreduce {
    collective: Collective,
    name: &'static str,
    allreduce: Arc<dyn Algorithm>,
    comm: Arc<Communicator>,
}

impl ViaAllreduce {
    /// `collective` (one of [`COLLECTIVES`]) over `allreduce`, an all-reduce of `comm`. Builds
    /// nothing on the device: not collective.
    pub fn new(
        collective: Collective,
        allreduce: Arc<dyn Algorithm>,
        comm: Arc<Communicator>,
    ) -> Result<ViaAllreduce> {
        let name = name_of(collective).ok_or_else(|| {
            Error::Unsupported(format!("no {collective} algorithm via all-reduce"))
        })?;
        if allreduce.collective() != Collective::AllReduce {
            return Err(Error::InvalidArgument(format!(
                "{name}: {} is not an all-reduce",
                allreduce.name()
            )));
        }
        Ok(ViaAllreduce {
            collective,
            name,
            allreduce,
            comm,
        })
    }

    /// The all-reduce of the output that completes a call (bytes, summed).
    fn allreduce_args(args: &ExecuteArgs, total: usize) -> ExecuteArgs {
        ExecuteArgs {
            input: args.output,
            output: args.output,
            input_bytes: total,
            output_bytes: total,
            dtype: DataType::U8,
            op: ReduceOp::Sum,
            accum: AccumType::Auto,
            ..*args
        }
    }
}

impl Algorithm for ViaAllreduce {
    fn name(&self) -> &str {
        self.name
    }

    fn collective(&self) -> Collective {
        self.collective
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        staging(self.collective, self.comm.rank(), self.comm.size(), args).map(|_| ())
    }

    fn prepare(&self, args: &ExecuteArgs) -> Result<()> {
        let st = staging(self.collective, self.comm.rank(), self.comm.size(), args)?;
        self.allreduce
            .prepare(&Self::allreduce_args(args, st.total))
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        self.comm.check(self.name)?;
        let st = staging(self.collective, self.comm.rank(), self.comm.size(), args)?;
        if st.total == 0 {
            return Ok(());
        }
        let reduce = Self::allreduce_args(args, st.total);
        // The all-reduce's kernels are loaded before anything of the call is enqueued.
        self.allreduce.prepare(&reduce)?;
        let gpu = self.comm.gpu();
        for (offset, len) in st.zero {
            gpu.memset_async(args.output + offset as u64, 0, len, args.stream)?;
        }
        if let Some((offset, len)) = st.copy {
            gpu.memcpy_async(args.output + offset as u64, args.input, len, args.stream)?;
        }
        self.allreduce.execute(&reduce)
    }
}

/// The name of the reduce-scatter through an all-reduce.
pub const REDUCESCATTER_NAME: &str = native_names::REDUCESCATTER_VIA_ALLREDUCE;

/// The reduce-scatter's scratch for a collection built with `scratch_bytes`.
pub fn reducescatter_scratch_bytes(scratch_bytes: usize) -> usize {
    scratch_bytes / 4
}

/// Checks a reduce-scatter call on `nranks` ranks and returns the bytes of each rank's chunk
/// (0: nothing to do). Pure, so it is tested on the CPU.
pub fn reducescatter_chunk(nranks: usize, args: &ExecuteArgs) -> Result<usize> {
    let name = REDUCESCATTER_NAME;
    let count = args.input_count()?;
    resolve_accumulator(args.dtype, args.accum)
        .map_err(|e| Error::Unsupported(format!("{name}: {e}")))?;
    let es = args.dtype.size();
    if args.input_bytes % (nranks.max(1) * es) != 0 {
        return Err(Error::InvalidArgument(format!(
            "{name}: input of {} bytes does not split into {nranks} chunks of whole {} elements",
            args.input_bytes, args.dtype
        )));
    }
    let chunk = args.input_bytes / nranks.max(1);
    if args.output_bytes < chunk {
        return Err(Error::InvalidArgument(format!(
            "{name}: the output holds {} bytes, the call needs {chunk}",
            args.output_bytes
        )));
    }
    if count > 0 && (args.input == 0 || args.output == 0) {
        return Err(Error::InvalidArgument(format!(
            "{name}: null {} pointer",
            if args.input == 0 { "input" } else { "output" }
        )));
    }
    Ok(chunk)
}

/// The segments `(offset, len)` of a chunk of `chunk` bytes through a scratch of `scratch` bytes
/// on `nranks` ranks: whole elements of `elem_bytes`, at most `scratch / nranks` bytes each. An
/// error where the scratch cannot hold one element per rank.
pub fn reducescatter_segments(
    chunk: usize,
    elem_bytes: usize,
    scratch: usize,
    nranks: usize,
) -> Result<Vec<(usize, usize)>> {
    let seg = scratch / nranks.max(1) / elem_bytes * elem_bytes;
    if seg == 0 && chunk > 0 {
        return Err(Error::InvalidArgument(format!(
            "{REDUCESCATTER_NAME}: a scratch of {scratch} bytes holds no {elem_bytes}-byte \
             element per rank of {nranks}"
        )));
    }
    Ok((0..chunk)
        .step_by(seg.max(1))
        .map(|offset| (offset, seg.min(chunk - offset)))
        .collect())
}

/// Reduce-scatter through a multi-host all-reduce. See the module docs.
pub struct ReduceScatterViaAllreduce {
    // Field order is drop order: the all-reduce (which may have registered the scratch with
    // peers) before the scratch.
    allreduce: Arc<dyn Algorithm>,
    scratch: DeviceBuffer,
    scratch_bytes: usize,
    comm: Arc<Communicator>,
}

impl ReduceScatterViaAllreduce {
    /// Over `allreduce`, an all-reduce of `comm`, with a scratch of
    /// [`reducescatter_scratch_bytes`]`(scratch_bytes)`. Allocates (not collective).
    pub fn new(
        allreduce: Arc<dyn Algorithm>,
        comm: Arc<Communicator>,
        scratch_bytes: usize,
    ) -> Result<ReduceScatterViaAllreduce> {
        if allreduce.collective() != Collective::AllReduce {
            return Err(Error::InvalidArgument(format!(
                "{REDUCESCATTER_NAME}: {} is not an all-reduce",
                allreduce.name()
            )));
        }
        let bytes = reducescatter_scratch_bytes(scratch_bytes);
        Ok(ReduceScatterViaAllreduce {
            allreduce,
            scratch: DeviceBuffer::zeroed(comm.gpu(), bytes)?,
            scratch_bytes: bytes,
            comm,
        })
    }

    /// The all-reduce of `len` bytes per rank piece, in place in the scratch.
    fn allreduce_args(&self, args: &ExecuteArgs, len: usize) -> ExecuteArgs {
        let bytes = self.comm.size() * len;
        ExecuteArgs {
            input: self.scratch.ptr(),
            output: self.scratch.ptr(),
            input_bytes: bytes,
            output_bytes: bytes,
            ..*args
        }
    }

    /// The segments of a checked call.
    fn segments(&self, args: &ExecuteArgs) -> Result<Vec<(usize, usize)>> {
        let n = self.comm.size();
        let chunk = reducescatter_chunk(n, args)?;
        reducescatter_segments(chunk, args.dtype.size(), self.scratch_bytes, n)
    }
}

impl Algorithm for ReduceScatterViaAllreduce {
    fn name(&self) -> &str {
        REDUCESCATTER_NAME
    }

    fn collective(&self) -> Collective {
        Collective::ReduceScatter
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        self.segments(args).map(|_| ())
    }

    fn prepare(&self, args: &ExecuteArgs) -> Result<()> {
        // Segments differ in length only at the end: the first and the last cover every shape.
        let segments = self.segments(args)?;
        for &(_, len) in segments.first().into_iter().chain(segments.last()) {
            self.allreduce.prepare(&self.allreduce_args(args, len))?;
        }
        Ok(())
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        self.comm.check(REDUCESCATTER_NAME)?;
        self.prepare(args)?;
        let (rank, n) = (self.comm.rank(), self.comm.size());
        let chunk = args.input_bytes / n;
        let gpu = self.comm.gpu();
        let scratch = self.scratch.ptr();
        for (offset, len) in self.segments(args)? {
            for r in 0..n {
                let from = args.input + (r * chunk + offset) as u64;
                gpu.memcpy_async(scratch + (r * len) as u64, from, len, args.stream)?;
            }
            self.allreduce.execute(&self.allreduce_args(args, len))?;
            let mine = scratch + (rank * len) as u64;
            gpu.memcpy_async(args.output + offset as u64, mine, len, args.stream)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::gpu::Stream;
    use rstest::rstest;

    fn args(input: u64, output: u64, input_bytes: usize, output_bytes: usize) -> ExecuteArgs {
        ExecuteArgs {
            input,
            output,
            input_bytes,
            output_bytes,
            dtype: DataType::Bf16,
            op: ReduceOp::Sum,
            accum: AccumType::Auto,
            root: 1,
            stream: Stream::DEFAULT,
            nblocks: None,
            nthreads: None,
        }
    }

    /// The zeroed ranges and the copy tile the output exactly once (own slot: copied or in place).
    #[rstest]
    #[case(0, 4, false)]
    #[case(2, 4, false)]
    #[case(3, 4, false)]
    #[case(0, 4, true)]
    #[case(2, 4, true)]
    #[case(7, 8, true)]
    fn allgather_tiles_the_output(#[case] rank: usize, #[case] n: usize, #[case] in_place: bool) {
        let c = 6;
        let out = 0x10_000;
        let input = if in_place {
            out + (rank * c) as u64
        } else {
            0x90_000
        };
        let st =
            staging(Collective::AllGather, rank, n, &args(input, out, c, n * c)).expect("valid");
        assert_eq!(st.total, n * c);
        let mut owner = vec![0u8; n * c];
        for (o, l) in &st.zero {
            owner[*o..o + l].iter_mut().for_each(|b| *b += 1);
        }
        if let Some((o, l)) = st.copy {
            assert_eq!((o, l), (rank * c, c));
            owner[o..o + l].iter_mut().for_each(|b| *b += 1);
        }
        for (i, &times) in owner.iter().enumerate() {
            let own = (rank * c..(rank + 1) * c).contains(&i);
            let want = if own && in_place { 0 } else { 1 };
            assert_eq!(times, want, "byte {i}");
        }
    }

    #[test]
    fn broadcast_root_copies_and_others_zero() {
        let a = args(0x100, 0x200, 8, 8);
        let root = staging(Collective::Broadcast, 1, 3, &a).expect("root");
        assert_eq!(
            (root.zero.clone(), root.copy, root.total),
            (vec![], Some((0, 8)), 8)
        );
        let in_place =
            staging(Collective::Broadcast, 1, 3, &args(0x200, 0x200, 8, 8)).expect("root");
        assert_eq!((in_place.zero.clone(), in_place.copy), (vec![], None));
        // A non-root's input may be null: it is not read.
        let other = staging(Collective::Broadcast, 0, 3, &args(0, 0x200, 8, 8)).expect("other");
        assert_eq!((other.zero.clone(), other.copy), (vec![(0, 8)], None));
        let empty = staging(Collective::Broadcast, 0, 3, &args(0, 0, 0, 0)).expect("empty");
        assert_eq!(empty.total, 0);
    }

    /// Segments tile the chunk in whole elements, each at most a rank's share of the scratch.
    #[rstest]
    #[case(0, 2, 1024, 4)]
    #[case(6, 2, 1024, 4)]
    #[case(1000, 4, 1024, 8)]
    #[case(1 << 20, 2, 2 << 20, 8)]
    #[case(7, 1, 3, 2)]
    fn reducescatter_segments_tile_the_chunk(
        #[case] chunk: usize,
        #[case] es: usize,
        #[case] scratch: usize,
        #[case] n: usize,
    ) {
        let segs = reducescatter_segments(chunk, es, scratch, n).expect("fits");
        let mut next = 0;
        for (offset, len) in segs {
            assert_eq!(offset, next);
            assert!(
                len > 0 && len % es == 0 && len * n <= scratch,
                "{offset} {len}"
            );
            next += len;
        }
        assert_eq!(next, chunk);
        let e = reducescatter_segments(8, 8, 15, 2).unwrap_err().to_string();
        assert!(e.contains(REDUCESCATTER_NAME), "{e}");
    }

    #[test]
    fn reducescatter_arguments_are_checked() {
        let rs = |n, a: ExecuteArgs| reducescatter_chunk(n, &a);
        assert_eq!(rs(4, args(1, 2, 64, 16)).ok(), Some(16));
        assert_eq!(rs(4, args(0, 0, 0, 0)).ok(), Some(0));
        let e = rs(4, args(1, 2, 60, 16)).unwrap_err().to_string();
        assert!(e.contains("does not split into 4 chunks"), "{e}");
        let e = rs(4, args(1, 2, 64, 15)).unwrap_err().to_string();
        assert!(e.contains(REDUCESCATTER_NAME) && e.contains("16"), "{e}");
        assert!(rs(4, args(0, 2, 64, 16))
            .unwrap_err()
            .to_string()
            .contains("null input"));
        let mut a = args(1, 2, 64, 16);
        a.accum = AccumType::F16;
        a.dtype = DataType::F32;
        assert!(matches!(rs(4, a), Err(Error::Unsupported(_))));
    }

    #[test]
    fn bad_arguments_are_named() {
        let ag = native_names::ALLGATHER_VIA_ALLREDUCE;
        let bc = native_names::BROADCAST_VIA_ALLREDUCE;
        let e = |c, rank, a: ExecuteArgs| staging(c, rank, 4, &a).unwrap_err().to_string();
        let short = e(Collective::AllGather, 0, args(1, 2, 8, 31));
        assert!(short.contains(ag) && short.contains("32"), "{short}");
        assert!(e(Collective::AllGather, 0, args(0, 2, 8, 32)).contains("null input"));
        assert!(e(Collective::AllGather, 0, args(1, 0, 8, 32)).contains("null output"));
        assert!(e(Collective::AllGather, 0, args(1, 2, 7, 32)).contains("element size"));
        let mut far = args(1, 2, 8, 8);
        far.root = 4;
        let root = e(Collective::Broadcast, 0, far);
        assert!(root.contains(bc) && root.contains("root 4"), "{root}");
        assert!(e(Collective::Broadcast, 1, args(0, 2, 8, 8)).contains("null input"));
        assert!(e(Collective::Broadcast, 0, args(1, 2, 8, 4)).contains(bc));
        assert!(staging(Collective::AllReduce, 0, 4, &args(1, 2, 8, 8)).is_err());
    }
}
