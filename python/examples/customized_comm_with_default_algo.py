"""The Torch integration guide's approach 1 (default algorithms), checked: all-reduce of random
bf16 tensors from 1 KiB to 4 MiB, eager and under torch.cuda.graph, on a scratch buffer made with
RawGpuBuffer and DLPack. Run: torchrun --nproc_per_node=N customized_comm_with_default_algo.py"""

import torch

import mscclpp
import mscclpp.utils as mscclpp_utils
from _common import check, init_comm_group


class CustomizedComm:
    def __init__(self, comm: mscclpp.CommGroup):
        self.comm = comm
        dlpack = mscclpp.RawGpuBuffer(1 << 27).to_dlpack(data_type=str(torch.float16))
        self.scratch_buffer = torch.utils.dlpack.from_dlpack(dlpack)
        self.algorithms = mscclpp.AlgorithmCollectionBuilder().build_default_algorithms(
            scratch_buffer=self.scratch_buffer.data_ptr(),
            scratch_buffer_size=self.scratch_buffer.nbytes,
            rank=comm.my_rank,
        )

    def all_reduce(self, tensor: torch.Tensor, stream=None):
        stream = stream or torch.cuda.current_stream()
        dtype = mscclpp_utils.torch_dtype_to_mscclpp_dtype(tensor.dtype)
        algo = self.algorithms.select(
            self.comm, "allreduce", tensor.nbytes, dtype, stream=stream.cuda_stream
        )
        algo.execute(
            comm=self.comm.communicator,
            input_buffer=tensor.data_ptr(),
            output_buffer=tensor.data_ptr(),
            input_size=tensor.nbytes,
            output_size=tensor.nbytes,
            dtype=dtype,
            op=mscclpp.ReduceOp.SUM,
            stream=stream.cuda_stream,
        )
        return algo.name


def main():
    comm = CustomizedComm(init_comm_group())
    rank, n = comm.comm.my_rank, comm.comm.nranks
    for size in [1 << k for k in range(10, 23, 2)]:
        count = size // 2
        gen = torch.Generator().manual_seed(size)
        inputs = [torch.randn(count, generator=gen).to(torch.bfloat16) for _ in range(n)]
        want = torch.stack([x.double() for x in inputs]).sum(0)
        x = inputs[rank].cuda()
        name = comm.all_reduce(x)
        torch.cuda.synchronize()
        check(f"eager {name} {size} B", x, want, torch.bfloat16, inputs)
        # Under a CUDA graph: capture once, refill the input, replay.
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.graph(g, stream=s):
            comm.all_reduce(x, stream=s)
        x.copy_(inputs[rank].cuda())
        torch.cuda.synchronize()
        comm.comm.barrier()
        g.replay()
        torch.cuda.synchronize()
        check(f"graph {name} {size} B", x, want, torch.bfloat16, inputs)
        if rank == 0:
            print(f"allreduce {size:>8} B with {name}: eager and graph correct", flush=True)
    comm.comm.barrier()
    if rank == 0:
        print("PASS customized_comm_with_default_algo", flush=True)


if __name__ == "__main__":
    main()
