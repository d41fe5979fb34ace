"""Evaluations side by side on one machine (``pkb run --parallel N``), scheduled with ``evaluate`` and
``Session`` stood in for (no rank processes): timed evaluations run alone, a failure for want of the machine
is judged again alone, GPU memory admits evaluations, the default slots; and what a run shows while it runs.
The same on real rank processes and through ``pkb run``: tests/integration/test_parallel.py."""

from __future__ import annotations

import io
import os
import threading
import time
from dataclasses import replace

import pytest

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import new_result
from pkb.evaluate.result import EvalResult
from pkb.executor import Evaluation, LocalExecutor, default_parallel
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime.modes import Mode

CONFIG = EvalConfig(world_size=2, mode=Mode.CPU, trials=1, cases="upstream")


def test_timed_evaluations_run_alone_after_the_untimed_ones(monkeypatch):
    active, log, lock = set(), [], threading.Lock()

    def fake_evaluate(problem, candidate, config, session):
        with lock:
            active.add(candidate.name)
            log.append((candidate.name, config.perf, frozenset(active)))
        time.sleep(0.05)
        with lock:
            active.discard(candidate.name)
        return new_result(problem, candidate, config, Status.OK)

    monkeypatch.setattr("pkb.executor.local.evaluate", fake_evaluate)
    monkeypatch.setattr("pkb.executor.local.Session", NoSession)
    problem = get_problem("allreduce")
    reference = Candidate.reference_of(problem)
    evaluations = [Evaluation(problem, replace(reference, name=f"{kind}{i}"), config=replace(CONFIG, perf=timed))
                   for i in range(6) for kind, timed in (("timed", True), ("untimed", False))]
    with LocalExecutor(4) as executor:
        for evaluation in evaluations:
            executor.submit(evaluation)
        finished = [evaluation.candidate.name for evaluation, _ in executor.finished()]
    assert sorted(finished) == sorted(evaluation.candidate.name for evaluation in evaluations)
    started = [name for name, _, _ in log]
    assert all(name.startswith("untimed") for name in started[:6])  # the untimed ones first
    assert max(len(beside) for _, perf, beside in log if not perf) > 1  # side by side
    assert all(beside == {name} for name, perf, beside in log if perf)  # a timed one never beside another
    # and nothing started while a timed one ran: each timed start saw the set empty, and no later start saw it
    for index, (name, perf, _) in enumerate(log):
        if perf and index + 1 < len(log):
            assert name not in log[index + 1][2]


class NoSession:
    def __init__(self, *args, **kwargs):
        pass

    def close(self):
        pass

    def root_pids(self):
        return []


def _fake_machine(monkeypatch, judge):
    """Evaluations that take 0.1 s each and get ``judge(name, others)``'s status, ``others``: how many other
    evaluations were in flight at any point of its run."""
    active, lock, seen = set(), threading.Lock(), {}

    def fake_evaluate(problem, candidate, config, session):
        with lock:
            active.add(candidate.name)
            for name in active:
                seen[name] = max(seen.get(name, 0), len(active) - 1)
        time.sleep(0.1)
        with lock:
            others = seen.pop(candidate.name)
            active.discard(candidate.name)
        status, message = judge(candidate.name, others)
        result = new_result(problem, candidate, config, status)
        result.message = message
        return result

    monkeypatch.setattr("pkb.executor.local.evaluate", fake_evaluate)
    monkeypatch.setattr("pkb.executor.local.Session", NoSession)


def _run_side_by_side(names: list[str], slots: int = 4) -> dict[str, EvalResult]:
    problem = get_problem("allreduce")
    reference = Candidate.reference_of(problem)
    with LocalExecutor(slots) as executor:
        for name in names:
            executor.submit(Evaluation(problem, replace(reference, name=name), config=CONFIG))
        return {evaluation.candidate.name: result for evaluation, result in executor.finished()}


def test_a_failure_for_want_of_memory_beside_others_is_judged_again_alone(monkeypatch):
    """The verdicts are those of one at a time: an out-of-memory error, a time-out or a dead rank that
    happened beside other evaluations is not counted; the evaluation runs again alone, and says so."""
    def judge(name, others):
        if others and name.startswith("hungry"):
            return Status.RUNTIME_ERROR, "rank 1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"
        if others and name.startswith("slow"):
            return Status.TIMEOUT, "case upstream, trial 0: did not finish within 60 s"
        if name.startswith("wrong"):
            return Status.MISMATCH, "rank 0: out: 12 of 1024 elements off"
        return Status.OK, "ok"

    _fake_machine(monkeypatch, judge)
    results = _run_side_by_side(["hungry0", "slow0", "wrong0", "fine0", "hungry1", "fine1"])
    assert {name: r.status for name, r in results.items()} == {
        "hungry0": Status.OK, "slow0": Status.OK, "wrong0": Status.MISMATCH, "fine0": Status.OK, "hungry1": Status.OK,
        "fine1": Status.OK}
    # each that failed beside others ran again alone (after the first, fewer run at once: some never fail beside)
    reruns = {name: results[name].details.rerun_alone for name in ("hungry0", "hungry1", "slow0")
              if results[name].details.rerun_alone}
    assert reruns, results
    for name, rerun in reruns.items():
        assert rerun["first"]["status"] in ("runtime_error", "timeout") and rerun["why"], rerun
        assert ("out of memory" in rerun["first"]["message"] if name.startswith("hungry")
                else "timed out beside other evaluations" in rerun["why"]), rerun
    assert all(not results[name].details.rerun_alone for name in ("wrong0", "fine0", "fine1"))


def test_after_ranks_fail_to_start_beside_others_fewer_are_admitted_at_once(monkeypatch):
    """Issue 47: on one H200 at W = 8 six evaluations at once mostly failed to start and ran again alone. The
    executor now admits half as many at once as ran when pkb's limits failed one, down to what starts."""
    peak = {"at_once": 0}

    def judge(name, others):
        peak["at_once"] = max(peak["at_once"], others + 1)
        if others >= 2:  # this machine starts no more than two groups of ranks at once
            return Status.HARNESS_ERROR, "pkb failed, not the candidate: loading the candidate: 8 of 8 ranks failed to start"
        return Status.OK, "ok"

    _fake_machine(monkeypatch, judge)
    problem = get_problem("allreduce")
    reference = Candidate.reference_of(problem)
    with LocalExecutor(6) as executor:
        for index in range(18):
            executor.submit(Evaluation(problem, replace(reference, name=f"e{index}"), config=CONFIG))
        results = {evaluation.candidate.name: result for evaluation, result in executor.finished()}
        reason = executor.describe()
    assert all(result.status is Status.OK for result in results.values()), results
    reruns = sum(bool(result.details.rerun_alone) for result in results.values())
    assert peak["at_once"] > 2 and reruns < 9, (peak, reruns)  # fewer at once after the first failures
    assert "then at most" in reason and "pkb failed beside other evaluations" in reason, reason


def test_a_shared_gpu_out_of_memory_skip_beside_others_is_judged_again_alone(monkeypatch):
    """Skipped for pkb's memory limit (W ranks share one GPU) beside other evaluations: judged again alone."""
    def judge(name, others):
        return (Status.SKIPPED, "rank 1 ran out of GPU memory in shared-gpu mode") if others else (Status.OK, "ok")

    _fake_machine(monkeypatch, judge)
    original = LocalExecutor._evaluate

    def with_limit(self, evaluation, slot):
        result = original(self, evaluation, slot)
        if result.status is Status.SKIPPED:
            result.details.pkb_limits = ["memory"]
        return result

    monkeypatch.setattr(LocalExecutor, "_evaluate", with_limit)
    results = _run_side_by_side(["a", "b", "c"])
    assert all(r.status is Status.OK for r in results.values()), results
    assert any("ran out of GPU memory beside other evaluations" in (r.details.rerun_alone or {}).get("why", "")
               for r in results.values())


def test_a_failure_that_repeats_alone_counts_as_the_verdict(monkeypatch):
    _fake_machine(monkeypatch, lambda name, others: (Status.RUNTIME_ERROR, "MemoryError: the candidate asked for 1 TiB")
                  if name.startswith("greedy") else (Status.OK, "ok"))
    results = _run_side_by_side(["greedy", "fine0", "fine1", "fine2"])
    assert results["greedy"].status is Status.RUNTIME_ERROR  # alone it fails the same way: the candidate's
    assert results["greedy"].details.rerun_alone["first"]["status"] == "runtime_error"


def test_one_at_a_time_nothing_is_judged_again(monkeypatch):
    _fake_machine(monkeypatch, lambda name, others: (Status.TIMEOUT, "did not finish"))
    results = _run_side_by_side(["a", "b"], slots=1)
    assert all(r.status is Status.TIMEOUT and not r.details.rerun_alone for r in results.values())


class FakeReader:
    """An NVML reader of one 100 GiB GPU whose processes use what ``used`` says."""

    def __init__(self):
        self.used: dict[int, int] = {}

    def used_by_process(self):
        return {0: dict(self.used)}

    def free_bytes(self):
        return {0: 100 * (1 << 30) - sum(self.used.values())}


def test_gpu_evaluations_are_admitted_by_the_memory_they_are_measured_to_need(monkeypatch):
    from pkb.executor.memory import GpuAdmission

    GIB = 1 << 30
    reader = FakeReader()
    admission = GpuAdmission(reader)
    monkeypatch.setattr("pkb.executor.memory.children_by_parent", lambda: {})
    gpu = replace(CONFIG, mode=Mode.SHARED_GPU)
    problem, other = get_problem("allreduce"), get_problem("allgather")
    first, second, third = (Evaluation(p, Candidate.reference_of(p), config=gpu) for p in (problem, problem, other))
    assert admission.admits(first, [])[0] is False  # nothing measured yet: one at a time
    admission.watch(first, lambda: [101])
    reader.used = {101: 30 * GIB}
    admission.sample()
    assert admission.need(third).largest == 30 * GIB  # an unmeasured problem: the largest measured so far
    assert admission.admits(second, [])[0]  # 70 GiB free, 37.5 needed
    reader.used = {101: 60 * GIB}
    admission.sample()
    fits, why = admission.admits(second, [])  # 40 free, 75 needed
    assert not fits and "GPU 0" in why
    reader.used = {}
    assert admission.finished(first).largest == 60 * GIB
    assert admission.need(second).largest == 60 * GIB and admission.admits(second, [])[0]
    admission.close()


def test_ranks_that_cannot_start_for_the_memory_probe_leave_the_run_going_one_at_a_time(monkeypatch):
    from pkb.runtime.group import StartFailure

    def cold(self, config):
        raise StartFailure("the reference ranks did not start: start-up did not finish within 120 s", None,
                           "rank 0: importing torch\nrank 0: cuda init")

    monkeypatch.setattr(LocalExecutor, "_measure_rank_memory", cold)
    executor = LocalExecutor(8)
    assert executor.capacity(replace(CONFIG, mode=Mode.SHARED_GPU, world_size=8)) == 1
    assert executor.describe().startswith("local, 1 evaluation at once (one at a time: the GPU memory of W = 8 ranks "
                                          "could not be measured (the reference ranks did not start")
    assert "rank 0: cuda init" in executor.describe()


def test_the_default_is_bound_by_cores_and_memory(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert default_parallel(Mode.CPU, 2).slots == 1  # this 2-core machine: the two ranks fill it
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    chosen = default_parallel(Mode.CPU, 2)
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert chosen.slots == min(8, max(1, int(ram_gib // (3 * 2 * 0.75))))
    assert "16 cores" in chosen.reason
    monkeypatch.setattr(os, "cpu_count", lambda: 512)
    assert default_parallel(Mode.CPU, 2).slots <= 16


# -- what a run shows --------------------------------------------------------------------------------


def test_the_live_display_prints_each_result_that_needs_a_look_and_counts_the_rest():
    pytest.importorskip("rich")
    from pkb.progress import Progress

    problem = get_problem("allreduce")
    stream = io.StringIO()
    with Progress(3, live=True, stream=stream, in_flight=lambda: [("allgather/slow.py", 12.0)]) as progress:
        for name, status in (("a", Status.OK), ("b", Status.MISMATCH), ("c", Status.OK)):
            result = new_result(problem, replace(Candidate.reference_of(problem), name=name), CONFIG, status)
            result.message = "output 0 differs" if status is Status.MISMATCH else ""
            progress.update(None, result, resumed=False)
    shown = stream.getvalue()
    assert "mismatch  allreduce/b  output 0 differs" in shown and "allreduce/a" not in shown
    assert "2 ok" in shown and "1 mismatch" in shown and "3/3" in shown
    assert progress.counts == {"ok": 2, "mismatch": 1}


def test_a_problem_that_fills_a_gpu_runs_alone_on_gpus_and_beside_others_on_the_cpu():
    from pkb.executor.local import runs_alone

    big = replace(get_problem("allreduce"), fills_a_gpu="57 GB of inputs")
    small = get_problem("allreduce")
    reference = Candidate.reference_of(small)
    on_gpu = replace(CONFIG, mode=Mode.SHARED_GPU)
    def alone(problem, config) -> bool:
        return runs_alone(Evaluation(problem, reference, config=config))

    assert alone(big, on_gpu) and not alone(big, CONFIG)
    assert not alone(small, on_gpu) and alone(small, replace(CONFIG, perf=True))
