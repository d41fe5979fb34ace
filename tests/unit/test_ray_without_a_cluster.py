"""``--executor ray`` without a cluster: what a cluster holds (slots per node, never spanning two), the hint
to install Ray, sandbox levels that never share rank processes, and a node that cannot give ``--sandbox
required`` answering ``infra_error`` with its message. ``evaluate`` and ``Session`` are stood in for: no rank
processes. On a local cluster: tests/integration/test_ray.py."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import replace
from pathlib import Path

from helpers.sources import HONEST_ALLREDUCE
from pkb.cli import main
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.executor import Evaluation, LocalExecutor
from pkb.executor.ray_cluster import INSTALL_HINT, slot_resources, slots_on, whole_node
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime.modes import Mode

CONFIG = EvalConfig(world_size=2, mode=Mode.CPU, trials=1, timeout=20.0)


def from_source(name: str, source: str, tmp_path: Path) -> Candidate:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return Candidate.from_file(path)


# -- what a cluster holds, without one -----------------------------------------------------------------


def test_slots_are_counted_per_node_and_a_slot_never_spans_two_nodes():
    nodes = [{"Alive": True, "Resources": {"CPU": 128, "GPU": 8}},
             {"Alive": True, "Resources": {"CPU": 16, "GPU": 3}},
             {"Alive": False, "Resources": {"CPU": 128, "GPU": 8}},  # lost: holds nothing
             {"Alive": True, "Resources": {"CPU": 6}}]
    cuda = lambda w: slot_resources(EvalConfig(world_size=w, mode=Mode.CUDA))  # noqa: E731
    assert cuda(2) == {"num_cpus": 1, "num_gpus": 2}
    assert slots_on(nodes, cuda(2)) == 4 + 1  # 3 GPUs on the second node hold one slot of two, not one and a half
    assert slots_on(nodes, cuda(4)) == 2 and slots_on(nodes, cuda(8)) == 1
    assert slots_on(nodes, slot_resources(EvalConfig(world_size=4, mode=Mode.SHARED_GPU))) == 8 + 3
    assert slots_on(nodes, slot_resources(EvalConfig(world_size=4, mode=Mode.CPU))) == 32 + 4 + 1
    timed = EvalConfig(world_size=2, mode=Mode.CUDA, perf=True)
    assert whole_node(timed) and not whole_node(EvalConfig(world_size=2, mode=Mode.SHARED_GPU, perf=True))
    assert slots_on(nodes, slot_resources(timed), whole=True) == 2  # timed: one evaluation per node, alone there


def test_without_ray_the_flag_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["run", "--problems", "1", "--mode", "cpu", "--executor", "ray", "--db", os.devnull]) == 2
    assert INSTALL_HINT in capsys.readouterr().err
    assert main(["run", "--problems", "1", "--mode", "cpu", "--address", "auto", "--db", os.devnull]) == 2
    assert "--executor ray" in capsys.readouterr().err


# -- sandbox levels, without a cluster -------------------------------------------------------------------


class FakeSession:
    """Stands in for pkb.evaluate.session.Session: remembers what it was built for; ``required`` is
    refused, as on a machine that lacks part of the sandbox."""

    built: list = []

    def __init__(self, mode, world_size, sandbox="auto", broker=None, cpu_threads=None, nodes=1):
        from pkb.runtime.sandbox import SandboxUnavailable

        if sandbox == "required":
            raise SandboxUnavailable("--sandbox required: missing uid-drop (pkb runs as an unprivileged user): "
                                     "start it as root, or use --sandbox auto")
        FakeSession.built.append((mode, world_size, sandbox))

    def close(self) -> None:
        pass


def fake_evaluate(problem, candidate, config, session=None):
    from pkb.evaluate.evaluator import new_result

    return new_result(problem, candidate, config, Status.OK)


def test_evaluations_at_different_sandbox_levels_never_share_rank_processes(monkeypatch):
    import pkb.evaluate.evaluator
    import pkb.evaluate.session
    import pkb.executor.local
    from pkb.executor.ray_cluster import NodeEvaluator, _slot_key
    from pkb import __version__

    problem = get_problem("allreduce")
    levels = ["auto", "off", "auto", "off"]
    monkeypatch.setattr(FakeSession, "built", [])
    monkeypatch.setattr(pkb.executor.local, "Session", FakeSession)
    monkeypatch.setattr(pkb.executor.local, "evaluate", fake_evaluate)
    with LocalExecutor() as executor:
        for level in levels:
            executor.submit(Evaluation(problem, Candidate.reference_of(problem), config=replace(CONFIG, sandbox=level)))
        assert [r.status for _, r in executor.finished()] == [Status.OK] * 4
    assert FakeSession.built == [(Mode.CPU, 2, "auto"), (Mode.CPU, 2, "off")]

    monkeypatch.setattr(FakeSession, "built", [])
    monkeypatch.setattr(pkb.evaluate.session, "Session", FakeSession)
    monkeypatch.setattr(pkb.evaluate.evaluator, "evaluate", fake_evaluate)
    node = NodeEvaluator(__version__)
    for level in levels:
        assert node.evaluate(problem.name, problem.version, Candidate.reference_of(problem),
                             replace(CONFIG, sandbox=level)).ok
    assert FakeSession.built == [(Mode.CPU, 2, "auto"), (Mode.CPU, 2, "off")]
    assert _slot_key(replace(CONFIG, sandbox="off")) != _slot_key(CONFIG)  # a slot's actor serves one level


def test_a_node_that_cannot_give_the_required_sandbox_answers_infra_error_with_its_message(monkeypatch, tmp_path):
    import pkb.evaluate.evaluator
    import pkb.evaluate.session
    from pkb import __version__
    from pkb.executor.ray_cluster import NodeEvaluator

    monkeypatch.setattr(pkb.evaluate.session, "Session", FakeSession)
    monkeypatch.setattr(pkb.evaluate.evaluator, "evaluate", fake_evaluate)
    problem = get_problem("allreduce")
    candidate = from_source("honest_allreduce", HONEST_ALLREDUCE, tmp_path)
    result = NodeEvaluator(__version__).evaluate(problem.name, problem.version, candidate,
                                                 replace(CONFIG, sandbox="required"))  # returns, never raises
    assert result.status is Status.INFRA_ERROR and not result.status.is_verdict  # a rerun evaluates it again
    assert "missing uid-drop (pkb runs as an unprivileged user): start it as root" in result.message
    assert f"node {socket.gethostname()} cannot run candidates with --sandbox required" in result.message
    assert result.details.node == socket.gethostname()
    assert result.details.solution_path == str(candidate.path)  # the driver's file, as in every row
