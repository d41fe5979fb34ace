"""Where one evaluation's ranks go on a cluster of real nodes: a Ray placement group of N bundles, one per
node (``STRICT_SPREAD``), each with the GPUs (or, in cpu mode, the CPUs) of its W/N ranks; rank r runs in
bundle r // (W/N), on the node its bundle landed on: the run's topology (pkb.topology) laid on machines.

    >>> plan = plan_placement(Topology(world_size=8, num_nodes=2), "cuda")
    >>> plan.bundles, plan.strategy, plan.bundle_of(5)
    ([{'GPU': 4.0, 'CPU': 4.0}, {'GPU': 4.0, 'CPU': 4.0}], 'STRICT_SPREAD', 1)

``reserve`` asks the cluster for it and says, for each rank, which node holds it; a cluster without N
nodes that can each hold a bundle is refused with the reason, never half placed. Launching an evaluation's
ranks across the nodes so reserved is not done yet (docs/topology.md, "Real nodes"): today an evaluation
runs on one node.
"""

from __future__ import annotations

from dataclasses import dataclass

from pkb.topology import Topology

STRATEGY = "STRICT_SPREAD"  # every bundle on a node of its own: a node of the topology is a machine


class PlacementError(RuntimeError):
    """The cluster cannot hold the placement (too few nodes, or nodes too small); the message says why."""


@dataclass(frozen=True)
class PlacementPlan:
    topology: Topology
    bundles: list[dict[str, float]]
    strategy: str = STRATEGY

    def bundle_of(self, rank: int) -> int:
        return self.topology.node_of(rank)


def plan_placement(topology: Topology, mode: str, cpus_per_rank: float = 1.0) -> PlacementPlan:
    """The bundles for ``topology`` in ``mode`` (``cuda``: a GPU and ``cpus_per_rank`` CPUs a rank; ``cpu``:
    the CPUs alone). ``shared-gpu`` runs on one GPU and so on one node: it has no placement across nodes."""
    if mode == "shared-gpu":
        raise PlacementError("shared-gpu mode runs every rank on one GPU: its nodes are virtual, on one machine")
    ranks = topology.gpus_per_node
    bundle = {"GPU": float(ranks), "CPU": cpus_per_rank * ranks} if mode == "cuda" else {"CPU": cpus_per_rank * ranks}
    return PlacementPlan(topology, [dict(bundle) for _ in range(topology.num_nodes)])


@dataclass(frozen=True)
class Reserved:
    """A placement the cluster holds: the Ray placement group, and the node of each rank."""

    group: object
    rank_nodes: list[str]  # rank -> the Ray node id that holds it

    def nodes(self) -> list[str]:
        return list(dict.fromkeys(self.rank_nodes))


def reserve(ray, plan: PlacementPlan, timeout_s: float = 60.0) -> Reserved:
    """Reserve ``plan`` on the connected cluster; PlacementError (and nothing held) where it cannot be."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    group = placement_group(plan.bundles, strategy=plan.strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        fit = [node for node in ray.nodes() if node.get("Alive") and all(
            node.get("Resources", {}).get(name, 0) >= amount for name, amount in plan.bundles[0].items())]
        raise PlacementError(f"the cluster cannot place {plan.topology.num_nodes} nodes of {plan.bundles[0]} on "
                             f"nodes of their own: {len(fit)} of its nodes can hold one (add nodes, or run on "
                             "virtual nodes on one)")
    bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
    return Reserved(group, [bundle_nodes[plan.bundle_of(rank)] for rank in range(plan.topology.world_size)])


def release(ray, reserved: Reserved) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(reserved.group)
