"""An honest hierarchical all-reduce over subgroups of its own (dist.new_group), for hierarchical_allreduce.

Inside a node the ranks share their data through the node's memory: symmetric memory over the node's group on
a GPU, files in the node's temporary directory on the CPU (every rank of a node has the same one). Between
nodes only torch.distributed moves data, and each byte once per node: local rank j sums shard j of its node's
buffers (in fp32, rounded once), all-reduces that shard with the local ranks j of the other nodes, and the
node's ranks then read the G reduced shards. torch.distributed is called only between nodes (and for
barriers), so the file passes --policy forbid-collectives too.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pkb.kernels import symmetric_buffer
from pkb.kernels.topology import current

_groups = {}  # (world size, nodes) -> (this rank's node group, its group across nodes)
_buffers = {}  # (elements, device) -> a symmetric buffer over the node's group
_calls = [0]


def subgroups():
    topology = current()
    key = (topology.world_size, topology.num_nodes)
    if key not in _groups:  # collective: every rank makes every group, in the same order
        nodes = [dist.new_group(topology.intra_node_ranks(node)) for node in range(topology.num_nodes)]
        rails = [dist.new_group(topology.inter_node_ranks(local)) for local in range(topology.gpus_per_node)]
        rank = dist.get_rank()
        _groups[key] = nodes[topology.node_of(rank)], rails[topology.local_rank(rank)]
    return _groups[key]


def solution(tensor, intra_group, inter_group):
    node, rail = subgroups()
    local_size, local = dist.get_world_size(node), dist.get_rank(node)
    flat = tensor.reshape(-1)
    shard = -(-flat.numel() // local_size)
    padded = F.pad(flat.float(), (0, shard * local_size - flat.numel()))
    share = _in_device_memory if tensor.is_cuda else _in_node_files
    reduced = share(padded, shard, local, local_size, node, rail)
    return reduced[:flat.numel()].to(tensor.dtype).view_as(tensor)


def _in_node_files(padded, shard, local, local_size, node, rail):
    _calls[0] += 1
    folder = tempfile.gettempdir()  # the node's: shared by its ranks, private to it
    path = lambda what, j: os.path.join(folder, f"hier-{_calls[0]}-{what}-{j}.pt")  # noqa: E731
    _save(padded, path("in", local))
    dist.barrier(node)
    mine = torch.zeros(shard)
    for j in range(local_size):
        mine += torch.load(path("in", j))[local * shard:(local + 1) * shard]
    dist.all_reduce(mine, group=rail)  # the network leg
    _save(mine, path("out", local))
    dist.barrier(node)
    out = torch.cat([torch.load(path("out", j)) for j in range(local_size)])
    dist.barrier(node)  # every rank has read this rank's files
    os.remove(path("in", local))
    os.remove(path("out", local))
    return out


def _save(tensor, path):
    torch.save(tensor, path + ".part")
    os.replace(path + ".part", path)  # whole or absent: a reader never sees half a file


def _in_device_memory(padded, shard, local, local_size, node, rail):
    key = (padded.numel(), padded.device)
    if key not in _buffers:
        _buffers[key] = symmetric_buffer((padded.numel(),), torch.float32, padded.device, group=node)
    buffer = _buffers[key]
    buffer.local.copy_(padded)
    buffer.barrier()
    mine = torch.zeros(shard, device=padded.device)
    for j in range(local_size):
        mine += buffer.peer(j)[local * shard:(local + 1) * shard]
    dist.all_reduce(mine, group=rail)  # the network leg
    buffer.barrier()  # every peer has read its shard before it is overwritten
    buffer.local[local * shard:(local + 1) * shard].copy_(mine)
    buffer.barrier()
    out = torch.cat([buffer.peer(j)[j * shard:(j + 1) * shard] for j in range(local_size)])
    buffer.barrier()  # every peer has read this buffer before the next call writes it
    return out
