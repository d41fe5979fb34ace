"""An honest all-to-all through the stock functions torch builds on P2POp, with a sub-group and
functools.partial over isend: identities torch compares must survive pkb's recording."""
import functools

import torch
import torch.distributed as dist


def solution(tensor):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world_size)))
    assert dist.P2POp(dist.isend, tensor[0], (rank + 1) % world_size).op is dist.isend
    send = functools.partial(dist.P2POp, dist.isend)
    out = torch.empty_like(tensor)
    out[rank].copy_(tensor[rank])
    ops = []
    for peer in range(world_size):
        if peer != rank:
            ops.append(send(tensor[peer].contiguous(), group=group, group_peer=peer))
            ops.append(dist.P2POp(dist.irecv, out[peer], group=group, group_peer=peer))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out
