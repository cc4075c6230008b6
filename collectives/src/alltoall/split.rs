//! Split and displacement math of the all-to-all family, and its validation. Pure (no device), so
//! it is unit-tested on the CPU.
//!
//! A [`Split`] is one side of one rank's exchange: per rank, how many bytes go to (or come from) it
//! and at which byte offset of the local buffer. All-to-all, all-to-all-v, gather and scatter are
//! all a pair of splits per rank (send, receive); an exchange is consistent when every rank's send
//! count to a peer equals that peer's receive count from it ([`check_matrix`]).

use mscclpp_core::algorithm::ExecuteArgs;
use mscclpp_core::{Error, Result};

/// Which buffer a split describes, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Send,
    Recv,
}

impl Side {
    fn buffer(self) -> &'static str {
        match self {
            Side::Send => "send buffer",
            Side::Recv => "receive buffer",
        }
    }
    fn verb(self) -> &'static str {
        match self {
            Side::Send => "sends to",
            Side::Recv => "receives from",
        }
    }
}

/// Per-rank byte counts and byte displacements of one side of one rank's exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    pub counts: Vec<usize>,
    pub displs: Vec<usize>,
}

impl Split {
    /// `bytes` to or from every one of `nranks` ranks, packed in rank order (all-to-all).
    pub fn uniform(nranks: usize, bytes: usize) -> Split {
        Split {
            counts: vec![bytes; nranks],
            displs: (0..nranks).map(|r| r * bytes).collect(),
        }
    }

    /// `bytes` with rank `peer` only (the non-root side of gather and scatter).
    pub fn only(nranks: usize, peer: usize, bytes: usize) -> Split {
        let mut counts = vec![0; nranks];
        counts[peer] = bytes;
        Split {
            counts,
            displs: vec![0; nranks],
        }
    }

    /// The given byte counts packed in rank order (displacements are the prefix sums); an error
    /// names the peer whose displacement overflows.
    pub fn packed(counts: Vec<usize>, rank: usize, side: Side) -> Result<Split> {
        let mut displs = Vec::with_capacity(counts.len());
        let mut at = 0usize;
        for (peer, &c) in counts.iter().enumerate() {
            displs.push(at);
            at = at.checked_add(c).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "rank {rank}: the {} of {c} bytes for peer {peer} ends past the address space",
                    side.buffer()
                ))
            })?;
        }
        Ok(Split { counts, displs })
    }

    /// A split from element counts and element displacements as NCCL-, MPI- and PyTorch-style
    /// callers give them (signed; `displs` `None` packs the counts in rank order). Errors name the
    /// rank and peer: a negative count or displacement, or a byte offset that overflows.
    pub fn from_elements(
        counts: &[i64],
        displs: Option<&[i64]>,
        elem_bytes: usize,
        rank: usize,
        side: Side,
    ) -> Result<Split> {
        let bytes = |what: &str, peer: usize, v: i64| -> Result<usize> {
            let v = usize::try_from(v).map_err(|_| {
                Error::InvalidArgument(format!(
                    "rank {rank}: negative {what} {v} for peer {peer} in the {}",
                    side.buffer()
                ))
            })?;
            v.checked_mul(elem_bytes).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "rank {rank}: {what} {v} for peer {peer} overflows as bytes ({elem_bytes}-byte elements)"
                ))
            })
        };
        let counts = counts
            .iter()
            .enumerate()
            .map(|(p, &c)| bytes("count", p, c))
            .collect::<Result<Vec<_>>>()?;
        match displs {
            None => Split::packed(counts, rank, side),
            Some(d) => {
                if d.len() != counts.len() {
                    return Err(Error::InvalidArgument(format!(
                        "rank {rank}: {} counts but {} displacements for the {}",
                        counts.len(),
                        d.len(),
                        side.buffer()
                    )));
                }
                let displs = d
                    .iter()
                    .enumerate()
                    .map(|(p, &v)| bytes("displacement", p, v))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Split { counts, displs })
            }
        }
    }

    /// Bytes of the buffer the split reaches (the largest end of a non-empty region); an error names
    /// the peer whose region ends past the address space.
    pub fn extent(&self, rank: usize, side: Side) -> Result<usize> {
        let mut extent = 0usize;
        for (peer, (&c, &d)) in self.counts.iter().zip(&self.displs).enumerate() {
            if c == 0 {
                continue;
            }
            let end = d.checked_add(c).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "rank {rank}: the region of peer {peer} in the {} (displacement {d}, {c} \
                     bytes) ends past the address space",
                    side.buffer()
                ))
            })?;
            extent = extent.max(end);
        }
        Ok(extent)
    }

    /// Total bytes sent or received.
    pub fn total(&self) -> usize {
        self.counts.iter().sum()
    }
}

/// Checks one rank's side of an exchange, with what that rank alone knows: both splits have one
/// entry per rank, every region lies inside its buffer (`send_bytes`, `recv_bytes`), no two
/// receive regions overlap (two peers' stores would race), and the self-send sizes agree. Errors
/// name the rank and the peer.
pub fn check_local(
    rank: usize,
    nranks: usize,
    send: &Split,
    send_bytes: usize,
    recv: &Split,
    recv_bytes: usize,
) -> Result<()> {
    for (split, side, size) in [
        (send, Side::Send, send_bytes),
        (recv, Side::Recv, recv_bytes),
    ] {
        if split.counts.len() != nranks || split.displs.len() != nranks {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: the {} has {} counts and {} displacements for {nranks} ranks",
                side.buffer(),
                split.counts.len(),
                split.displs.len()
            )));
        }
        let extent = split.extent(rank, side)?;
        if extent > size {
            let peer = (0..nranks)
                .find(|&p| split.counts[p] > 0 && split.displs[p] + split.counts[p] > size)
                .unwrap_or(0);
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: the region of peer {peer} in the {} (displacement {}, {} bytes) ends \
                 past its {size} bytes",
                side.buffer(),
                split.displs[peer],
                split.counts[peer]
            )));
        }
    }
    let mut regions: Vec<(usize, usize, usize)> = (0..nranks)
        .filter(|&p| recv.counts[p] > 0)
        .map(|p| (recv.displs[p], recv.displs[p] + recv.counts[p], p))
        .collect();
    regions.sort_unstable();
    for w in regions.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: the receive regions of peers {} and {} overlap (bytes {}..{} and \
                 {}..{})",
                w[0].2, w[1].2, w[0].0, w[0].1, w[1].0, w[1].1
            )));
        }
    }
    if send.counts[rank] != recv.counts[rank] {
        return Err(Error::InvalidArgument(format!(
            "rank {rank}: sends {} bytes to itself but expects to receive {}",
            send.counts[rank], recv.counts[rank]
        )));
    }
    Ok(())
}

/// Checks that every rank's send count to each peer equals that peer's receive count from it,
/// given every rank's splits (by rank). The error names both ranks and both counts. Used where
/// all splits are known (the benchmark, and the host check that gathers them).
pub fn check_matrix(sends: &[Split], recvs: &[Split]) -> Result<()> {
    let n = sends.len();
    for (src, send) in sends.iter().enumerate() {
        for dst in 0..n {
            let sent = send.counts.get(dst).copied().unwrap_or(0);
            let expected = recvs
                .get(dst)
                .and_then(|r| r.counts.get(src))
                .copied()
                .unwrap_or(0);
            if sent != expected {
                return Err(Error::InvalidArgument(mismatch_message(
                    src, dst, sent, expected,
                )));
            }
        }
    }
    Ok(())
}

/// Words for a sender `src` and receiver `dst` that disagree: what `src` sends and `dst` expects.
pub fn mismatch_message(src: usize, dst: usize, sent: usize, expected: usize) -> String {
    format!(
        "rank {src} {} rank {dst} {sent} bytes, but rank {dst} {} rank {src} {expected}",
        Side::Send.verb(),
        Side::Recv.verb()
    )
}

/// A skewed traffic matrix in elements, as MoE routing makes it: `m[src][dst]` is what `src` sends
/// to `dst`. Every rank sends `per_rank` elements in all, split over destinations with weights
/// `(1 + (dst - src mod n))^-skew`: 0 is uniform, larger values send more to the nearest ranks
/// (each rank has its own "hot" peers, so receivers are skewed too), and large skews leave far
/// peers at zero. Rounding remainders go to the heaviest destination, so rows sum exactly.
pub fn skewed_matrix(nranks: usize, per_rank: usize, skew: f64) -> Vec<Vec<usize>> {
    let weights: Vec<f64> = (0..nranks)
        .map(|k| (1.0 + k as f64).powf(-skew.max(0.0)))
        .collect();
    let total: f64 = weights.iter().sum();
    (0..nranks)
        .map(|src| {
            let mut row = vec![0usize; nranks];
            let mut given = 0usize;
            for (k, w) in weights.iter().enumerate() {
                let n = ((per_rank as f64) * w / total).floor() as usize;
                row[(src + k) % nranks] = n;
                given += n;
            }
            row[src % nranks.max(1)] += per_rank - given.min(per_rank);
            row
        })
        .collect()
}

/// Rank `rank`'s (send, receive) splits of traffic matrix `m` (elements) with `elem_bytes`-byte
/// elements, both packed in rank order.
pub fn splits_of_matrix(
    m: &[Vec<usize>],
    rank: usize,
    elem_bytes: usize,
) -> Result<(Split, Split)> {
    let send = m[rank].iter().map(|&c| c * elem_bytes).collect();
    let recv = m.iter().map(|row| row[rank] * elem_bytes).collect();
    Ok((
        Split::packed(send, rank, Side::Send)?,
        Split::packed(recv, rank, Side::Recv)?,
    ))
}

/// Bytes of each rank's chunk of a uniform all-to-all (`ExecuteArgs`: the whole send buffer, one
/// equal chunk per rank in whole elements; out of place, or in place: one buffer, as NCCL's
/// `ncclAlltoAll` with `sendbuff == recvbuff`); errors name the algorithm, the rank and the sizes
/// (buffers that overlap other than in place are refused).
pub fn uniform_chunk(name: &str, args: &ExecuteArgs, rank: usize, nranks: usize) -> Result<usize> {
    let count = args.input_count()?;
    if count % nranks.max(1) != 0 {
        return Err(Error::InvalidArgument(format!(
            "rank {rank}: {name}: {count} {} elements do not split into {nranks} \
             equal chunks",
            args.dtype
        )));
    }
    if args.output_bytes < args.input_bytes {
        return Err(Error::InvalidArgument(format!(
            "rank {rank}: {name}: the output holds {} bytes, the call needs {}",
            args.output_bytes, args.input_bytes
        )));
    }
    let overlap = args.input < args.output.saturating_add(args.output_bytes as u64)
        && args.output < args.input.saturating_add(args.input_bytes as u64);
    if overlap && !args.in_place() && args.input_bytes > 0 {
        return Err(Error::Unsupported(format!(
            "rank {rank}: {name} with overlapping send and receive buffers other than in place \
             (send {:#x}, receive {:#x})",
            args.input, args.output
        )));
    }
    Ok(args.input_bytes / nranks.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mscclpp_core::gpu::Stream;
    use mscclpp_core::{AccumType, DataType, ReduceOp};

    fn msg(r: Result<impl std::fmt::Debug>) -> String {
        match r {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn uniform_and_packed_splits() {
        let u = Split::uniform(3, 5);
        assert_eq!(u.counts, vec![5, 5, 5]);
        assert_eq!(u.displs, vec![0, 5, 10]);
        assert_eq!(u.extent(0, Side::Send).unwrap(), 15);
        let p = Split::packed(vec![3, 0, 7], 1, Side::Recv).unwrap();
        assert_eq!(p.displs, vec![0, 3, 3]);
        assert_eq!(p.total(), 10);
        assert_eq!(p.extent(1, Side::Recv).unwrap(), 10);
        let o = Split::only(4, 2, 9);
        assert_eq!(o.counts, vec![0, 0, 9, 0]);
        assert_eq!(o.extent(0, Side::Send).unwrap(), 9);
        // Zero-length peers reach nothing, whatever their displacement.
        let z = Split {
            counts: vec![0, 4],
            displs: vec![usize::MAX, 0],
        };
        assert_eq!(z.extent(0, Side::Send).unwrap(), 4);
    }

    #[test]
    fn element_splits_convert_and_reject_negative_or_overflowing_values() {
        let s = Split::from_elements(&[2, 0, 1], None, 4, 0, Side::Send).unwrap();
        assert_eq!(s.counts, vec![8, 0, 4]);
        assert_eq!(s.displs, vec![0, 8, 8]);
        let s = Split::from_elements(&[1, 1], Some(&[1, 0]), 2, 0, Side::Recv).unwrap();
        assert_eq!(s.displs, vec![2, 0]);
        let m = msg(Split::from_elements(&[1, -1], None, 4, 3, Side::Send));
        assert!(
            m.contains("rank 3") && m.contains("negative count -1 for peer 1"),
            "{m}"
        );
        let m = msg(Split::from_elements(
            &[1, 1],
            Some(&[0, -8]),
            4,
            2,
            Side::Recv,
        ));
        assert!(
            m.contains("rank 2") && m.contains("displacement -8 for peer 1"),
            "{m}"
        );
        let m = msg(Split::from_elements(&[1, i64::MAX], None, 8, 0, Side::Send));
        assert!(m.contains("peer 1") && m.contains("overflows"), "{m}");
        let m = msg(Split::from_elements(&[1, 1], Some(&[0]), 1, 0, Side::Send));
        assert!(m.contains("2 counts but 1 displacements"), "{m}");
        let m = msg(Split::packed(vec![usize::MAX, 1, 1], 5, Side::Send));
        assert!(m.contains("rank 5") && m.contains("peer 1"), "{m}");
        let big = Split {
            counts: vec![1, 16],
            displs: vec![0, usize::MAX - 8],
        };
        let m = msg(big.extent(4, Side::Recv));
        assert!(m.contains("rank 4") && m.contains("peer 1"), "{m}");
    }

    #[test]
    fn local_checks_name_rank_and_peer() {
        let u = Split::uniform(2, 4);
        check_local(0, 2, &u, 8, &u, 8).unwrap();
        check_local(1, 2, &u, 8, &u, 8).unwrap();
        // Buffers too small for a region.
        let m = msg(check_local(1, 2, &u, 7, &u, 8));
        assert!(
            m.contains("rank 1") && m.contains("peer 1") && m.contains("send buffer"),
            "{m}"
        );
        let m = msg(check_local(0, 2, &u, 8, &u, 4));
        assert!(m.contains("peer 1") && m.contains("receive buffer"), "{m}");
        // Wrong number of entries.
        let m = msg(check_local(0, 3, &u, 8, &u, 8));
        assert!(m.contains("2 counts") && m.contains("3 ranks"), "{m}");
        // Self-send mismatch.
        let send = Split::packed(vec![4, 4], 0, Side::Send).unwrap();
        let recv = Split::packed(vec![3, 4], 0, Side::Recv).unwrap();
        let m = msg(check_local(0, 2, &send, 8, &recv, 8));
        assert!(
            m.contains("rank 0: sends 4 bytes to itself but expects to receive 3"),
            "{m}"
        );
        // Overlapping receive regions race.
        let recv = Split {
            counts: vec![4, 4],
            displs: vec![0, 2],
        };
        let m = msg(check_local(0, 2, &send, 8, &recv, 8));
        assert!(m.contains("peers 0 and 1 overlap"), "{m}");
        // Zero-length regions overlap nothing; send regions may overlap (reads only).
        let send = Split {
            counts: vec![4, 4],
            displs: vec![0, 0],
        };
        let recv = Split {
            counts: vec![4, 0],
            displs: vec![0, 0],
        };
        check_local(0, 2, &send, 4, &recv, 4).unwrap();
    }

    #[test]
    fn matrix_check_names_both_ranks() {
        let m = skewed_matrix(3, 10, 1.0);
        let (sends, recvs): (Vec<_>, Vec<_>) =
            (0..3).map(|r| splits_of_matrix(&m, r, 2).unwrap()).unzip();
        check_matrix(&sends, &recvs).unwrap();
        let mut bad = recvs.clone();
        bad[2].counts[0] += 2;
        let e = msg(check_matrix(&sends, &bad));
        assert!(
            e.contains("rank 0 sends to rank 2") && e.contains("rank 2 receives from rank 0"),
            "{e}"
        );
    }

    #[test]
    fn skewed_matrices_keep_row_sums_and_skew() {
        for n in 1..=8 {
            for skew in [0.0, 0.5, 1.0, 3.0, 20.0] {
                for per_rank in [0, 1, 3, 1000, 4099] {
                    let m = skewed_matrix(n, per_rank, skew);
                    for (src, row) in m.iter().enumerate() {
                        assert_eq!(row.iter().sum::<usize>(), per_rank, "n {n} skew {skew}");
                        // The nearest destination (itself) gets the most.
                        assert!(row.iter().all(|&c| c <= row[src]));
                    }
                }
            }
        }
        let uniform = skewed_matrix(4, 400, 0.0);
        assert!(uniform.iter().flatten().all(|&c| c == 100));
        // A large skew leaves far peers at zero (zero-length peers in the exchange).
        let steep = skewed_matrix(8, 100, 20.0);
        assert!(steep[0][7] == 0 && steep[0][0] == 100);
    }

    fn args(input_bytes: usize, output_bytes: usize, dtype: DataType) -> ExecuteArgs {
        ExecuteArgs {
            input: 0x1000,
            output: 0x9000_0000,
            input_bytes,
            output_bytes,
            dtype,
            op: ReduceOp::Sum,
            accum: AccumType::Auto,
            root: 0,
            stream: Stream::DEFAULT,
            nblocks: None,
            nthreads: None,
        }
    }

    #[test]
    fn uniform_chunks_are_whole_elements() {
        assert_eq!(
            uniform_chunk("a2a", &args(64, 64, DataType::F32), 0, 4).unwrap(),
            16
        );
        assert_eq!(
            uniform_chunk("a2a", &args(0, 0, DataType::F32), 0, 4).unwrap(),
            0
        );
        assert_eq!(
            uniform_chunk("a2a", &args(3, 3, DataType::U8), 0, 1).unwrap(),
            3
        );
        let e = uniform_chunk("a2a", &args(12, 12, DataType::F32), 2, 2).unwrap_err();
        assert!(
            e.to_string().contains("rank 2") && e.to_string().contains("3 f32"),
            "{e}"
        );
        let e = uniform_chunk("a2a", &args(16, 8, DataType::U8), 1, 2).unwrap_err();
        assert!(e.to_string().contains("output holds 8 bytes"), "{e}");
        // In place is taken (the algorithms serve it); other overlaps are refused.
        let mut a = args(16, 16, DataType::U8);
        a.output = a.input;
        assert_eq!(uniform_chunk("a2a", &a, 0, 2).unwrap(), 8);
        a.output = a.input + 8;
        assert!(matches!(
            uniform_chunk("a2a", &a, 0, 2),
            Err(Error::Unsupported(_))
        ));
        a.output = a.input + 16;
        assert_eq!(uniform_chunk("a2a", &a, 0, 2).unwrap(), 8, "adjacent");
    }
}
