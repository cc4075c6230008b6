"""Shared setup of the examples: one CommGroup per torchrun rank, ranks may share a GPU."""

import os

import torch

import mscclpp


def init_comm_group():
    """torchrun's variables plus MSCCLPP_MASTER_ADDR/PORT (else MASTER_ADDR, MASTER_PORT + 1)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    torch.cuda.init()
    return mscclpp.CommGroup()


def check(name, got, want, dtype, inputs=None):
    """Every element: integers exact; floats against the float64 reference `want` within one
    rounding per added term plus the final one, relative to the largest sum of magnitudes
    (`inputs`: the ranks' tensors that were summed; None when nothing was added)."""
    # To the host first: the check needs float64 on the host anyway.
    got, want = got.cpu().double(), want.cpu().double()
    if dtype.is_floating_point:
        eps = torch.finfo(dtype).eps
        if inputs is None:
            scale, terms = want.abs().max().item(), 1
        else:
            scale = torch.stack([x.double().abs() for x in inputs]).sum(0).max().item()
            terms = len(inputs) + 1
        tol = terms * eps * scale
    else:
        tol = 0
    wrong = int(((got - want).abs() > tol).sum())
    if wrong:
        i = int(((got - want).abs() > tol).nonzero()[0])
        raise AssertionError(f"{name}: {wrong} wrong elements, first at {i}: {got[i]} != {want[i]}")
