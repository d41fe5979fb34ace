"""Hierarchical Ulysses all-to-all: the step inside a node read straight from the node peers' symmetric
memory (over NVLink), the step between nodes through torch.distributed, rail-aligned.

Per rank: q [S/W, H, D], intra_group, inter_group -> [S, H/W, D] (DeepSpeed's flat _SeqAllToAll's answer).
On a GPU, with G ranks a node and N nodes:
1. each rank lays out its q as [G (destination local rank), S/W, N, H/W, D] in a symmetric buffer of its node;
   after a barrier, local rank g copies slot g of every peer's buffer: the chunks bound for the ranks of
   its own local rank on every node ((G-1)/G of q read over NVLink, no second copy);
2. an all-to-all over the inter-node group sends each node its 1/N ((N-1)/N of q over the network).
Peer memory never spans nodes (pkb refuses it: docs/topology.md). On the CPU (cpu mode) step 1 is an
all-to-all over the intra-node group.
"""

import torch
import torch.distributed as dist

from pkb.kernels import symmetric_buffer

_buffers = {}  # (shape, dtype, device, node group) -> its symmetric buffer (allocation is collective)


def solution(q, intra_group, inter_group):
    local_size, num_nodes = dist.get_world_size(intra_group), dist.get_world_size(inter_group)
    local_rank = dist.get_rank(intra_group)
    seq_local, heads, head_dim = q.shape
    heads_local = heads // (local_size * num_nodes)
    blocks = q.reshape(seq_local, num_nodes, local_size, heads_local, head_dim)
    send = blocks.permute(2, 0, 1, 3, 4)  # [G (destination local rank), s, N, H/W, D]
    if q.is_cuda:
        key = (tuple(send.shape), q.dtype, q.device, intra_group.group_name)
        if key not in _buffers:
            _buffers[key] = symmetric_buffer(tuple(send.shape), q.dtype, q.device, group=intra_group)
        buffer = _buffers[key]
        buffer.local.copy_(send)
        buffer.barrier()
        staged = torch.stack([buffer.peer(peer)[local_rank] for peer in range(local_size)])
        buffer.barrier()  # every peer has read its slot before the next call writes this buffer
    else:
        staged = torch.empty_like(send, memory_format=torch.contiguous_format)
        dist.all_to_all_single(staged, send.contiguous(), group=intra_group)
    across = staged.permute(2, 0, 1, 3, 4).contiguous()  # [N (destination node), G (source), s, H/W, D]
    out = torch.empty_like(across)
    dist.all_to_all_single(out, across, group=inter_group)
    return out.view(local_size * num_nodes * seq_local, heads_local, head_dim)
