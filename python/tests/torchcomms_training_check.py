"""Training-loop check of the TorchComms backend "mscclpp": a small data-parallel model whose
gradients are all-reduced through the backend ends bitwise equal to the same loop whose gradients
go through torch.distributed's NCCL process group with libmscclpp_nccl.so preloaded. Both reach
the runtime's collectives through the same entry point (`CommSession`), so they must agree to
the bit, not merely within a tolerance.

  torchrun --nproc_per_node=N torchcomms_training_check.py run torchcomms OUT
  LD_PRELOAD=libmscclpp_nccl.so torchrun --nproc_per_node=N torchcomms_training_check.py run dist OUT
  python3 torchcomms_training_check.py compare OUT N

(`python-run.sh torchcomms-train` runs the three.) Each run writes every rank's final parameters
to OUT; `compare` checks every rank's are equal across ranks within a run and between the runs.
"""

import os
import sys

# Deterministic cuBLAS, so the two runs' local arithmetic is the same to the bit.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

STEPS = 12
LR = 0.05


def model(device):
    torch.manual_seed(1234)
    # A 1M-element layer as well as small ones, so the all-reduces span several algorithms.
    return torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    ).to(device)


def train(all_reduce_sum, rank, size, device):
    net = model(device)
    gen = torch.Generator(device="cpu").manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(32, 64, generator=gen).to(device)
        y = torch.randint(0, 10, (32,), generator=gen).to(device)
        net.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for p in net.parameters():
                all_reduce_sum(p.grad)
                p.grad.div_(size)
                p.sub_(LR * p.grad)
    torch.cuda.synchronize()
    return torch.cat([p.detach().flatten() for p in net.parameters()]).cpu()


def run(via, out):
    if not torch.cuda.is_available():
        print("torchcomms_training_check: skipped: no CUDA device visible to torch")
        return 0
    torch.use_deterministic_algorithms(True, warn_only=True)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    if via == "torchcomms":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from torchcomms_support import import_torchcomms

        tc = import_torchcomms()
        comm = tc.new_comm("mscclpp", device, name="training-check")
        rank, size = comm.get_rank(), comm.get_size()
        params = train(lambda g: comm.all_reduce(g, tc.ReduceOp.SUM, False), rank, size, device)
        comm.finalize()
    elif via == "dist":
        with open("/proc/self/maps") as maps:
            if "libmscclpp_nccl" not in maps.read():
                print("torchcomms_training_check: the dist run needs LD_PRELOAD=libmscclpp_nccl.so")
                return 1
        import torch.distributed as dist

        dist.init_process_group("nccl", device_id=device)
        rank, size = dist.get_rank(), dist.get_world_size()
        params = train(lambda g: dist.all_reduce(g), rank, size, device)
        dist.destroy_process_group()
    else:
        print(f"unknown run {via!r}: torchcomms or dist")
        return 2
    os.makedirs(out, exist_ok=True)
    torch.save(params, os.path.join(out, f"{via}-{rank}.pt"))
    print(f"{via} rank {rank}: {params.numel()} parameters after {STEPS} steps")
    return 0


def compare(out, size):
    bad = 0
    runs = {via: [torch.load(os.path.join(out, f"{via}-{r}.pt")) for r in range(size)]
            for via in ("torchcomms", "dist")}
    for via, params in runs.items():
        for r in range(1, size):
            if not torch.equal(params[0].view(torch.int32), params[r].view(torch.int32)):
                print(f"{via}: rank {r}'s parameters differ from rank 0's")
                bad += 1
    for r in range(size):
        a, b = runs["torchcomms"][r], runs["dist"][r]
        same = torch.equal(a.view(torch.int32), b.view(torch.int32))
        if not same:
            diff = (a - b).abs()
            print(f"rank {r}: torchcomms and torch.distributed differ in {(a != b).sum().item()} of "
                  f"{a.numel()} parameters (max |diff| {diff.max().item():.3g})")
            bad += 1
    print("training check: " + ("bitwise equal" if bad == 0 else f"{bad} mismatches"))
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "run":
        sys.exit(run(sys.argv[2], sys.argv[3]))
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], int(sys.argv[3])))
    print(__doc__)
    sys.exit(2)
