"""Honest: RoPE computed in fp32 (x*cos + rotate_half(x)*sin with no intermediate rounding to the input dtype; in an
fp32 run, in fp64) and rounded once to the input dtype -- more precise than rounding each product as HF does --
then the same all-gathers along the sequence."""

import torch
import torch.distributed as dist


def _rope(x, cos, sin):
    acc = torch.float64 if x.dtype == torch.float32 else torch.float32
    half = x.shape[-1] // 2
    xf = x.to(acc)
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    out = xf * cos.to(acc)[:, :, None, :] + rotated * sin.to(acc)[:, :, None, :]
    return out.to(x.dtype)


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, 1)


def solution(q_local, k_local, cos_local, sin_local):
    return _gather(_rope(q_local, cos_local, sin_local)), _gather(_rope(k_local, cos_local, sin_local))
