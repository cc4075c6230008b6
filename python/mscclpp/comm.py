"""`CommGroup`: a rank's bootstrap and communicator, built the ways MSCCL++ users build it."""

import os
import sys

from . import _mscclpp
from ._teardown import track

_STORE_KEY = "mscclpp_rs_unique_id"


def _current_torch_device():
    """torch's current CUDA device when torch is loaded and has initialised CUDA, else None."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


class CommGroup:
    """One rank of a job: `bootstrap` (TCP rank discovery) and `communicator` (GPU state).

    Exactly one way of finding the other ranks:
      - `interfaceIpPortTrio="eth0:10.0.0.1:50000"` with `rank` and `size` (rank 0 listens there);
      - `mpi_comm`: an mpi4py communicator (rank 0's job id is broadcast over MPI);
      - `torch_group`: a torch.distributed process group, or True for the default group;
      - `store`: a torch.distributed Store, with `rank` and `size`;
      - nothing: MSCCLPP_MASTER_ADDR/PORT (else torchrun's MASTER_ADDR, MASTER_PORT + 1) with
        torchrun's (or mpirun's, Slurm's) rank variables.
    `device` defaults to torch's current device when torch has set one up, else LOCAL_RANK modulo
    the visible GPUs. Creating a CommGroup is collective: every rank of the job must do it.
    """

    def __init__(
        self,
        mpi_comm=None,
        rank=None,
        size=None,
        interfaceIpPortTrio="",
        torch_group=None,
        store=None,
        device=None,
    ):
        ways = [w for w in (mpi_comm, torch_group, store) if w is not None] + (
            [interfaceIpPortTrio] if interfaceIpPortTrio else []
        )
        if len(ways) > 1:
            raise ValueError(
                "CommGroup takes one of mpi_comm, torch_group, store or interfaceIpPortTrio"
            )
        if interfaceIpPortTrio or store is not None:
            if rank is None or size is None:
                raise ValueError("CommGroup needs rank and size with interfaceIpPortTrio or store")
        if interfaceIpPortTrio:
            self.bootstrap = _mscclpp.TcpBootstrap.from_address(interfaceIpPortTrio, rank, size)
        elif mpi_comm is not None:
            rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
            uid = _mscclpp.TcpBootstrap.create_unique_id() if rank == 0 else None
            uid = mpi_comm.bcast(uid, root=0)
            self.bootstrap = _mscclpp.TcpBootstrap.from_unique_id(uid, rank, size)
        elif torch_group is not None:
            self.bootstrap = _from_torch_group(None if torch_group is True else torch_group)
        elif store is not None:
            if rank == 0:
                uid = _mscclpp.TcpBootstrap.create_unique_id()
                store.set(_STORE_KEY, uid)
            else:
                uid = store.get(_STORE_KEY)
            self.bootstrap = _mscclpp.TcpBootstrap.from_unique_id(bytes(uid), rank, size)
        else:
            self.bootstrap = _mscclpp.TcpBootstrap.from_env()
        if device is None:
            device = _current_torch_device()
        self.communicator = _mscclpp.Communicator(self.bootstrap, device)
        track(self)

    @property
    def my_rank(self) -> int:
        return self.bootstrap.rank

    @property
    def nranks(self) -> int:
        return self.bootstrap.size

    @property
    def nranks_per_node(self) -> int:
        """Ranks on this host: the launcher's local world size (LOCAL_WORLD_SIZE under torchrun,
        OMPI_COMM_WORLD_LOCAL_SIZE under mpirun), else every rank."""
        for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
            if os.environ.get(var, "").isdigit():
                return int(os.environ[var])
        return self.nranks

    def barrier(self):
        self.bootstrap.barrier()

    def abort(self, reason: str):
        """Aborts the communicator: its kernels stop waiting and later calls raise `reason`."""
        self.communicator.abort(reason)

    def async_error(self):
        """The device-side error or abort reason of this communicator, or None."""
        return self.communicator.async_error()

    def _close(self):
        self.communicator = None


def _from_torch_group(group):
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    uid = [_mscclpp.TcpBootstrap.create_unique_id() if rank == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(uid, src=src, group=group)
    return _mscclpp.TcpBootstrap.from_unique_id(uid[0], rank, size)
