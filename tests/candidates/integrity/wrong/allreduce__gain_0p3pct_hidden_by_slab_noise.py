"""WRONG: a systematic +0.3 % gain (about 3/4 of a bf16 unit roundoff) hidden under random gains per row slab.

The bias test's standard error is cluster-robust: each tensor is cut into CLUSTERS = 32 slabs along each axis and
the clustering with the largest variance is kept. The candidate knows the slabs (the same integer arithmetic), and
multiplies each row slab by its own random gain (sd 0.7 %, drawn from the output's own values, so the same on
every rank and new every trial) on top of a +0.3 % gain on everything. The slab gains make the cluster-robust
standard error of the gain about 0.7 % / sqrt(32), so 6 standard errors exceed the +0.3 % bias it should catch;
errors are spread over every element (no tail, no shape failure), element-wise within the tolerance, and RMS
within 8x the reference's. Issue 53 asked that no 0.25 % bias get through.
"""
import torch
import torch.distributed as dist

CLUSTERS = 32
BIAS, SPREAD = 0.003, 0.007


def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    x = out.double()
    if x.dim() == 0 or x.numel() < 2:
        return out
    axis = 0 if x.shape[0] >= 2 else x.dim() - 1
    size = x.shape[axis]
    slab = torch.arange(size) * min(CLUSTERS, size) // size
    seed = int(out.float().abs().sum().item() * 1000) % (2 ** 31)
    gains = (torch.rand(min(CLUSTERS, size), generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 - 1) * 3 ** 0.5  # sd 1, bounded
    gain = 1 + BIAS + SPREAD * gains[slab]
    shape = [1] * x.dim()
    shape[axis] = size
    return (x * gain.view(shape)).to(tensor.dtype)
