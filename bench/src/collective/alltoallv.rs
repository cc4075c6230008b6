//! `-c alltoallv`: the all-to-all engine's all-to-all-v on the skewed split (see [`Shape`]),
//! wrapped as an [`Algorithm`] so that the benchmark times and checks it like any other call.

use super::shape::Shape;
use mscclpp_collectives::alltoall::{splits_of_matrix, AlltoallZeroCopy, Buffer, Split};
use mscclpp_core::{Algorithm, Collective, DataType, Error, ExecuteArgs, Result};
use std::sync::Mutex;

/// The name the rows give it: the engine's all-to-all-v.
pub const SKEWED_ALLTOALLV: &str = "alltoallv_zero_copy";

/// A call's (input bytes, type) and this rank's (send, receive) splits for it.
type KeptSplits = ((usize, DataType), Split, Split);

/// The skewed all-to-all-v of one rank.
pub struct SkewedAlltoallv {
    engine: AlltoallZeroCopy,
    /// The splits of the last call: a timed loop repeats one call.
    splits: Mutex<Option<KeptSplits>>,
}

impl SkewedAlltoallv {
    pub fn new(engine: AlltoallZeroCopy) -> Self {
        SkewedAlltoallv {
            engine,
            splits: Mutex::new(None),
        }
    }

    fn shape(&self, args: &ExecuteArgs) -> Result<Shape> {
        let shape =
            Shape::skewed_alltoallv(args.dtype, args.input_bytes, self.engine.comm().size())?;
        if shape.input_bytes != args.input_bytes || args.output_bytes < shape.output_bytes {
            return Err(Error::InvalidArgument(format!(
                "{SKEWED_ALLTOALLV}: {} input and {} output bytes are not a skewed all-to-all-v \
                 of whole {} elements",
                args.input_bytes, args.output_bytes, args.dtype
            )));
        }
        Ok(shape)
    }
}

impl Algorithm for SkewedAlltoallv {
    fn name(&self) -> &str {
        SKEWED_ALLTOALLV
    }

    fn collective(&self) -> Collective {
        Collective::AllToAll
    }

    fn check(&self, args: &ExecuteArgs) -> Result<()> {
        self.shape(args).map(|_| ())
    }

    fn execute(&self, args: &ExecuteArgs) -> Result<()> {
        let key = (args.input_bytes, args.dtype);
        let mut splits = self
            .splits
            .lock()
            .map_err(|_| Error::Internal("the all-to-all-v splits' lock is poisoned".into()))?;
        if !matches!(splits.as_ref(), Some((k, ..)) if *k == key) {
            let shape = self.shape(args)?;
            let rank = self.engine.comm().rank();
            let (send, recv) = splits_of_matrix(&shape.traffic(), rank, args.dtype.size())?;
            *splits = Some((key, send, recv));
        }
        let Some((_, send, recv)) = splits.as_ref() else {
            return Err(Error::Internal(
                "the all-to-all-v splits were not kept".into(),
            ));
        };
        self.engine.alltoallv(
            Buffer {
                ptr: args.input,
                bytes: args.input_bytes,
            },
            Buffer {
                ptr: args.output,
                bytes: args.output_bytes,
            },
            send,
            recv,
            args.stream,
            args.nblocks,
            args.nthreads,
        )
    }
}
