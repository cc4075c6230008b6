"""The Torch integration guide's approach 3 (a native kernel), without a C++ toolchain: the kernel
in customized_allgather.cu uses the device library's MemoryChannel, is compiled at run time by
NVRTC, and is wrapped as an Algorithm whose launch is written here. Each size is checked element
by element, eagerly and under torch.cuda.graph.
Run: torchrun --nproc_per_node=N customized_allgather.py"""

import os
import struct

import torch

import mscclpp
import mscclpp.utils as mscclpp_utils
from _common import check, init_comm_group


class CustomizedAllgather:
    def __init__(self, group: mscclpp.CommGroup):
        self.group = group
        here = os.path.dirname(os.path.abspath(__file__))
        self.module = mscclpp.compile_native(
            name="customized_allgather", file=os.path.join(here, "customized_allgather.cu")
        )
        self.channels = {}  # output buffer address -> MemoryChannels over it
        self.algorithm = mscclpp.CustomAlgorithm("customized_allgather", "allgather", self._launch)

    def prepare(self, output: torch.Tensor):
        """Collective: channels over `output` (once per buffer, before any graph capture)."""
        key = (output.data_ptr(), output.nbytes)
        if key not in self.channels:
            self.channels[key] = self.group.communicator.memory_channels(*key)

    def _launch(self, comm, input_buffer, output_buffer, input_size, output_size, dtype, op,
                stream, nblocks, nthreads_per_block, extras):
        channels = self.channels[(output_buffer, output_size)]
        if channels.count == 0:
            return
        self.module.launch(
            "allgather",
            grid=[channels.count],
            block=[nthreads_per_block or 512],
            args=[channels.device_handles, struct.pack("i", comm.rank), input_size],
            stream=stream,
        )

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, stream):
        rank = self.group.my_rank
        output[rank * tensor.numel():(rank + 1) * tensor.numel()].copy_(tensor)
        self.algorithm.execute(
            self.group.communicator,
            tensor.data_ptr(),
            output.data_ptr(),
            tensor.nbytes,
            output.nbytes,
            mscclpp_utils.torch_dtype_to_mscclpp_dtype(tensor.dtype),
            stream=stream.cuda_stream,
        )


def main():
    group = init_comm_group()
    rank, n = group.my_rank, group.nranks
    ag = CustomizedAllgather(group)
    stream = torch.cuda.Stream()
    for count in [1, 1000, 1 << 16, (1 << 20) + 3]:
        gen = torch.Generator().manual_seed(count)
        inputs = [torch.randn(count, generator=gen) for _ in range(n)]
        want = torch.cat(inputs)
        out = torch.full((count * n,), float("nan"), device="cuda")
        x = inputs[rank].cuda()
        ag.prepare(out)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            ag.all_gather(out, x, stream)
        stream.synchronize()
        check(f"eager allgather of {count}", out, want, torch.float32)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            ag.all_gather(out, x, stream)
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        group.barrier()
        with torch.cuda.stream(stream):
            g.replay()
        stream.synchronize()
        check(f"graph allgather of {count}", out, want, torch.float32)
        if rank == 0:
            print(f"allgather of {count} floats: eager and graph correct", flush=True)
    group.barrier()
    if rank == 0:
        print("PASS customized_allgather", flush=True)


if __name__ == "__main__":
    main()
