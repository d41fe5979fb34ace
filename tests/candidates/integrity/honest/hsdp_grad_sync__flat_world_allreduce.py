"""Honest: HSDP's two collectives done the plain way: each parameter's shard cast to the parameter dtype and
all-gathered inside the node with all_gather (uneven shards padded to torch.chunk's size, then cut), and each
gradient cast to fp32, all-reduced over the whole world in fp32 (one flat all-reduce instead of an intra-node
reduce-scatter plus an inter-node all-reduce), divided by the world size, and this local rank's rows kept. Same fp32
sums in another order; exact data movement for the parameters."""

import torch
import torch.distributed as dist


def solution(unsharded_grads, param_shards, shard_group, replicate_group):
    local_size = dist.get_world_size(shard_group)
    local_rank = dist.get_rank(shard_group)
    world = dist.get_world_size()
    param_dtype = unsharded_grads[0].dtype
    params, grads = [], []
    for grad, shard in zip(unsharded_grads, param_shards):
        rows = grad.shape[0]
        c = -(-rows // local_size)
        send = torch.zeros((c, *grad.shape[1:]), dtype=param_dtype)
        send[:shard.shape[0]] = shard.to(param_dtype)
        parts = [torch.empty_like(send) for _ in range(local_size)]
        dist.all_gather(parts, send, group=shard_group)
        params.append(torch.cat(parts)[:rows].clone())
        total = grad.float().clone()
        dist.all_reduce(total)
        total /= world
        start = min(local_rank * c, rows)
        length = min(c, rows - start)
        grads.append(total[start:start + length].clone())
    return params, grads
