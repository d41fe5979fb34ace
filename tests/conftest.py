"""Fixtures shared by the test modules, and the tier marks: every test under tests/unit is marked ``unit``
(it starts no process and no server), every test under tests/integration ``integration``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pkb.evaluate.session import ReferenceOutputs, Session
from pkb.runtime.modes import Mode

TESTS = Path(__file__).parent
RAY_MODULES = ("test_ray",)  # it starts local Ray clusters
TIERS = {"unit": pytest.mark.unit, "integration": pytest.mark.integration}


def pytest_collection_modifyitems(config, items):
    """Mark each test with the tier of the folder it is in (``-m unit``, ``-m integration``), and run the tests
    of one problem one after another (``problem_major``)."""
    for item in items:
        tier = next((folder.name for folder in item.path.parents if folder.parent == TESTS), None)
        if tier in TIERS:
            item.add_marker(TIERS[tier])
    items[:] = problem_major(items)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(worker_group(item)))


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the run's own process (with -n, xdist's controller), not a worker
        config.pluginmanager.register(FailuresAsTheyHappen(config), "pkb-failures-as-they-happen")


class FailuresAsTheyHappen:
    """A line naming each failed test as it fails, not only in the summary at the end: a run that is stopped
    (a CI limit, a Ctrl-C, a lost worker) still says which tests failed before it."""

    def __init__(self, config):
        self.config = config
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report):
        if report.failed:
            terminal = self.config.pluginmanager.get_plugin("terminalreporter")
            if terminal is not None:
                minutes, seconds = divmod(int(time.monotonic() - self.started), 60)
                terminal.write_line(f"\nFAILED ({report.when}, {minutes}m{seconds:02d}s into the run) {report.nodeid}")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without xdist, not called
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker per core, but no more than the memory holds (each keeps warm rank groups of up to
    eight processes and runs evaluations beside them: about 8 GiB a worker) and at most 8."""
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return max(1, min(os.cpu_count() or 1, int(memory_gib // 8), 8))


def worker_group(item) -> str:
    """What ``--dist loadgroup`` keeps on one worker (pytest-xdist; ``-n``): a problem's tests on the warm
    sessions (so its reference outputs are kept for all of them), else the module (its module-scoped
    servers and clusters start once)."""
    name = _problem_of(item)
    if name is not None and "sessions" in item.fixturenames:
        return f"problem:{name}"
    if "ray_cluster" in item.fixturenames or (item.module is not None and item.module.__name__ in RAY_MODULES):
        return "ray"  # one local Ray cluster at a time: ray.init joins one another worker started
    return f"module:{item.module.__name__ if item.module else item.nodeid.split('::')[0]}"


def problem_major(items: list) -> list:
    """The tests parametrized by a problem (a ``problem``, or its ``number``) grouped by it, in the order each
    problem first appears; other tests keep their places. Tests on the run's warm ``sessions`` are grouped
    across modules (a problem's self-check, its known-wrong candidates and its upstream file as a candidate,
    one after another), others within their module. The warm session then loads each reference once and
    judges every candidate of a problem against the reference outputs it kept
    (``pkb.evaluate.session.ReferenceOutputs``), instead of running the reference again per test."""
    ordered, by_problem = [], {}
    for item in items:
        name = _problem_of(item)
        if name is None:
            ordered.append([item])
            continue
        shared = "sessions" in item.fixturenames
        key = ("", name) if shared else (item.module.__name__ if item.module else "", name)
        if key not in by_problem:
            by_problem[key] = []
            ordered.append(by_problem[key])
        by_problem[key].append(item)
    return [item for group in ordered for item in group]


def _problem_of(item) -> str | None:
    """The name of the problem a test is parametrized by (a ``problem``, or a ``number`` on the warm sessions)."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    if "problem" in params:
        return getattr(params["problem"], "name", None)
    if isinstance(params.get("number"), int) and "sessions" in item.fixturenames:
        return _problem_name(params["number"])
    return None


def _problem_name(number: int) -> str | None:
    from pkb.registry import UnknownProblem, get_problem

    try:
        return get_problem(number).name
    except UnknownProblem:
        return None


# Sessions a test worker keeps warm at once: each holds its reference ranks and a spare candidate group, some
# 400 MB a rank (W = 2, 4, 4 on 2 nodes and 8 at once, on two workers, took a 24 GiB machine out of memory).
MAX_WARM_SESSIONS = 2
# and keeps at most this much of the reference's answers per session (a user's default: 512 MiB): a worker that kept
# 512 MiB per session beside the replies of a large case grew past 3 GiB and was the OOM killer's choice
TEST_REFERENCE_OUTPUTS_BYTES = 128 << 20


@pytest.fixture(scope="session")
def _warm_sessions():
    opened: dict[tuple[Mode, int, int], Session] = {}
    yield opened
    for session in opened.values():
        session.close()


@pytest.fixture(scope="module", autouse=True)
def _gpu_sessions_end_with_their_module(_warm_sessions):
    """Sessions on a GPU end with the module that opened them: their memory would shrink what later
    modules measure free (side-by-side admission). cpu-mode sessions stay warm for the whole run."""
    yield
    for key in [key for key in _warm_sessions if key[0] is not Mode.CPU]:
        _warm_sessions.pop(key).close()


@pytest.fixture
def sessions(_warm_sessions):
    """``sessions(world_size, mode=Mode.CPU, nodes=1)``: the run's warm Session per (mode, world size, nodes),
    shared by every test that asks (an inter-node problem needs one of its nodes: ``nodes=problem.nodes[0]``);
    closed at the end of the run, or of the module for a GPU mode, or when ``MAX_WARM_SESSIONS`` others were used
    since."""
    def get(world_size: int, mode: Mode = Mode.CPU, nodes: int = 1) -> Session:
        key = (mode, world_size, nodes)
        if key not in _warm_sessions:
            while len(_warm_sessions) >= MAX_WARM_SESSIONS:  # the least recently used ends first
                _warm_sessions.pop(next(iter(_warm_sessions))).close()
            _warm_sessions[key] = Session(mode, world_size, nodes=nodes)
            _warm_sessions[key].reference_outputs = ReferenceOutputs(max_bytes=TEST_REFERENCE_OUTPUTS_BYTES)
        _warm_sessions[key] = _warm_sessions.pop(key)  # the most recently used last
        return _warm_sessions[key]

    return get


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for a test module (4 logical CPUs and no GPU, on any machine: two cpu-mode
    slots of world size 2), stopped after it so that no other module shares the machine with Ray; the
    executors the tests make connect to it; a new one even where another process runs a cluster (``address="local"``:
    an xdist worker beside it may). Skipped where the ``ray`` extra is not installed."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    import logging

    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    yield ray
    ray.shutdown()
