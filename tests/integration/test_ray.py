"""``--executor ray`` on a local Ray cluster in cpu mode: the same verdicts as this machine's executor
(crashing, hanging and cheating candidates included), the same ``pkb run`` table, and a worker killed in
the middle of an evaluation retried; when the retries run out, an ``infra_error`` that reports leave out
and a rerun evaluates again. Without a cluster: tests/unit/test_ray_without_a_cluster.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from helpers.sources import HONEST_ALLREDUCE
from pkb.executor import Evaluation
from pkb.loop import run_evaluations
from pkb.cli import main
from pkb.console import UsageError
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.executor import LocalExecutor
from pkb.executor.ray_cluster import RayExecutor
from pkb.options import Status
from pkb.registry import get_problem
from pkb.report import metrics, records
from pkb.runtime.modes import Mode
from pkb.store.db import ResultStore

TEMPLATES = Path(__file__).resolve().parents[1] / "candidates"
CONFIG = EvalConfig(world_size=2, mode=Mode.CPU, trials=1, timeout=20.0)
# for the slow candidate, which writes a marker file the sandbox forbids (these tests kill the machine, not escapes)
UNCONFINED = replace(CONFIG, sandbox="off")


def from_template(template: str, problem, tmp_path: Path) -> Candidate:
    path = tmp_path / f"{problem.name}_{template}.py"
    path.write_text((TEMPLATES / f"{template}.py.tmpl").read_text().replace("{module}", problem.module))
    return Candidate.from_file(path)


def from_source(name: str, source: str, tmp_path: Path) -> Candidate:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return Candidate.from_file(path)


def verdicts(results) -> list[tuple[str, str, str]]:
    return [(r.problem, r.solution, r.status.value) for r in results]


# -- on a local cluster --------------------------------------------------------------------------------


def test_ray_gives_the_same_verdicts_as_this_machine(ray_cluster, tmp_path):
    allreduce, allgather = get_problem("allreduce"), get_problem("allgather")
    evaluations = [
        Evaluation(allreduce, Candidate.reference_of(allreduce), "reference"),
        Evaluation(allgather, Candidate.reference_of(allgather), "reference"),
        Evaluation(allreduce, from_template("raises", allreduce, tmp_path), "known"),
        Evaluation(allreduce, from_template("exits", allreduce, tmp_path), "known"),
        Evaluation(allreduce, from_template("hangs", allreduce, tmp_path), "known"),
        Evaluation(allgather, from_template("zeros", allgather, tmp_path), "known"),
        Evaluation(allreduce, from_source("patches_timer", HONEST_ALLREDUCE + "import time\ntime.perf_counter = "
                                          "lambda: 0.0\n", tmp_path), "known")]
    with ResultStore(tmp_path / "local.sqlite") as store:
        local = run_evaluations(evaluations, CONFIG, store, executor=LocalExecutor())
    with RayExecutor() as executor, ResultStore(tmp_path / "ray.sqlite") as store:
        on_ray = run_evaluations(evaluations, CONFIG, store, executor=executor)
        stored = list(store.results())
    assert verdicts(local) == verdicts(on_ray)
    assert [s for _, _, s in verdicts(on_ray)] == ["ok", "ok", "runtime_error", "crash", "timeout", "mismatch", "tampered"]
    assert sorted(verdicts(stored)) == sorted(verdicts(on_ray))  # every result reached the driver's store
    paths = {r.solution: r.details.solution_path for r in on_ray}  # the driver's file, not the node's copy
    assert paths["allreduce_raises"] == str((tmp_path / "allreduce_raises.py").resolve())
    # a node that failed to give an answer (on a loaded 2-core machine Ray's workers can) is retried, and says why
    assert all((r.details.attempts == 1) == (not r.details.infra_errors) for r in on_ray), \
        [(r.solution, r.details.attempts, r.details.infra_errors) for r in on_ray]


def test_pkb_run_on_ray_prints_the_same_table(ray_cluster, tmp_path, capsys):
    def table(*extra) -> tuple[int, list[str], str]:
        code = main(["run", "--problems", "1-3", "--mode", "cpu", "--trials", "1", *extra])
        out = capsys.readouterr()
        return code, [line for line in out.out.splitlines() if "sqlite" not in line], out.err

    code, local, _ = table("--db", str(tmp_path / "local.sqlite"))
    ray_code, on_ray, err = table("--db", str(tmp_path / "ray.sqlite"), "--executor", "ray")
    assert (code, local) == (ray_code, on_ray) and "executor: ray: 1 node(s), 4 CPUs" in err
    assert "references: 3 of 3 ok" in "\n".join(on_ray)


def slow_candidate(tmp_path: Path) -> tuple[Candidate, Path]:
    """An honest all-reduce that says (in a file) when it is loaded, so a test knows it is mid-evaluation
    (evaluate it with ``UNCONFINED``: the sandbox would refuse the file)."""
    marker = tmp_path / "loaded"
    return from_source("slow_allreduce", HONEST_ALLREDUCE + f"""
import pathlib, time
pathlib.Path({str(marker)!r}).write_text("loaded")
_honest = solution
def solution(tensor):
    time.sleep(0.3)
    return _honest(tensor)
""", tmp_path), marker


def kill_slot_once_loaded(executor: RayExecutor, marker: Path) -> threading.Thread:
    """Kill (SIGKILL) the one slot's process as soon as the candidate has been loaded under it."""
    [slot] = executor.slots()
    pid = executor.ray.get(slot.where.remote())["pid"]

    def kill():
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_a_worker_killed_mid_evaluation_is_retried_and_gives_no_candidate_verdict(ray_cluster, tmp_path):
    problem = get_problem("allreduce")
    candidate, marker = slow_candidate(tmp_path)
    with RayExecutor(parallel=1) as executor:
        warm = executor.evaluate(problem, Candidate.reference_of(problem), UNCONFINED)  # starts the one slot
        assert warm.ok, warm.message
        killer = kill_slot_once_loaded(executor, marker)
        result = executor.evaluate(problem, candidate, UNCONFINED)
        killer.join()
    assert result.status is Status.OK, result.message  # the second attempt, on a fresh worker, decided it
    assert result.details.attempts == 2 and len(result.details.infra_errors) == 1
    assert "Actor" in result.details.infra_errors[0]


def test_when_the_retries_run_out_the_row_is_infra_error_left_out_and_rerun(ray_cluster, tmp_path):
    problem = get_problem("allreduce")
    candidate, marker = slow_candidate(tmp_path)
    evaluation = Evaluation(problem, candidate, "killed")
    with RayExecutor(parallel=1, max_attempts=1) as executor, ResultStore(tmp_path / "r.sqlite") as store:
        executor.evaluate(problem, Candidate.reference_of(problem), UNCONFINED)
        killer = kill_slot_once_loaded(executor, marker)
        [result] = run_evaluations([evaluation], UNCONFINED, store, executor=executor)
        killer.join()
        assert result.status is Status.INFRA_ERROR and "no verdict on the candidate" in result.message
        assert [r.status for r in list(store.results())] == [Status.INFRA_ERROR]
        tally = metrics.tally(problem.name, records.from_results(list(store.results())))
        assert (tally.num_samples, tally.num_skipped) == (0, 1)  # neither a pass nor a failure

        marker.unlink()
        [again] = run_evaluations([evaluation], UNCONFINED, store, executor=executor)  # a rerun evaluates it again
        assert again.status is Status.OK and again.details.attempts == 1
    assert main(["run", "--problems", "1", "--mode", "cpu", "--executor", "ray", "--address", "local", "--parallel",
                 "0", "--db", os.devnull]) == 2  # a usage error, before any work


def test_a_mode_no_node_can_run_is_a_usage_error(ray_cluster):
    with RayExecutor() as executor:
        with pytest.raises(UsageError, match="no node of the Ray cluster has 2 GPU"):
            executor.capacity(EvalConfig(world_size=2, mode=Mode.CUDA))
        assert executor.gpus_per_node() == 0
