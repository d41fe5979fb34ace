"""Process groups of its own: an all-gather in two steps over subgroups it creates once (pairs of ranks,
then the ranks of equal place in each pair), each ``new_group`` a rendezvous through pkb's store."""

import torch.distributed as dist

EXPECTED = {"cpu": "ok", "shared-gpu": "ok", "cuda": "ok"}
_groups = {}


def _my_groups():
    if not _groups:
        world_size, rank = dist.get_world_size(), dist.get_rank()
        for start in range(0, world_size, 2):  # every rank joins every new_group call, in the same order
            group = dist.new_group([start, start + 1])
            if rank in (start, start + 1):
                _groups["pair"] = group
        for place in (0, 1):
            group = dist.new_group(list(range(place, world_size, 2)))
            if rank % 2 == place:
                _groups["across"] = group
    return _groups["pair"], _groups["across"]


def solution(tensor):
    pair, across = _my_groups()
    world_size, shape = dist.get_world_size(), tuple(tensor.shape)
    pairs = tensor.new_empty((2,) + shape)
    dist.all_gather_into_tensor(pairs, tensor.contiguous(), group=pair)
    out = tensor.new_empty((world_size // 2, 2) + shape)  # [pair j] holds ranks 2j and 2j + 1
    dist.all_gather_into_tensor(out, pairs, group=across)
    return out.reshape((world_size,) + shape)
