"""``--policy forbid-collectives`` finds the stock routes that move data inside a node, whichever way a candidate
takes to them, and a candidate cannot hide one (cpu mode; docs/threat-model.md, "Using the stock stack").

Each route is a candidate file in tests/candidates/integrity/wrong/ (its docstring says what it does) that gives the
right answer: ``ok`` without the policy, ``forbidden`` under it, with the route named. An honest candidate that
moves its data itself (files of its node, barriers) stays ``ok`` under the policy, and so does the network leg
between nodes; a network leg that carries one node's data back into it (``@relay``) does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime.guards import SYNC_ONLY, moved_inside_a_node
from pkb.runtime.messages import stock_calls_of
from pkb.runtime.modes import Mode

CANDIDATES = Path(__file__).resolve().parents[1] / "candidates"
WRONG, HONEST = CANDIDATES / "integrity" / "wrong", CANDIDATES / "integrity" / "honest"

# file -> a label the verdict must name (at W = 2 on one node)
ROUTES = {
    "allreduce__policy_route_functional_collective": "functional.all_reduce",
    "allreduce__policy_functional_op_direct": "functional_op.all_reduce",
    "allreduce__policy_route_process_group_method": "ProcessGroup.allreduce",
    "allreduce__policy_route_c10d_op": "c10d_op.allreduce_",
    "allreduce__policy_route_all_gather_into_tensor": "dist.all_gather_into_tensor",
    "allreduce__policy_route_send_recv": "dist.send",
    "allreduce__policy_route_isend_irecv": "dist.isend",
    "allreduce__policy_route_broadcast": "dist.broadcast",
    "allreduce__policy_route_all_to_all_single": "dist.all_to_all_single",
    "allreduce__policy_route_ddp_gradient_allreduce": "c10d.unnamed_route",
    "allreduce__policy_backend_object_allreduce": "Backend.allreduce",
    # the red team's (before this recorder: ok under the policy, collectives_used empty)
    "allreduce__policy_private_gloo_group": "Backend.allreduce",
    "allreduce__policy_data_through_the_tcpstore": "store.set",
    "allreduce__policy_clears_the_recorder": "dist.all_reduce",
    # attacks on the record itself
    "allreduce__policy_floods_the_parent_with_labels": "pkb.too_many_stock_calls",
    # taken where the old recorder did not look: on a thread between calls, while the outputs are read
    "allreduce__policy_stock_call_on_a_thread_after_the_call": "dist.all_reduce",
    "grad_acc_loss__policy_collective_while_the_output_is_read": "dist.all_reduce",
}
HONEST_LIBRARY_ROUTES = {"allreduce__dtensor_partial_to_replicate": "functional_op.all_reduce"}  # ok without the policy


def _evaluate(path: Path, sessions, policy: str = "forbid-collectives", world_size: int = 2, nodes: int = 1,
              problem: str | None = None):
    problem = get_problem(problem or path.stem.split("__")[0])
    config = EvalConfig(world_size=world_size, nodes=nodes, mode=Mode.CPU, trials=1, upstream_trials=1, policy=policy)
    return evaluate(problem, Candidate.from_file(path), config, sessions(world_size, nodes=nodes))


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_every_stock_route_inside_a_node_is_forbidden(name, sessions):
    result = _evaluate(WRONG / f"{name}.py", sessions)
    assert result.status is Status.FORBIDDEN, result.message
    assert ROUTES[name] in result.message, result.message


@pytest.mark.parametrize("name", sorted(HONEST_LIBRARY_ROUTES))
def test_a_library_that_moves_data_through_the_stock_stack_is_forbidden_too(name, sessions):
    """DTensor's redistribution (Partial -> Replicate) is torch's all-reduce: honest, and forbidden by this policy."""
    result = _evaluate(HONEST / f"{name}.py", sessions)
    assert result.status is Status.FORBIDDEN, result.message
    assert HONEST_LIBRARY_ROUTES[name] in result.message, result.message


@pytest.mark.parametrize("name", ["allreduce__policy_private_gloo_group", "allreduce__policy_data_through_the_tcpstore",
                                  "allreduce__policy_route_c10d_op"])
def test_without_the_policy_the_same_files_are_right_and_their_routes_recorded(name, sessions):
    """The routes above are right answers: only the policy fails them, and without it each row still names them."""
    result = _evaluate(WRONG / f"{name}.py", sessions, policy="report")
    assert result.status is Status.OK, result.message
    assert ROUTES[name] in result.collectives_used, result.collectives_used


def test_silencing_the_recorder_is_tampering(sessions):
    result = _evaluate(WRONG / "allreduce__policy_silences_the_recorder.py", sessions, policy="report")
    assert result.status is Status.TAMPERED and "recorder.sink" in result.message, result.message


def test_an_honest_own_route_with_barriers_is_ok_under_the_policy(sessions):
    result = _evaluate(HONEST / "allreduce__own_route_node_files.py", sessions)
    assert result.status is Status.OK, result.message
    assert result.collectives_used and set(result.collectives_used) <= SYNC_ONLY, result.collectives_used


# -- several nodes: the network leg, and what it may not carry -----------------------------------------------------


def test_a_network_leg_that_carries_a_nodes_own_data_back_is_forbidden(sessions):
    """Every group holds one rank per node (each call ``@network``), but rank 1's data reaches rank 0 through a rank
    of the other node: the later call is ``@relay``."""
    result = _evaluate(WRONG / "hierarchical_allreduce__policy_intra_node_data_over_network_groups.py", sessions,
                       world_size=4, nodes=2)
    assert result.status is Status.FORBIDDEN and "dist.all_reduce@relay" in result.message, result.message


def test_a_named_network_call_hides_no_unnamed_move_inside_the_node(sessions):
    result = _evaluate(WRONG / "hierarchical_allreduce__policy_unnamed_intra_hidden_by_named_network_call.py",
                       sessions, world_size=4, nodes=2)
    assert result.status is Status.FORBIDDEN and "Backend.allreduce" in result.message, result.message
    assert "dist.all_reduce@network" in result.collectives_used, result.collectives_used


def test_the_honest_network_leg_over_one_rank_per_node_is_no_relay(sessions):
    """Local rank j all-reduces with the local ranks j of the other nodes only (its rail): ``ok`` under the policy."""
    result = _evaluate(CANDIDATES / "inter_node" / "hierarchical_allreduce_subgroups.py", sessions, world_size=4, nodes=2,
                       problem="hierarchical_allreduce")
    assert result.status is Status.OK, result.message
    assert "dist.all_reduce@network" in result.collectives_used, result.collectives_used
    assert not moved_inside_a_node(result.collectives_used), result.collectives_used


# -- no process needed -------------------------------------------------------------------------------------------


def test_a_relay_is_forbidden_and_the_network_leg_is_not():
    labels = ["dist.all_reduce@network", "dist.all_reduce@relay", "dist.barrier", "store.get", "Backend.allreduce"]
    assert moved_inside_a_node(labels) == ["dist.all_reduce@relay", "store.get", "Backend.allreduce"]


def test_a_note_of_stock_calls_is_told_from_a_reply_and_cannot_smuggle_objects():
    assert stock_calls_of({"stock_calls": ["dist.all_reduce"]}) == ["dist.all_reduce"]
    assert stock_calls_of({"status": "ok", "collectives_used": []}) is None
    assert stock_calls_of({"stock_calls": [object()]}) == ["pkb.malformed_stock_call_note"]
    assert moved_inside_a_node(stock_calls_of({"stock_calls": "x"}))  # malformed: never allowed
