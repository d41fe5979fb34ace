"""Fixtures shared by the test modules, and the tier marks: every test under tests/unit is marked ``unit``
(it starts no process and no server), every test under tests/integration ``integration``."""

from __future__ import annotations

from pathlib import Path

import pytest

from pkb.evaluate.session import Session
from pkb.runtime.modes import Mode

TESTS = Path(__file__).parent
TIERS = {"unit": pytest.mark.unit, "integration": pytest.mark.integration}


def pytest_collection_modifyitems(config, items):
    """Mark each test with the tier of the folder it is in (``-m unit``, ``-m integration``), and run a
    module's tests of one problem one after another (``problem_major``)."""
    for item in items:
        tier = next((folder.name for folder in item.path.parents if folder.parent == TESTS), None)
        if tier in TIERS:
            item.add_marker(TIERS[tier])
    items[:] = problem_major(items)


def problem_major(items: list) -> list:
    """Within each module, the tests parametrized by a ``problem`` grouped by it (in the order each problem
    first appears; other tests keep their places). The module's warm session then loads each reference
    once and judges every candidate of a problem against the reference outputs it kept
    (``pkb.evaluate.session.ReferenceOutputs``), instead of running the reference again per test."""
    def problem_of(item):
        callspec = getattr(item, "callspec", None)
        value = callspec.params.get("problem") if callspec is not None else None
        return getattr(value, "name", None)

    ordered, by_problem = [], {}
    for item in items:
        name = problem_of(item)
        if name is None:
            ordered.append([item])
            continue
        key = (item.module.__name__ if item.module else "", name)
        if key not in by_problem:
            by_problem[key] = []
            ordered.append(by_problem[key])
        by_problem[key].append(item)
    return [item for group in ordered for item in group]


@pytest.fixture(scope="module")
def sessions():
    """``sessions(world_size, mode=Mode.CPU, nodes=1)``: a Session per (mode, world size, nodes), closed after the
    module (an inter-node problem needs one of its nodes: ``nodes=problem.nodes[0]``)."""
    opened: dict[tuple[Mode, int, int], Session] = {}

    def get(world_size: int, mode: Mode = Mode.CPU, nodes: int = 1) -> Session:
        if (mode, world_size, nodes) not in opened:
            opened[(mode, world_size, nodes)] = Session(mode, world_size, nodes=nodes)
        return opened[(mode, world_size, nodes)]

    yield get
    for session in opened.values():
        session.close()


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for a test module (4 logical CPUs and no GPU, on any machine: two cpu-mode
    slots of world size 2), stopped after it so that no other module shares the machine with Ray; the
    executors the tests make connect to it. Skipped where the ``ray`` extra is not installed."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    import logging

    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()
