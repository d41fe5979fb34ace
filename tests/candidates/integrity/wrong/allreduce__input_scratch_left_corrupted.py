"""WRONG: uses its input buffer as scratch and leaves 0.8 % of it changed (by half the tolerance) after the call.

The reference leaves its input unchanged; inputs after the call are judged by the same accuracy rule as outputs
(against the exact answer's inputs after the call), so the element-wise tolerance and the shape test's 1 % budget
apply to them too. A caller that reuses its buffer (the gradient it just all-reduced) sees it altered.
"""
import torch
import torch.distributed as dist


def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    n = dist.get_world_size()
    u = float(torch.finfo(tensor.dtype).eps) / 2
    atol, rtol = u * n * (2 + n ** 0.5), 4 * u
    flat = tensor.view(-1)
    idx = torch.arange(flat.numel())
    bad = (idx % 125) == 7
    sign = torch.where((idx * 2654435761 % 97) % 2 == 0, 1.0, -1.0).double()
    x = flat.double()
    flat.copy_(torch.where(bad, x + sign * 0.5 * (atol + rtol * x.abs()), x).to(tensor.dtype))
    return out
