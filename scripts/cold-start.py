"""A Python program's first all-reduce, timed from import (issue 55's target: <= 0.3 s after import
with an empty kernel cache). Each rank prints its times and the kernel cache's entry count, which
stays 0 when every kernel came embedded (NVRTC writes one entry per unit it compiles).

Run with torchrun (copied into .gpu/ by gpu-stage.sh); ranks share the visible GPUs:
  MSCCLPP_CACHE_DIR=$(mktemp -d) PYTHONPATH=/tmp/site torchrun --nproc_per_node=2 .gpu/cold-start.py
"""

import os
import time

start = time.perf_counter()
import torch  # noqa: E402

torch_loaded = time.perf_counter()
import mscclpp  # noqa: E402
import mscclpp.utils as mu  # noqa: E402

imported = time.perf_counter()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
# The CUDA context, which any program pays on its first CUDA call (NCCL's included): timed apart.
torch.empty(1, device="cuda")
torch.cuda.synchronize()
context = time.perf_counter()
group = mscclpp.CommGroup()
algos = mscclpp.AlgorithmCollectionBuilder().build_default_algorithms(rank=group.my_rank)
x = torch.ones(1 << 20, dtype=torch.bfloat16, device="cuda")
dtype, stream = mu.torch_dtype_to_mscclpp_dtype(x.dtype), torch.cuda.current_stream().cuda_stream
torch.cuda.synchronize()
ready = time.perf_counter()
algo = algos.select(group, "allreduce", x.nbytes, dtype, stream=stream)
algo.execute(group.communicator, x.data_ptr(), x.data_ptr(), x.nbytes, x.nbytes, dtype,
             op=mscclpp.ReduceOp.SUM, stream=stream)
torch.cuda.synchronize()
done = time.perf_counter()
assert (x == group.nranks).all()
cache = os.environ.get("MSCCLPP_CACHE_DIR", os.path.expanduser("~/.cache/mscclpp"))
entries = len([f for f in os.listdir(cache) if f.endswith(".kbin")]) if os.path.isdir(cache) else 0
print(f"rank {group.my_rank}: import torch {torch_loaded - start:.2f} s, mscclpp "
      f"{imported - torch_loaded:.2f} s, CUDA context {context - imported:.2f} s, group and "
      f"collection {ready - context:.2f} s, first all-reduce ({algo.name}) {done - ready:.3f} s, "
      f"{done - imported:.2f} s after import ({done - context:.2f} s after the context); "
      f"kernel cache entries {entries}",
      flush=True)
