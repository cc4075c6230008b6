//! A communicator as a front end issuing collectives sees it (the NCCL shim's `ncclComm_t`, the
//! Python package's TorchComms backend): the default native algorithms, the point-to-point engine
//! (on the same resources on one host, through PortChannels across hosts), the choice of an
//! algorithm for one call, and the order of calls that come on different streams. Both front ends
//! map their calls onto [`CommSession::run`] and [`CommSession::run_p2p`], so a collective means
//! the same thing whichever one issued it.

use crate::p2p::{P2pEngine, P2pOp, PointToPoint, PortP2pEngine};
use mscclpp_core::algorithm::{Algorithm, Collective, ExecuteArgs};
use mscclpp_core::algorithm_collection::{
    AlgorithmCollection, AlgorithmCollectionBuilder, SelectionContext,
};
use mscclpp_core::communicator::Communicator;
use mscclpp_core::gpu::{Event, Gpu, Stream};
use mscclpp_core::{Error, Result};
use std::sync::{Arc, Mutex};

/// One rank's communicator with its default algorithms and point-to-point engine.
pub struct CommSession {
    communicator: Arc<Communicator>,
    gpu: Arc<dyn Gpu>,
    algorithms: AlgorithmCollection,
    /// Sends and receives, or why this communicator has none.
    p2p: std::result::Result<PointToPoint, String>,
    /// Compiler architecture of the device, for the selector.
    arch: String,
    /// See [`CommSession::follow_previous`].
    stream_order: Mutex<StreamOrder>,
}

/// The stream of a session's last operation, and the event recorded after it (the last one
/// enqueued outside a capture) that orders the next one after it when it comes on another stream.
#[derive(Default)]
struct StreamOrder {
    last: Option<Stream>,
    event: Option<Event>,
    recorded: bool,
}

impl StreamOrder {
    /// An operation comes on `stream`: the stream it must wait for, the previous operation's,
    /// where that is another.
    fn switch_to(&mut self, stream: Stream) -> Option<Stream> {
        self.last.replace(stream).filter(|&p| p != stream)
    }
}

impl CommSession {
    /// Collective: builds the default algorithms for `communicator` (one scratch of
    /// [`DEFAULT_SCRATCH_BYTES`](crate::DEFAULT_SCRATCH_BYTES) lent to all of them) and a
    /// point-to-point engine: on one host on the same resources (no allocation of its own, so a
    /// communicator stays within its 32 MiB per rank), across hosts a [`PortP2pEngine`] (up to
    /// 4 MiB of slots of its own beside the multi-host collection). A communicator whose engine
    /// cannot be built still runs collectives; its sends and receives fail with the reason.
    pub fn new(communicator: Arc<Communicator>) -> Result<CommSession> {
        Self::with_more_algorithms(communicator, |_| Ok(()))
    }

    /// Collective: as [`new`](Self::new), with `more` adding algorithms (and a selector
    /// preferring them) after the default ones, e.g. the execution plans of a plan directory.
    pub fn with_more_algorithms(
        communicator: Arc<Communicator>,
        more: impl FnOnce(&mut AlgorithmCollectionBuilder) -> Result<()>,
    ) -> Result<CommSession> {
        // Building loads kernels and maps memory on the communicator's device, whichever device
        // the calling thread had current.
        communicator.gpu().set_device(communicator.device())?;
        let (mut builder, resources) = crate::build_default_algorithms_with_resources(
            &communicator,
            crate::DEFAULT_SCRATCH_BYTES,
            AlgorithmCollection::builder(),
        )?;
        more(&mut builder)?;
        let p2p = if communicator.topology().is_single_host() {
            match resources {
                Some(r) => P2pEngine::with_resources(communicator.clone(), r),
                None => P2pEngine::new(communicator.clone()),
            }
            .map(PointToPoint::Mapped)
        } else {
            // Peers' memory is not mapped across hosts: the data goes through the proxy.
            let config = mscclpp_core::port_channel::PortChannelConfig::default();
            PortP2pEngine::new(communicator.clone(), config).map(PointToPoint::Port)
        }
        .map_err(|e| e.to_string());
        let gpu = communicator.gpu().clone();
        let arch = gpu.properties(communicator.device())?.arch;
        Ok(CommSession::assemble(
            communicator,
            builder.build(),
            p2p,
            arch,
        ))
    }

    /// A session without algorithms or engine (they load kernels), for tests of the lifecycle on
    /// a host test GPU: every call fails, saying so.
    pub fn without_algorithms(communicator: Arc<Communicator>) -> CommSession {
        let why = "a communicator without algorithms (tests)".to_string();
        let algorithms = AlgorithmCollection::builder().build();
        CommSession::assemble(communicator, algorithms, Err(why), "test".into())
    }

    fn assemble(
        communicator: Arc<Communicator>,
        algorithms: AlgorithmCollection,
        p2p: std::result::Result<PointToPoint, String>,
        arch: String,
    ) -> CommSession {
        CommSession {
            gpu: communicator.gpu().clone(),
            communicator,
            algorithms,
            p2p,
            arch,
            stream_order: Mutex::new(StreamOrder::default()),
        }
    }

    /// The default algorithms, by name (`AlgorithmCollection::get`).
    pub fn algorithms(&self) -> &AlgorithmCollection {
        &self.algorithms
    }

    pub fn communicator(&self) -> &Arc<Communicator> {
        &self.communicator
    }

    /// Compiler architecture of the device (`sm_90`, `gfx942`; `test` on the host test GPU).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    pub fn rank(&self) -> usize {
        self.communicator.rank()
    }

    pub fn size(&self) -> usize {
        self.communicator.size()
    }

    /// The native algorithm that runs `args` as `collective`, checked against them; the error
    /// says why none does.
    pub fn native(&self, collective: Collective, args: &ExecuteArgs) -> Result<Arc<dyn Algorithm>> {
        self.native_preferring(collective, args, |_| Ok(None))
    }

    /// As [`native`](Self::native), asking `prefer` first: the algorithm it names, if it names
    /// one, runs in place of the selector's choice (the NCCL shim asks the selector a Python
    /// program registered there).
    pub fn native_preferring(
        &self,
        collective: Collective,
        args: &ExecuteArgs,
        prefer: impl FnOnce(&SelectionContext) -> Result<Option<String>>,
    ) -> Result<Arc<dyn Algorithm>> {
        let rank = self.rank();
        self.gpu.set_device(self.communicator.device())?;
        let ctx = SelectionContext {
            collective,
            message_bytes: args.input_bytes,
            dtype: args.dtype,
            world_size: self.size(),
            // Ranks on other hosts (MSCCLPP_HOSTID) take the multi-host branch of the selector.
            local_world_size: self.communicator.topology().local_size(rank),
            symmetric_memory: false,
            capturing: self.gpu.is_capturing(args.stream)?,
            arch: self.arch.clone(),
            // NVLink multicast stays off for callers that make no symmetric-memory promise
            // (DESIGN.md, safety on shared GPUs).
            nvls_allowed: false,
            in_place: SelectionContext::buffers_in_place(collective, args, rank),
            op: Some(args.op),
        };
        match prefer(&ctx)? {
            Some(name) => {
                let algorithm = self.algorithms.chosen(&ctx, &name)?;
                // The program's selector chose it: say so, so that the refusal is read as the
                // selector's mistake, not as a call nothing here can run.
                let said = |why| format!("the selector chose {name}, which cannot take it: {why}");
                algorithm.check(args).map_err(|e| match e {
                    Error::Unsupported(why) => Error::Unsupported(said(why)),
                    Error::InvalidArgument(why) => Error::InvalidArgument(said(why)),
                    other => other,
                })?;
                Ok(algorithm)
            }
            None => {
                let algorithm = self.algorithms.select(&ctx)?;
                algorithm.check(args)?;
                Ok(algorithm)
            }
        }
    }

    /// Selects ([`native`](Self::native)) and runs one collective on `args.stream`.
    pub fn run(&self, collective: Collective, args: &ExecuteArgs) -> Result<()> {
        let algorithm = self.native(collective, args)?;
        self.execute(algorithm.as_ref(), args)
    }

    /// Runs `algorithm` on `args`, after this session's previous operation
    /// ([`follow_previous`](Self::follow_previous)).
    pub fn execute(&self, algorithm: &dyn Algorithm, args: &ExecuteArgs) -> Result<()> {
        self.follow_previous(args.stream)?;
        algorithm.execute(args)?;
        self.enqueued_on(args.stream)
    }

    /// Runs one group of sends and receives on `stream`: every op of the group may be in flight
    /// at once, so a rank may send to and receive from the same peers in one group.
    pub fn run_p2p(&self, ops: &[P2pOp], stream: Stream) -> Result<()> {
        let engine = self.engine()?;
        self.gpu.set_device(self.communicator.device())?;
        self.follow_previous(stream)?;
        engine.run(ops, &stream)?;
        self.enqueued_on(stream)
    }

    /// [`run_p2p`](Self::run_p2p)'s host work, for a caller that must finish it on every rank of
    /// this process before any of them launches.
    pub fn prepare_p2p(&self) -> Result<()> {
        let engine = self.engine()?;
        self.gpu.set_device(self.communicator.device())?;
        engine.prepare()
    }

    fn engine(&self) -> Result<&PointToPoint> {
        self.p2p
            .as_ref()
            .map_err(|why| Error::Unsupported(why.clone()))
    }

    /// Why sends and receives do not run on this communicator, if they do not.
    pub fn p2p_unavailable(&self) -> Option<&str> {
        self.p2p.as_ref().err().map(String::as_str)
    }

    /// The communicator's asynchronous error: a send/recv size mismatch (naming rank and peer)
    /// first, else the core communicator's (an abort, a dead peer, a device wait that gave up).
    pub fn async_error(&self) -> Option<Error> {
        match &self.p2p {
            Ok(engine) => engine.mismatch().map(Error::InvalidArgument),
            Err(_) => None,
        }
        .or_else(|| self.communicator.async_error())
    }

    /// [`async_error`](Self::async_error) as a result, prefixed with `op`, with the cause of a
    /// device wait that gave up named: the first time, the communicator asks the peers over the
    /// bootstrap who is alive and names those that do not answer ([`Communicator::check`];
    /// up to half a second). A stopped peer otherwise shows only as "a semaphore wait timed out"
    /// on the ranks whose kernels timed out before the heartbeat blamed it.
    pub fn check(&self, op: &str) -> Result<()> {
        if let Ok(engine) = &self.p2p {
            if let Some(mismatch) = engine.mismatch() {
                return Err(Error::InvalidArgument(mismatch));
            }
        }
        self.communicator.check(op)
    }

    /// Orders an operation about to be enqueued on `stream` after this session's previous one,
    /// as NCCL does whatever streams they come on: PyTorch issues a synchronous collective on the
    /// caller's current stream and an asynchronous one on a stream of its own, with nothing
    /// between the two, while the collection's algorithms share one scratch, call counter and
    /// semaphores (`CollectionResources`: its calls must be ordered on the device). When the
    /// stream changes, the new one waits for the event recorded after the previous operation
    /// (`enqueued_on`). Nothing is added while the stream stays the same, nor
    /// during CUDA-graph capture (the capture orders its streams itself; an event from outside it
    /// may not be waited on there).
    pub fn follow_previous(&self, stream: Stream) -> Result<()> {
        let mut order = self.stream_order.lock().unwrap_or_else(|e| e.into_inner());
        if order.switch_to(stream).is_none() || !order.recorded {
            return Ok(());
        }
        self.gpu.set_device(self.communicator.device())?;
        match order.event {
            Some(event) if !self.gpu.is_capturing(stream)? => {
                self.gpu.stream_wait_event(stream, event)
            }
            _ => Ok(()),
        }
    }

    /// Records the session's event on `stream` after an operation enqueued there (not during a
    /// capture), for [`follow_previous`](Self::follow_previous). After every operation, not when
    /// the stream changes: by then the previous stream may have been destroyed, and a destroyed
    /// stream must never reach the driver (it may crash there).
    fn enqueued_on(&self, stream: Stream) -> Result<()> {
        if self.gpu.is_capturing(stream)? {
            return Ok(());
        }
        let mut order = self.stream_order.lock().unwrap_or_else(|e| e.into_inner());
        let event = match order.event {
            Some(e) => e,
            None => *order.event.insert(self.gpu.create_event()?),
        };
        self.gpu.record_event(event, stream)?;
        order.recorded = true;
        Ok(())
    }
}

impl Drop for CommSession {
    fn drop(&mut self) {
        let event = self
            .stream_order
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .event
            .take();
        if let Some(event) = event {
            let _ = self.gpu.destroy_event(event);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operation_on_another_stream_waits_for_the_previous_one() {
        let (a, b) = (Stream(0xa), Stream(0xb));
        let mut order = StreamOrder::default();
        assert_eq!(
            order.switch_to(a),
            None,
            "the first operation waits for nothing"
        );
        assert_eq!(order.switch_to(a), None, "the same stream keeps its order");
        assert_eq!(order.switch_to(b), Some(a));
        assert_eq!(order.switch_to(b), None);
        assert_eq!(order.switch_to(a), Some(b));
    }
}
