//! `default_sendrecv_p2p`: the shift exchange nccl-tests' `sendrecv` measures (every rank sends its
//! input to rank `(rank + d) % n` and receives from `(rank - d) % n`, `d` = `ExecuteArgs::root`, 1 a
//! ring) as one point-to-point group on the engine: any buffers, nothing registered, one kernel.

use super::{P2pEngine, P2pKind, P2pOp};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::{Error, Result};

/// Name of the shift exchange on the point-to-point engine.
pub const SENDRECV_P2P: &str = "default_sendrecv_p2p";

/// The shift exchange as an [`Algorithm`] over an engine of its own.
pub struct P2pSendRecv {
    engine: P2pEngine,
}

impl P2pSendRecv {
    pub fn new(engine: P2pEngine) -> Self {
        P2pSendRecv { engine }
    }
}

/// The group of `rank` of `n` for a shift by `d` of `bytes` from `input` into `output`.
pub fn shift_group(
    rank: usize,
    n: usize,
    d: usize,
    (input, output): (u64, u64),
    bytes: usize,
) -> [P2pOp; 2] {
    let n = n.max(1);
    [
        P2pOp {
            kind: P2pKind::Send,
            peer: (rank + d) % n,
            ptr: input,
            bytes,
        },
        P2pOp {
            kind: P2pKind::Recv,
            peer: (rank + n - d % n) % n,
            ptr: output,
            bytes,
        },
    ]
}

impl Algorithm for P2pSendRecv {
    fn name(&self) -> &str {
        SENDRECV_P2P
    }

    fn collective(&self) -> Collective {
        Collective::SendRecv
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        let comm = self.engine.comm();
        let rank = comm.rank();
        args.input_count()?;
        if args.output_bytes < args.input_bytes {
            return Err(Error::InvalidArgument(format!(
                "rank {rank}: {SENDRECV_P2P}: the output holds {} bytes, the call needs {}",
                args.output_bytes, args.input_bytes
            )));
        }
        if args.in_place() && args.input_bytes > 0 && args.root % comm.size() != 0 {
            return Err(Error::Unsupported(format!(
                "rank {rank}: {SENDRECV_P2P} in place (the peer's data would overwrite the input \
                 while it is sent)"
            )));
        }
        Ok(())
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        self.check(args)?;
        let comm = self.engine.comm();
        let group = shift_group(
            comm.rank(),
            comm.size(),
            args.root,
            (args.input, args.output),
            args.input_bytes,
        );
        self.engine.run(&group, &args.stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shift_groups_pair_up() {
        for n in 1..=8 {
            for d in [0, 1, 3, 9] {
                let groups: Vec<_> = (0..n).map(|r| shift_group(r, n, d, (1, 2), 5)).collect();
                for (r, g) in groups.iter().enumerate() {
                    let to = g[0].peer;
                    assert_eq!(groups[to][1].peer, r, "n {n} d {d} rank {r}");
                }
            }
        }
        let g = shift_group(0, 4, 1, (10, 20), 8);
        assert_eq!((g[0].peer, g[0].ptr, g[1].peer, g[1].ptr), (1, 10, 3, 20));
    }
}
