"""Hierarchical all-reduce: inside a node over symmetric memory (peer reads over NVLink), between nodes only
through torch.distributed, and each byte across the network once per node.

Per rank: tensor [*shape], intra_group, inter_group -> [*shape], the sum over all W ranks. On a GPU, with G
ranks a node and the flat buffer cut into G shards:
1. every rank copies its buffer into a symmetric buffer of its node; after a barrier, local rank j sums
   shard j of all G buffers of its node (peer reads, fp32 accumulation, rounded once);
2. local rank j all-reduces its shard with the local ranks j of the other nodes (the inter-node group:
   each NIC carries 2 (N-1)/N of one shard, the least there is);
3. it writes the result into its own buffer's shard j; after a barrier every rank reads the G shards
   from its node's peers.
Bytes per rank: (G-1)/G of the buffer read from peers twice over NVLink; 2 (N-1)/N S/G over the network.
Peer memory never spans nodes (pkb refuses it: docs/topology.md). On the CPU (cpu mode) the same three
phases run as collectives over the two groups.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pkb.kernels import symmetric_buffer

_buffers = {}  # (elements, dtype, device, node group) -> its symmetric buffer (allocation is collective)


def solution(tensor, intra_group, inter_group):
    local_size = dist.get_world_size(intra_group)
    flat = tensor.reshape(-1)
    shard = -(-flat.numel() // local_size)
    reduce = _with_peers if tensor.is_cuda else _with_collectives
    return reduce(flat, shard, local_size, intra_group, inter_group).view_as(tensor)


def _with_peers(flat, shard, local_size, intra_group, inter_group):
    local_rank = dist.get_rank(intra_group)
    key = (shard * local_size, flat.dtype, flat.device, intra_group.group_name)
    if key not in _buffers:
        _buffers[key] = symmetric_buffer((shard * local_size,), flat.dtype, flat.device, group=intra_group)
    buffer = _buffers[key]
    buffer.local[:flat.numel()].copy_(flat)
    buffer.local[flat.numel():].zero_()
    buffer.barrier()
    mine = slice(local_rank * shard, (local_rank + 1) * shard)
    total = torch.zeros(shard, dtype=torch.float32, device=flat.device)
    for peer in range(local_size):
        total += buffer.peer(peer)[mine].float()
    reduced = total.to(flat.dtype)
    dist.all_reduce(reduced, group=inter_group)
    buffer.barrier()  # every peer has read its shard of this buffer before it is overwritten
    buffer.local[mine].copy_(reduced)
    buffer.barrier()
    out = torch.cat([buffer.peer(peer)[peer * shard:(peer + 1) * shard] for peer in range(local_size)])
    buffer.barrier()  # every peer has read this buffer before the next call writes it
    return out[:flat.numel()]


def _with_collectives(flat, shard, local_size, intra_group, inter_group):
    padded = F.pad(flat.float(), (0, shard * local_size - flat.numel()))
    mine = padded.new_empty(shard)
    dist.reduce_scatter_tensor(mine, padded, group=intra_group)
    reduced = mine.to(flat.dtype)
    dist.all_reduce(reduced, group=inter_group)
    gathered = flat.new_empty(shard * local_size)
    dist.all_gather_into_tensor(gathered, reduced, group=intra_group)
    return gathered[:flat.numel()]
