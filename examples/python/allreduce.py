"""All-reduce of a torch tensor with the mscclpp Python package: the default algorithms, the one
the selector picks for the call, and every element checked.

Run one process per rank (ranks may share a GPU):
    torchrun --nproc_per_node=2 examples/python/allreduce.py
Without torch or a GPU it prints why and exits successfully.
"""

import os
import sys

import mscclpp
import mscclpp.utils


def main():
    try:
        import torch
    except ImportError:
        print("SKIP: torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("SKIP: torch sees no GPU")
        return 0
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    group = mscclpp.CommGroup()  # rank, size and the root's address from torchrun's variables
    algorithms = mscclpp.AlgorithmCollectionBuilder().build_default_algorithms(rank=group.my_rank)

    # Rank r contributes r + 1 in every element: the sum is n (n + 1) / 2 everywhere.
    x = torch.full((1 << 20,), group.my_rank + 1.0, dtype=torch.float32, device="cuda")
    dtype = mscclpp.utils.torch_dtype_to_mscclpp_dtype(x.dtype)
    stream = torch.cuda.current_stream().cuda_stream
    algo = algorithms.select(group, "allreduce", x.nbytes, dtype, stream=stream, in_place=True)
    algo.execute(
        comm=group.communicator,
        input_buffer=x.data_ptr(),
        output_buffer=x.data_ptr(),
        input_size=x.nbytes,
        output_size=x.nbytes,
        dtype=dtype,
        op=mscclpp.ReduceOp.SUM,
        stream=stream,
    )
    torch.cuda.synchronize()
    want = group.nranks * (group.nranks + 1) / 2
    wrong = int((x != want).sum())
    if wrong:
        print(f"rank {group.my_rank}: {algo.name}: {wrong} elements are not {want}", file=sys.stderr)
        return 1
    print(f"rank {group.my_rank}/{group.nranks}: {algo.name} summed {x.numel()} elements correctly")
    group.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
