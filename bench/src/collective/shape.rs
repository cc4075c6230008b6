//! The shape of one benchmarked call, in nccl-tests' conventions.
//!
//! A size on the command line is the collective's "total" bytes as nccl-tests reports it: the
//! whole buffer for all-reduce, broadcast and reduce, the gathered output for all-gather and
//! gather, the scattered input for reduce-scatter and scatter, each rank's whole send buffer for
//! all-to-all, what each rank sends to the next for sendrecv (nccl-tests' ring exchange). The
//! count column is nccl-tests' too: elements per rank for all-gather and gather (sent) and
//! reduce-scatter and scatter (received), the whole buffer otherwise. Sizes that do not split
//! evenly are rounded down to whole elements per rank, as nccl-tests does. Every rank holds
//! buffers of the root's sizes, as in nccl-tests.
//!
//! The skewed all-to-all-v (`-c alltoallv`, which nccl-tests lacks) sizes like all-to-all, each
//! rank's whole send buffer, split as MoE routing skews an exchange: the runtime's
//! [`skewed_matrix`] with skew [`ALLTOALLV_SKEW`], rank s sending rank s + k (mod n) a share
//! weighted (1 + k)^-2 (at 8 ranks the nearest peer gets 64 times the farthest, and small sizes
//! leave far peers nothing). Every column holds each weight once, so every rank also receives its
//! whole buffer's worth.

use mscclpp_collectives::alltoall::skewed_matrix;
use mscclpp_core::{Collective, DataType, Error, Result};

/// The skew of `-c alltoallv`'s traffic matrix ([`skewed_matrix`]).
pub const ALLTOALLV_SKEW: f64 = 2.0;

/// Buffers and counts of one call on `nranks` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub collective: Collective,
    pub dtype: DataType,
    pub nranks: usize,
    /// The size column (bytes), after rounding.
    pub size_bytes: usize,
    /// The count column (elements).
    pub count: usize,
    /// Elements each rank contributes (all-gather) or receives (reduce-scatter), equal to `count`;
    /// for all-to-all, the elements each rank sends to each rank (`count / nranks`).
    pub per_rank_count: usize,
    pub input_bytes: usize,
    pub output_bytes: usize,
    /// The skewed all-to-all-v (`collective` is all-to-all): see [`Shape::traffic`].
    pub skewed: bool,
}

impl Shape {
    /// The shape for a requested `size` (bytes); `None`-like zero counts are an error the size
    /// sequence skips.
    pub fn new(
        collective: Collective,
        dtype: DataType,
        size: usize,
        nranks: usize,
    ) -> Result<Shape> {
        let e = dtype.size();
        let n = nranks.max(1);
        let (count, input_bytes, output_bytes) = match collective {
            Collective::AllReduce
            | Collective::Broadcast
            | Collective::SendRecv
            | Collective::Reduce => {
                let c = size / e;
                (c, c * e, c * e)
            }
            Collective::AllGather | Collective::Gather => {
                let c = size / e / n;
                (c, c * e, c * e * n)
            }
            Collective::ReduceScatter | Collective::Scatter => {
                let c = size / e / n;
                (c, c * e * n, c * e)
            }
            Collective::AllToAll => {
                let c = size / e / n;
                (c * n, c * e * n, c * e * n)
            }
        };
        let per_rank_count = match collective {
            Collective::AllToAll => count / n,
            _ => count,
        };
        if count == 0 {
            return Err(Error::InvalidArgument(format!(
                "{size} bytes hold no whole {dtype} element per rank for {collective} on {n} ranks"
            )));
        }
        Ok(Shape {
            collective,
            dtype,
            nranks: n,
            size_bytes: input_bytes.max(output_bytes),
            count,
            per_rank_count,
            input_bytes,
            output_bytes,
            skewed: false,
        })
    }

    /// The skewed all-to-all-v's shape (module docs): `size` is each rank's whole send buffer.
    pub fn skewed_alltoallv(dtype: DataType, size: usize, nranks: usize) -> Result<Shape> {
        let n = nranks.max(1);
        let count = size / dtype.size();
        if count == 0 {
            return Err(Error::InvalidArgument(format!(
                "{size} bytes hold no whole {dtype} element for alltoallv"
            )));
        }
        let bytes = count * dtype.size();
        Ok(Shape {
            collective: Collective::AllToAll,
            dtype,
            nranks: n,
            size_bytes: bytes,
            count,
            per_rank_count: count / n,
            input_bytes: bytes,
            output_bytes: bytes,
            skewed: true,
        })
    }

    /// The name of the benchmarked call (`alltoallv` for the skewed shape).
    pub fn name(&self) -> &'static str {
        call_name(self.collective, self.skewed)
    }

    /// The all-to-all's traffic matrix in elements, `[src][dst]`: `per_rank_count` everywhere,
    /// or the skewed split's (module docs). Parts are packed in rank order on both sides.
    pub fn traffic(&self) -> Vec<Vec<usize>> {
        if self.skewed {
            skewed_matrix(self.nranks, self.count, ALLTOALLV_SKEW)
        } else {
            vec![vec![self.per_rank_count; self.nranks]; self.nranks]
        }
    }

    /// Byte offset of this rank's in-place input inside the output (all-gather) or of its
    /// in-place output inside the input (reduce-scatter); 0 otherwise.
    pub fn in_place_offset(&self, rank: usize) -> usize {
        match self.collective {
            Collective::AllGather | Collective::Gather => rank * self.input_bytes,
            Collective::ReduceScatter | Collective::Scatter => rank * self.output_bytes,
            _ => 0,
        }
    }

    /// nccl-tests' algorithm bandwidth: size / time, in GB/s (10^9 bytes per second).
    pub fn algbw(&self, time_us: f64) -> f64 {
        if time_us > 0.0 {
            self.size_bytes as f64 / (time_us * 1e-6) / 1e9
        } else {
            0.0
        }
    }

    /// nccl-tests' bus bandwidth: algbw times [`bus_factor`].
    pub fn busbw(&self, time_us: f64) -> f64 {
        self.algbw(time_us) * bus_factor(self.collective, self.nranks)
    }
}

/// The name a row gives its call: the collective's, or `alltoallv` for the skewed all-to-all-v.
pub fn call_name(collective: Collective, skewed: bool) -> &'static str {
    if skewed {
        "alltoallv"
    } else {
        collective.name()
    }
}

/// nccl-tests' bus-bandwidth factors: all-reduce `2(n-1)/n`; all-gather, reduce-scatter,
/// all-to-all, gather and scatter `(n-1)/n`; broadcast, reduce and sendrecv 1.
pub fn bus_factor(collective: Collective, nranks: usize) -> f64 {
    let n = nranks.max(1) as f64;
    match collective {
        Collective::AllReduce => 2.0 * (n - 1.0) / n,
        Collective::AllGather
        | Collective::ReduceScatter
        | Collective::AllToAll
        | Collective::Gather
        | Collective::Scatter => (n - 1.0) / n,
        _ => 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case(Collective::AllReduce, 2, 2.0 * 1.0 / 2.0)]
    #[case(Collective::AllReduce, 8, 2.0 * 7.0 / 8.0)]
    #[case(Collective::AllGather, 8, 7.0 / 8.0)]
    #[case(Collective::ReduceScatter, 4, 3.0 / 4.0)]
    #[case(Collective::Broadcast, 8, 1.0)]
    #[case(Collective::AllToAll, 4, 3.0 / 4.0)]
    #[case(Collective::SendRecv, 4, 1.0)]
    #[case(Collective::Reduce, 4, 1.0)]
    #[case(Collective::Gather, 4, 3.0 / 4.0)]
    #[case(Collective::Scatter, 8, 7.0 / 8.0)]
    fn bus_factors(#[case] c: Collective, #[case] n: usize, #[case] want: f64) {
        assert!((bus_factor(c, n) - want).abs() < 1e-12);
    }

    #[rstest]
    // size, dtype, n -> (count, input, output, size column)
    #[case(Collective::AllReduce, DataType::F32, 1024, 2, (256, 1024, 1024, 1024))]
    #[case(Collective::AllReduce, DataType::Bf16, 1023, 2, (511, 1022, 1022, 1022))]
    #[case(Collective::AllGather, DataType::F32, 1 << 20, 8, (32768, 131072, 1 << 20, 1 << 20))]
    #[case(Collective::AllGather, DataType::F32, 100, 3, (8, 32, 96, 96))]
    #[case(Collective::ReduceScatter, DataType::U8, 1000, 3, (333, 999, 333, 999))]
    #[case(Collective::Broadcast, DataType::Fp8E4M3, 7, 8, (7, 7, 7, 7))]
    #[case(Collective::AllToAll, DataType::F32, 100, 3, (24, 96, 96, 96))]
    #[case(Collective::SendRecv, DataType::F32, 100, 3, (25, 100, 100, 100))]
    #[case(Collective::Reduce, DataType::F32, 100, 3, (25, 100, 100, 100))]
    #[case(Collective::Gather, DataType::F32, 100, 3, (8, 32, 96, 96))]
    #[case(Collective::Scatter, DataType::U8, 1000, 3, (333, 999, 333, 999))]
    fn shapes_follow_nccl_tests(
        #[case] c: Collective,
        #[case] dtype: DataType,
        #[case] size: usize,
        #[case] n: usize,
        #[case] want: (usize, usize, usize, usize),
    ) {
        let s = Shape::new(c, dtype, size, n).expect("shape");
        assert_eq!((s.count, s.input_bytes, s.output_bytes, s.size_bytes), want);
    }

    #[test]
    fn too_small_and_unsupported() {
        let e = Shape::new(Collective::AllGather, DataType::F32, 4, 2).unwrap_err();
        assert!(e.to_string().contains("4 bytes"), "{e}");
        let e = Shape::new(Collective::AllToAll, DataType::F32, 12, 4).unwrap_err();
        assert!(e.to_string().contains("12 bytes"), "{e}");
    }

    #[test]
    fn the_skewed_split_sends_and_receives_every_buffer_whole() {
        for n in [1, 2, 3, 4, 8] {
            let s = Shape::skewed_alltoallv(DataType::Bf16, 1 << 20, n).expect("shape");
            assert_eq!(
                (s.name(), s.input_bytes, s.output_bytes),
                ("alltoallv", 1 << 20, 1 << 20)
            );
            let m = s.traffic();
            for r in 0..n {
                assert_eq!(m[r].iter().sum::<usize>(), s.count);
                assert_eq!(m.iter().map(|row| row[r]).sum::<usize>(), s.count);
            }
        }
        // At 8 ranks the nearest peer gets 64 times the farthest.
        let m = Shape::skewed_alltoallv(DataType::F32, 1 << 20, 8)
            .expect("shape")
            .traffic();
        assert!(m[3][3] >= 64 * m[3][2] && m[3][2] > 0, "{:?}", m[3]);
        let e = Shape::skewed_alltoallv(DataType::F32, 3, 8).unwrap_err();
        assert!(e.to_string().contains("3 bytes"), "{e}");
    }

    #[test]
    fn bandwidths_and_offsets() {
        let s = Shape::new(Collective::AllReduce, DataType::F32, 1 << 30, 2).expect("shape");
        // 1 GiB in 1 s: 1.073741824 GB/s, busbw the same at 2 ranks.
        assert!((s.algbw(1e6) - 1.073_741_824).abs() < 1e-9);
        assert!((s.busbw(1e6) - 1.073_741_824).abs() < 1e-9);
        let g = Shape::new(Collective::AllGather, DataType::F32, 4096, 4).expect("shape");
        assert_eq!(g.in_place_offset(3), 3 * 1024);
        let r = Shape::new(Collective::ReduceScatter, DataType::F32, 4096, 4).expect("shape");
        assert_eq!(r.in_place_offset(2), 2 * 1024);
    }
}
