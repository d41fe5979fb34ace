"""What the inter-node problems share: the topology a case runs on, its process groups, its buffers, and
the cost of the common phases split into NVLink and network bytes.

A case runs on the run's nodes (``case["nodes"]``, set by the harness; pkb.topology): rank r on node
r // G as local rank r % G, G = W / N GPUs per node. ``node_groups`` gives a rank the intra-node group (its
node: NVLink) and the inter-node group (the ranks of its local rank on every node: one NIC apart), made
once per process by all ranks together; outside a process group (``pkb show``) both are None.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pkb.kernels.topology import node_groups as _node_groups
from pkb.problem import DEFAULT_PRECISION, PRECISIONS, Case, randn
from pkb.topology import Topology

WORLD_SIZES = (4, 8)  # 2 or 4 nodes of at least 2 GPUs
NODES = (2, 4)


def topology_of(case: Case, world_size: int) -> Topology:
    return Topology(world_size, case["nodes"])


def node_groups(case: Case, world_size: int) -> tuple:
    """(intra-node group, inter-node group) of this rank on the case's nodes."""
    return _node_groups(topology_of(case, world_size).num_nodes)


_PARTITIONS: dict[tuple, dict] = {}


def group_of(parts) -> "dist.ProcessGroup | None":
    """This rank's group among ``parts`` (a partition of the world's ranks into groups, each a sequence of global
    ranks), made once per process by all ranks together (``dist.new_group`` is collective: every rank makes
    every group, in order); None outside a process group."""
    if not dist.is_initialized():
        return None
    key = tuple(tuple(part) for part in parts)
    if key not in _PARTITIONS:
        _PARTITIONS[key] = {rank: group for part in key for group in [dist.new_group(list(part))] for rank in part}
    return _PARTITIONS[key].get(dist.get_rank())


def dtype_of(case: Case) -> torch.dtype:
    name = case.get("dtype")
    return getattr(torch, name) if name else PRECISIONS[DEFAULT_PRECISION]


def buffer(case: Case, gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Random N(0, 1) values of ``shape`` (default: the case's) in the run's precision."""
    return randn(gen, *(shape or case["shape"]), dtype=dtype_of(case))


def nbytes(case: Case, *shape: int) -> int:
    return math.prod(shape or case["shape"]) * dtype_of(case).itemsize


def ring_share(num_ranks: int) -> float:
    """(n - 1) / n: the share of a buffer a reduce-scatter or an all-gather over n ranks moves per rank."""
    return (num_ranks - 1) / num_ranks
