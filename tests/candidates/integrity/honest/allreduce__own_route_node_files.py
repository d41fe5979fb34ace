"""Honest own route (no stock data movement): every rank writes its buffer to a file in the node's temporary
directory, a barrier, every rank reads all of them and sums in fp32 in rank order (rounded once), a barrier, and
each removes its own file. torch.distributed is used for barriers only, which ``--policy forbid-collectives`` allows:
the file must stay ``ok`` under it."""
import os
import tempfile

import torch
import torch.distributed as dist

_calls = [0]


def solution(tensor):
    _calls[0] += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    path = lambda r: os.path.join(tempfile.gettempdir(), f"pkb-own-{os.getppid()}-{_calls[0]}-{r}.pt")  # noqa: E731
    torch.save(tensor.contiguous(), path(rank) + ".part")
    os.replace(path(rank) + ".part", path(rank))  # whole or absent: a reader never sees half a file
    dist.barrier()
    total = torch.stack([torch.load(path(r)) for r in range(world)]).float().sum(0).to(tensor.dtype)
    dist.barrier()  # every rank has read this rank's file
    os.remove(path(rank))
    return total
