"""WRONG: 0.8 % of the elements (fixed positions: every 125th) are off by 0.6x the problem's tolerance.

Like a kernel whose tail or bank-conflict path corrupts a few lanes: each bad element is off by
0.6 * (atol + rtol |x|) with a sign drawn from its index (no bias). Element-wise the rule allows the problem's
tolerance; the shape test allows max(1 %, 3x the reference's share) of the elements beyond 8 median errors (plus
Poisson slack), the tail test 5 % beyond 32 scales, and the RMS test a tenth of the tolerance's RMS.
"""
import torch
import torch.distributed as dist


def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    n = dist.get_world_size()
    u = float(torch.finfo(tensor.dtype).eps) / 2
    atol, rtol = u * n * (2 + n ** 0.5), 4 * u
    flat = out.reshape(-1).double()
    idx = torch.arange(flat.numel())
    bad = (idx % 125) == 7
    sign = torch.where((idx * 2654435761 % 97) % 2 == 0, 1.0, -1.0).double()
    flat = torch.where(bad, flat + sign * 0.6 * (atol + rtol * flat.abs()), flat)
    return flat.to(tensor.dtype).view(tensor.shape)
