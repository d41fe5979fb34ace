"""Evaluations side by side on one machine (``pkb run --parallel N``) on real rank processes: the verdicts of
one at a time, one build broker for every slot; and ``pkb run`` as a user runs it: a bad ``--parallel``, the
live display on a terminal, a line per result in a log."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pkb.executor import Evaluation
from pkb.loop import run_evaluations
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.executor import LocalExecutor
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime.modes import Mode
from pkb.store.db import ResultStore

REPO = Path(__file__).resolve().parents[2]
CONFIG = EvalConfig(world_size=2, mode=Mode.CPU, trials=1, cases="upstream")


def zeros_candidate(tmp_path: Path, problem) -> Candidate:
    template = (REPO / "tests" / "candidates" / "zeros.py.tmpl").read_text()
    path = tmp_path / f"{problem.name}_zeros.py"
    path.write_text(template.replace("{module}", problem.module))
    return Candidate.from_file(path)


def test_side_by_side_gives_the_verdicts_of_one_at_a_time_and_shares_one_build_broker(tmp_path):
    evaluations = []
    for name in ("allreduce", "allgather", "broadcast", "reducescatter"):
        problem = get_problem(name)
        evaluations += [Evaluation(problem, Candidate.reference_of(problem), "reference"),
                        Evaluation(problem, zeros_candidate(tmp_path, problem), "wrong")]
    verdicts, most_at_once = {}, 0
    for slots in (1, 3):
        executor = LocalExecutor(slots)
        seen = []

        def on_result(evaluation, result, resumed, executor=executor, seen=seen):
            seen.append(len(executor.in_flight()))

        with executor, ResultStore(tmp_path / f"{slots}.sqlite") as store:
            results = run_evaluations(evaluations, CONFIG, store, on_result, executor)
            brokers = {id(session._broker) for sessions in executor._slots for session in sessions.values()}
            if slots > 1:
                assert len(executor._slots) == slots and len(brokers) == 1  # a source is built once for all slots
        verdicts[slots] = [(r.problem, r.solution, r.status) for r in results]
        most_at_once = max(seen) if slots > 1 else most_at_once
    assert verdicts[1] == verdicts[3]
    assert [status for _, _, status in verdicts[3]] == [Status.OK, Status.MISMATCH] * 4
    assert most_at_once >= 1  # another evaluation was still running when a result came back


def test_a_bad_parallel_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "pkb.cli", "run", "--problems", "1", "--parallel", "0"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "argument --parallel: must be from 1 to 1024, got 0" in out.stderr


# -- what a run shows --------------------------------------------------------------------------------


def in_a_terminal(*args: str, timeout: float = 240) -> str:
    """``pkb`` with stdout and stderr on a pseudo-terminal; everything it wrote there."""
    leader, follower = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "pkb.cli", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                               stdout=follower, stderr=follower, env={**os.environ, "COLUMNS": "120"})
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process has ended
            break
        if not chunk:
            break
        chunks.append(chunk)
    process.wait(timeout=30)
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def test_a_terminal_gets_the_live_display_and_a_log_gets_a_line_per_result(tmp_path):
    pytest.importorskip("rich")
    live = in_a_terminal("run", "--problems", "1-2", "--trials", "1", "--db", str(tmp_path / "a.sqlite"))
    assert "elapsed" in live and "left" in live and re.search(r"\d+/5", live)  # the bar, its times and count
    assert re.search(r"\d+ ok", live) and "[1/5]" not in live
    quiet = in_a_terminal("run", "--problems", "1-2", "--trials", "1", "--db", str(tmp_path / "b.sqlite"), "--quiet")
    assert "[1/5] allreduce/reference: ok" in quiet and "elapsed" not in quiet
    logged = subprocess.run([sys.executable, "-m", "pkb.cli", "run", "--problems", "1-2", "--trials", "1", "--db",
                             str(tmp_path / "c.sqlite")], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert logged.returncode == 0, logged.stderr
    lines = [line for line in logged.stderr.splitlines() if line.startswith("[")]
    assert lines[0] == "[1/5] allreduce/reference: ok" and len(lines) == 5 and "elapsed" not in logged.stderr
    assert "executor: local, 1 evaluation at once" in logged.stderr


class _EveryProcessOnOneGpu:
    """An NVML reader for a machine without one: every process uses 256 MiB of device 0."""

    num_devices = 1

    def used_by_process(self) -> dict[int, dict[int, int]]:
        return {0: {int(name): 256 << 20 for name in os.listdir("/proc") if name.isdigit()}}

    def free_bytes(self) -> dict[int, int]:
        return {0: 64 << 30}

    def total_bytes(self) -> dict[int, int]:
        return {0: 64 << 30}


def test_the_memory_probe_starts_one_group_of_ranks_and_measures_each(monkeypatch):
    """Side by side on GPUs starts by measuring one rank's memory on a group of W ranks started for it. It
    once started that group twice (``spawn()``, then again on entering ``with``): the first group's ranks
    never answered, and every GPU run went one evaluation at a time."""
    from pkb.executor import local
    monkeypatch.setattr(local.NvmlReader, "open", classmethod(lambda cls: _EveryProcessOnOneGpu()))
    measured: list[set[int]] = []
    real_usage_of = local.usage_of

    def usage_of(pids, per_process):
        measured.append(set(pids))
        return real_usage_of(pids, per_process)

    monkeypatch.setattr(local, "usage_of", usage_of)
    started = time.monotonic()
    per_rank = LocalExecutor(parallel=2)._measure_rank_memory(EvalConfig(world_size=2, mode=Mode.CPU))
    assert time.monotonic() - started < 60
    assert per_rank == 256 << 20, per_rank  # one group of W rank processes, each counted once
    assert len(measured) == 1 and len(measured[0]) == 2, measured
    assert not any(os.path.exists(f"/proc/{pid}") for pid in measured[0])  # the probe's group is gone


def test_ranks_that_fail_to_start_are_named_each_by_its_exception():
    """A group that cannot start (here: cuda mode on a machine whose ranks find no GPU to take) says which
    ranks failed and with what exception on its first line (the line a verdict's message keeps), not the
    first line of a traceback; the tracebacks follow."""
    from pkb.runtime.group import RankGroup, StartFailure
    if torch.cuda.is_available():
        pytest.skip("needs a machine whose ranks cannot take a GPU")
    with pytest.raises(StartFailure) as failure, RankGroup(Mode.CUDA, 2, "reference") as group:
        group.wait_ready(60)
    first, *rest = str(failure.value).splitlines()
    assert first.startswith("2 of 2 ranks failed to start (rank 0: ") and "; rank 1: " in first, first
    assert "Traceback" not in first and "Error" in first, first
    assert any(line.startswith("rank 1: Traceback") for line in rest), rest
