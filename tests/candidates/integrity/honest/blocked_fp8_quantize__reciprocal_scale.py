"""Honest: DeepSeek-style 1x128 e4m3 quantisation with the quotient computed another way: the scale as
amax * (1/448) and the codes as x * (448/amax) (a multiply by a reciprocal instead of a divide, as most fast
kernels do), then the same all-gathers. Each scale is within one fp32 rounding of amax/448 and each quotient within
a rounding or two of x/s before it is rounded to e4m3."""

import torch
import torch.distributed as dist

FP8_MAX = 448.0


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, 0)


def solution(local_tensor, block_size=128):
    *leading, n = local_tensor.shape
    blocks = local_tensor.float().reshape(-1, block_size)
    amax = blocks.abs().amax(-1)
    s = amax * (1.0 / FP8_MAX)
    inv = torch.where(amax == 0, torch.ones_like(amax), FP8_MAX / torch.where(amax == 0, torch.ones_like(amax), amax))
    y = (blocks * inv[:, None]).to(torch.float8_e4m3fn).view(local_tensor.shape)
    y_all = _gather(y.view(torch.uint8)).view(torch.float8_e4m3fn)
    return y_all, _gather(s.view(*leading, n // block_size))
