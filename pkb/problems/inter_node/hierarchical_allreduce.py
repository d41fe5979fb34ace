"""Hierarchical all-reduce (sum) across nodes: NCCL's tree and NVLS-tree shape, Megatron-LM's and
DeepSpeed's hierarchical data-parallel all-reduce.

Per rank: tensor [*shape], intra_group (the ranks of its node), inter_group (the ranks of its local rank on
every node)  ->  [*shape] = the sum over all W ranks; the input is left unchanged. The reference reduces in
three steps: a reduce-scatter inside each node, an all-reduce of each 1/G shard across the nodes, an
all-gather inside each node (the flattened buffer padded to a multiple of G).

Cost per rank, with S the buffer's bytes, G GPUs per node and N nodes: over NVLink the reduce-scatter and
the all-gather inside the node, 2 (G-1)/G S; over the network only the shard's all-reduce, 2 (N-1)/N S/G
(the least any algorithm sends between nodes: each node must send out and take in, per NIC, its share of
the other nodes' sums). HBM: read S, write S.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pkb.problem import Case, Cost, Problem, reduction_tolerance
from pkb.problems.inter_node._common import (NODES, WORLD_SIZES, buffer, dtype_of, nbytes, node_groups, ring_share,
                                             topology_of)


def make_inputs(case, rank, world_size, gen):
    intra_group, inter_group = node_groups(case, world_size)
    return buffer(case, gen), intra_group, inter_group


def reference(tensor, intra_group, inter_group):
    local_size = dist.get_world_size(intra_group)
    flat = tensor.reshape(-1)
    padded = F.pad(flat, (0, -flat.numel() % local_size))
    shard = padded.new_empty(padded.numel() // local_size)
    dist.reduce_scatter_tensor(shard, padded, group=intra_group)
    dist.all_reduce(shard, group=inter_group)
    gathered = torch.empty_like(padded)
    dist.all_gather_into_tensor(gathered, shard, group=intra_group)
    return gathered[:flat.numel()].view_as(tensor)


def cost(case, world_size):
    topology, size = topology_of(case, world_size), nbytes(case)
    gpus, nodes = topology.gpus_per_node, topology.num_nodes
    return Cost(link_bytes=2 * ring_share(gpus) * size, network_bytes=2 * ring_share(nodes) * size / gpus,
                hbm_bytes=2 * size, pattern="hierarchical_all_reduce")


def tolerance(case, world_size):
    return reduction_tolerance(dtype_of(case), world_size)


PROBLEM = Problem(
    name="hierarchical_allreduce", version=1, upstream_id=None, category="inter_node",
    source="NCCL tree / NVLS-tree all-reduce; Megatron-LM and DeepSpeed hierarchical data-parallel all-reduce",
    world_sizes=WORLD_SIZES, nodes=NODES,
    tests=(Case("odd", {"shape": (3, 683)}, tags=("odd_sizes",)),
           Case("single", {"shape": (1,)}, tags=("tiny",)),
           Case("odd3d", {"shape": (5, 7, 11)}, tags=("odd_sizes", "layout")),
           Case("grads", {"shape": (1024, 1024)}, tags=("shape_regime",),
                note="a whole 2 MiB bf16 gradient bucket: many elements per shard, where the others have few")),
    benchmarks=tuple(Case(f"bf16_{label}", {"shape": (size // 2048, 1024)}, note=f"{label} per rank in bf16")
                     for label, size in (("1MiB", 1 << 20), ("16MiB", 16 << 20), ("256MiB", 256 << 20),
                                         ("1GiB", 1 << 30))),
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, cost=cost,
)
