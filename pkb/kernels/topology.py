"""The run's topology as a rank sees it (pkb.topology): which node it is on, and process groups for the
intra-node and inter-node dimensions.

    from pkb.kernels.topology import current, node_groups
    topo = current()                       # Topology(world_size=8, num_nodes=2, ...)
    intra, inter = node_groups()           # this rank's node (NVLink), and its peers of equal local rank
                                           # on the other nodes (one NIC apart)

``node_groups`` is collective: every rank calls it, in the same order as its other group creations; the
groups are made once per process. Symmetric memory works over ``intra`` (and any group inside one node);
pkb refuses it over a group that spans nodes.
"""

from __future__ import annotations

import torch.distributed as dist

from pkb.topology import Topology

_GROUPS: dict[tuple[int, int], tuple] = {}


def current() -> Topology:
    """This rank's topology: the one pkb gave its process, else one node of the whole world."""
    return Topology.from_env() or Topology(dist.get_world_size() if dist.is_initialized() else 1)


def node_groups(num_nodes: int | None = None) -> tuple:
    """(intra-node group, inter-node group) of this rank for ``num_nodes`` nodes (default: the run's), made
    once by all ranks together; (None, None) outside a process group (shapes shown without one)."""
    if not dist.is_initialized():
        return None, None
    topology = Topology(dist.get_world_size(), num_nodes or current().num_nodes)
    key = (topology.world_size, topology.num_nodes)
    if key not in _GROUPS:  # dist.new_group is collective: every group, on every rank, in the same order
        intra = [dist.new_group(topology.intra_node_ranks(node)) for node in range(topology.num_nodes)]
        inter = [dist.new_group(topology.inter_node_ranks(local)) for local in range(topology.gpus_per_node)]
        _GROUPS[key] = (intra, inter)
    intra, inter = _GROUPS[key]
    rank = dist.get_rank()
    return intra[topology.node_of(rank)], inter[topology.local_rank(rank)]
