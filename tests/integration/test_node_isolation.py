"""Virtual nodes that behave like real ones (issue 48), in cpu mode at W = 4 on 2 nodes (W = 8: ``slow``).

Each file of tests/candidates/node_attacks is a ``hierarchical_allreduce`` candidate that moves the ranks'
data through one channel other than torch.distributed (its prelude says how). Across nodes each channel must
fail, as it would between real nodes: the host channels (files in /dev/shm and the temporary directory,
POSIX shared memory, unix sockets passing a file descriptor, pidfd_getfd, /proc/PID/fd, process_vm_readv) by
the sandbox's node domains, the ways around the peer-memory fence by the fence (``forbidden``). Inside one
node the same channel must still work. Honest inter-node candidates (tests/candidates/inter_node) are ``ok``,
under ``--policy forbid-collectives`` too: torch.distributed between nodes is the network, not a shortcut.
The CUDA channels (legacy IPC handles, torch's own rendezvous reached around the fence) run on a GPU:
benchmarks/node_isolation/run.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.evaluate.session import Session
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime import sandbox
from pkb.runtime.guards import moved_inside_a_node
from pkb.runtime.modes import Mode
from helpers.node_attacks import CUDA_CHANNELS, FENCE_BYPASSES, HONEST, HOST_CHANNELS, node_attack, problem_of

TOPOLOGIES = [(4, 2), pytest.param(8, 2, marks=pytest.mark.slow), pytest.param(8, 4, marks=pytest.mark.slow)]

FULL_NODES = (os.geteuid() == 0 and sandbox.landlock_abi() >= 6
              and all(why is None for why in sandbox._namespaces_offered().values()))
needs_node_domains = pytest.mark.skipif(not FULL_NODES, reason="each node a domain of its own needs root, Landlock "
                                                                "ABI 6 and namespaces (CI has them)")


def _config(world_size: int = 4, nodes: int = 2, **overrides) -> EvalConfig:
    return EvalConfig(**{"world_size": world_size, "nodes": nodes, "mode": Mode.CPU, "trials": 1,
                         "upstream_trials": 1, "timeout": 60.0, **overrides})


def _attack(name: str, scope: str, tmp_path: Path, session: Session):
    candidate = Candidate.from_file(node_attack(name, scope, tmp_path))
    return evaluate(get_problem("hierarchical_allreduce"), candidate, _config(), session)


@needs_node_domains
@pytest.mark.parametrize("name", HOST_CHANNELS)
def test_a_channel_between_nodes_fails_and_the_same_channel_inside_a_node_works(name, tmp_path, sessions):
    across = _attack(name, "world", tmp_path, sessions(4, nodes=2))
    assert across.status in (Status.RUNTIME_ERROR, Status.MISMATCH, Status.TIMEOUT, Status.CRASH), across.message
    assert across.details.sandbox["nodes"] == {"count": 2, "enforced": list(sandbox.NODE_PROTECTIONS), "missing": {}}
    inside = _attack(name, "node", tmp_path, sessions(4, nodes=2))
    assert inside.status is Status.OK, inside.message


@pytest.mark.parametrize("name", FENCE_BYPASSES)
def test_a_way_around_the_fence_is_forbidden_and_the_same_call_inside_a_node_is_not(name, tmp_path, sessions):
    across = _attack(name, "world", tmp_path, sessions(4, nodes=2))
    assert across.status is Status.FORBIDDEN, across.message
    assert "peer memory works within a node only" in across.message and "on nodes [0, 1]" in across.message
    inside = _attack(name, "node", tmp_path, sessions(4, nodes=2))
    assert inside.status is Status.OK, inside.message


@pytest.mark.parametrize("name", CUDA_CHANNELS)
def test_the_cuda_channels_need_a_gpu_and_are_skipped_on_the_cpu(name, tmp_path, sessions):
    result = _attack(name, "world", tmp_path, sessions(4, nodes=2))
    assert result.status is Status.SKIPPED and "cuda" in result.message, result.message


@needs_node_domains
def test_a_node_protection_the_machine_lacks_is_recorded_and_its_channel_then_crosses(tmp_path, monkeypatch):
    """Without its own mount namespace a node shares /dev/shm with the others: the result says so, and the
    channel through /dev/shm gets across (the test above fails on such a machine, as it should)."""
    monkeypatch.setenv("PKB_SANDBOX_SKIP", "node-mount-namespace")
    with Session(Mode.CPU, 4, nodes=2) as session:
        result = _attack("dev_shm_files", "world", tmp_path, session)
    nodes = result.details.sandbox["nodes"]
    assert nodes["missing"] == {"node-mount-namespace": "left out by PKB_SANDBOX_SKIP"}, nodes
    assert "node-landlock" in nodes["enforced"] and result.details.sandbox["full"] is False
    assert result.status is Status.OK, result.message


@pytest.mark.parametrize("world_size, nodes", TOPOLOGIES)
@pytest.mark.parametrize("policy", ["report", "forbid-collectives"])
@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_inter_node_candidates_are_ok_also_when_collectives_are_forbidden(name, policy, world_size, nodes,
                                                                                sessions):
    problem = get_problem(problem_of(name))
    result = evaluate(problem, Candidate.from_file(HONEST[name]), _config(world_size, nodes, policy=policy),
                      sessions(world_size, nodes=nodes))
    assert result.status is Status.OK, result.message
    assert result.collectives_used and not moved_inside_a_node(result.collectives_used), result.collectives_used


def test_forbid_collectives_still_forbids_torch_distributed_inside_a_node(sessions):
    """The reference reduces inside each node with torch.distributed: that stays forbidden; its all-reduce
    across nodes is labelled the network's."""
    problem = get_problem("hierarchical_allreduce")
    result = evaluate(problem, Candidate.reference_of(problem), _config(policy="forbid-collectives"),
                      sessions(4, nodes=2))
    assert result.status is Status.FORBIDDEN, result.message
    assert "dist.reduce_scatter_tensor" in result.message and "dist.all_reduce@network" not in result.message
    assert "dist.all_reduce@network" in result.collectives_used, result.collectives_used
