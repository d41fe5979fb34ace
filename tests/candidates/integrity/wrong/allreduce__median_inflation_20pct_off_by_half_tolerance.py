"""WRONG: every element moved one or two bf16 ulps at random, and 20 % of them moved by 0.5x the tolerance.

The shape test counts elements beyond 8x the tensor's *median* scaled error: moving every element by about one
ulp raises that median (errors of one ulp are 1-2 of an all-reduce's honest scales s), so 8 medians exceed the
problem's whole tolerance and no element counts; the tail test counts only |z| > 32, which tolerance-sized errors
never reach (s ~ u sqrt(sum v^2)); the RMS test allows 8x the reference's RMS, which 20 % of elements off by the
tolerance stay under; signs are random, so the bias and offset fit sees nothing. The rule's "1 % of elements"
budget for large errors is really set by the median the candidate chooses.
"""
import torch
import torch.distributed as dist


def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    n = dist.get_world_size()
    u = float(torch.finfo(tensor.dtype).eps) / 2
    atol, rtol = u * n * (2 + n ** 0.5), 4 * u
    x = out.reshape(-1).double()
    idx = torch.arange(x.numel())
    sign = torch.where((idx * 2654435761 % 1009) % 2 == 0, 1.0, -1.0).double()
    big = (idx * 40503 % 997) < 199  # about 20 %
    ulp = torch.where(x == 0, torch.full_like(x, 2.0 ** -126), x.abs() * 3 * u)  # one or two ulps
    moved = torch.where(big, x + sign * 0.5 * (atol + rtol * x.abs()), x + sign * ulp)
    return moved.to(tensor.dtype).view(tensor.shape)
