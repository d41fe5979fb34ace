"""WRONG (timing): an int8-compressed all-reduce in every timed repeat but the last, and the honest one elsewhere.

The last repeat's outputs of every input copy are checked element by element; the repeats before it only by random
projections of each output (whose slack is half the output's norm: an int8 answer is far inside it). The repeat is
read off the TimedLoop on the stack (the refresh round it holds) and the protocol (how many repeats there are).
pkb judges the outputs of a few input copies per repeat, chosen after the repeat, by its full accuracy rule against the
exact answer to the same inputs: ``mismatch`` from the first repeat on.
"""
import sys

import torch
import torch.distributed as dist

BLOCK = 64


def _timed():
    frame = sys._getframe(2)
    loop = worker = None
    while frame is not None:
        owner = frame.f_locals.get("self")
        if type(owner).__name__ == "TimedLoop" and frame.f_code.co_name == "repeat":
            loop = owner
        if type(owner).__name__ == "Worker":
            worker = owner
        frame = frame.f_back
    if loop is None:
        return False
    repeats = int((getattr(worker, "protocol", None) or {}).get("num_repeats", 5))
    return loop.round < repeats - 1


def _lossy(tensor):
    world = dist.get_world_size()
    flat = tensor.reshape(-1).float()
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, (-n) % BLOCK)).view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    codes = torch.round(blocks / scale).to(torch.int8)
    all_codes = torch.empty((world, *codes.shape), dtype=torch.int8)
    all_scales = torch.empty((world, *scale.shape), dtype=torch.float32)
    dist.all_gather_into_tensor(all_codes, codes)
    dist.all_gather_into_tensor(all_scales, scale)
    return (all_codes.float() * all_scales).sum(0).reshape(-1)[:n].to(tensor.dtype).view(tensor.shape)


def solution(tensor):
    if _timed():
        return _lossy(tensor)
    out = tensor.clone()
    dist.all_reduce(out)
    return out
