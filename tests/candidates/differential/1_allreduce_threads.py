"""Threads: sixteen per rank copy the input in chunks before the all-reduce (threads count against the
sandbox's process limit, and side by side against the machine's cores)."""

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

EXPECTED = {"cpu": "ok", "shared-gpu": "ok", "cuda": "ok"}
_pool = ThreadPoolExecutor(16)


def solution(tensor):
    flat = tensor.reshape(-1)
    out = torch.cat(list(_pool.map(torch.clone, flat.chunk(16)))) if flat.numel() else flat.clone()
    out = out.view_as(tensor)
    dist.all_reduce(out)
    return out
