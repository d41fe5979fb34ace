"""A run's topology: its W ranks on N nodes of W/N GPUs, NVLink inside a node, the network between nodes.

Rank r sits on node ``r // gpus_per_node`` as local rank ``r % gpus_per_node`` (torchrun's order). In a
node the GPUs share NVLink (symmetric memory, peer loads and stores, the copy engine); between nodes
there is only the network: one NIC per GPU, ``network_gbps`` (GB/s) per direction. On one machine (cpu mode, or a
single GPU in shared-gpu mode, or a single node's GPUs in cuda mode) the nodes are *virtual*: pkb keeps
their boundary by making each node a sandbox domain of its own (pkb.runtime.sandbox: its own processes,
files, shared memory and handles) and by refusing the peer-memory calls that span it (pkb.runtime.guards);
traffic between them goes through torch.distributed. docs/topology.md says what is and is not faithful
about virtual nodes.

    >>> t = Topology(world_size=8, num_nodes=2)
    >>> t.gpus_per_node, t.node_of(5), t.local_rank(5), t.intra_node_ranks(1), t.inter_node_ranks(1)
    (4, 1, 1, [4, 5, 6, 7], [1, 5])

Importable without torch (the prompt and the CLI describe a topology); a rank's process groups for it
are pkb.kernels.topology's.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

ENV = "PKB_TOPOLOGY"  # a rank's topology, as JSON (set by pkb for every rank process)
NETWORK_GBPS = 50.0  # GB/s per GPU per direction: one 400 Gb/s (NDR) ConnectX-7 port per GPU, as on H100/H200 HGX nodes


@dataclass(frozen=True)
class Topology:
    world_size: int
    num_nodes: int = 1
    network_gbps: float = NETWORK_GBPS  # per GPU, per direction, GB/s (1e9 bytes/s)
    virtual: bool = True  # the nodes are one machine's parts (no real network between them)

    def __post_init__(self):
        if self.num_nodes < 1 or self.world_size < 1 or self.world_size % self.num_nodes:
            raise ValueError(f"{self.world_size} ranks do not split into {self.num_nodes} nodes of equal size: "
                             "--nodes must divide --world-size")

    @property
    def gpus_per_node(self) -> int:
        return self.world_size // self.num_nodes

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def intra_node_ranks(self, node: int) -> list[int]:
        """The ranks of ``node``: one NVLink domain."""
        return list(range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node))

    def inter_node_ranks(self, local_rank: int) -> list[int]:
        """The ranks with local rank ``local_rank`` on every node: the same GPU of each node, one NIC apart."""
        return [node * self.gpus_per_node + local_rank for node in range(self.num_nodes)]

    def same_node(self, ranks) -> bool:
        """Whether all of ``ranks`` (global ranks) are on one node."""
        return len({self.node_of(rank) for rank in ranks}) <= 1

    def describe(self, nvlink_gbps: float | None = None) -> str:
        """One paragraph for a person or a model."""
        if self.num_nodes == 1:
            return f"{self.world_size} GPUs on one node" + (f", NVLink between them ({nvlink_gbps:g} GB/s per GPU "
                                                            "per direction)" if nvlink_gbps else "") + "."
        link = f" ({nvlink_gbps:g} GB/s per GPU per direction)" if nvlink_gbps else ""
        return (f"{self.world_size} GPUs on {self.num_nodes} nodes of {self.gpus_per_node}: rank r is on node "
                f"r // {self.gpus_per_node}, local rank r % {self.gpus_per_node}. Inside a node the GPUs share "
                f"NVLink{link}: symmetric memory, peer loads and stores, the copy engine. Between nodes there is "
                f"only the network, one NIC per GPU at {self.network_gbps * 8:g} Gb/s ({self.network_gbps:g} GB/s) per "
                "direction: nothing crosses it but through torch.distributed (or NVSHMEM on real nodes); symmetric "
                "memory and peer access across nodes are refused.")

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ=None) -> "Topology | None":
        """The topology pkb gave this rank process, or None outside one."""
        text = (os.environ if environ is None else environ).get(ENV)
        return cls(**json.loads(text)) if text else None
