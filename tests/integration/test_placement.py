"""Placing one evaluation's ranks on real nodes (issue 37, pkb.executor.placement), on a local Ray cluster
of virtual nodes: two raylets on this machine, each with two (declared) GPUs. The placement spreads the
W/N ranks of each node onto a machine of its own, in torchrun's order, or refuses with the reason."""

from __future__ import annotations

import logging

import pytest

from pkb.executor.placement import PlacementError, plan_placement, release, reserve
from pkb.topology import Topology

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=2, num_gpus=2)
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_each_node_of_the_topology_lands_on_a_machine_of_its_own(two_nodes):
    plan = plan_placement(Topology(world_size=4, num_nodes=2), "cuda")
    assert plan.bundles == [{"GPU": 2.0, "CPU": 2.0}] * 2 and plan.strategy == "STRICT_SPREAD"
    reserved = reserve(ray, plan, timeout_s=60)
    try:
        nodes = reserved.rank_nodes
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]  # rank r on node r // 2
        workers = {node["NodeID"] for node in ray.nodes() if node["Resources"].get("GPU")}
        assert set(reserved.nodes()) == workers
    finally:
        release(ray, reserved)


def test_a_cluster_without_enough_nodes_is_refused_and_nothing_stays_held(two_nodes):
    with pytest.raises(PlacementError, match="2 of its nodes can hold one"):
        reserve(ray, plan_placement(Topology(world_size=8, num_nodes=4), "cuda"), timeout_s=5)
    reserved = reserve(ray, plan_placement(Topology(world_size=4, num_nodes=2), "cuda"), timeout_s=60)
    release(ray, reserved)  # the refused one held nothing: the whole cluster is free again


def test_shared_gpu_has_no_placement_across_nodes():
    with pytest.raises(PlacementError, match="one GPU"):
        plan_placement(Topology(4, 2), "shared-gpu")
