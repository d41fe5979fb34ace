"""WRONG (timing): honest while judged, an int8-compressed all-reduce while timed.

Timed calls are recognised by the stack (a TimedLoop frame above the call; counting calls per input object would do
as well). There each rank quantises its buffer to int8 with one scale per 64 elements, all-gathers codes and scales
(half the bytes of bf16) and sums the dequantised values: an answer with errors of many ulps, which pkb's accuracy
rule fails at once. But the timed outputs are judged only by the problem's element-wise tolerance
(``check_timed_outputs`` -> ``within_tolerance``: atol = u n (2 + sqrt n), rtol = 4u) and by random projections
with a slack of half the output's norm, and the correctness trials and the after-timing check never see this path.
"""
import sys

import torch
import torch.distributed as dist

BLOCK = 64


def _timed():
    f = sys._getframe(2)
    while f is not None:
        s = f.f_locals.get("self")
        if s is not None and type(s).__name__ == "TimedLoop":
            return True
        f = f.f_back
    return False


def _lossy(tensor):
    world = dist.get_world_size()
    flat = tensor.reshape(-1).float()
    n = flat.numel()
    pad = (-n) % BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    codes = torch.round(blocks / scale).to(torch.int8)
    all_codes = torch.empty((world, *codes.shape), dtype=torch.int8)
    all_scales = torch.empty((world, *scale.shape), dtype=torch.float32)
    dist.all_gather_into_tensor(all_codes, codes)
    dist.all_gather_into_tensor(all_scales, scale)
    total = (all_codes.float() * all_scales).sum(0).reshape(-1)[:n]
    return total.to(tensor.dtype).view(tensor.shape)


def solution(tensor):
    if _timed():
        return _lossy(tensor)
    out = tensor.clone()
    dist.all_reduce(out)
    return out
