"""pkb's one evaluation loop (pkb.loop.EvaluationLoop): what each caller's reuse policy stores and hands
back, on an executor that judges without starting processes (the verdict is the file's first line)."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest

from pkb.loop import EvaluationLoop, run_evaluations
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import new_result
from pkb.executor import Evaluation, Executor
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime.modes import Mode
from pkb.store.db import ResultStore

CONFIG = EvalConfig(world_size=2, mode=Mode.CPU, trials=1)
ALLGATHER = get_problem("allgather")


class VerdictFromSource(Executor):
    """Judges a file by its first line (``# ok``, ``# harness_error``): counts what it was asked to run."""

    name = "fake"

    def __init__(self):
        self.queue: deque = deque()
        self.ran: list[str] = []

    def submit(self, evaluation) -> None:
        self.queue.append(evaluation)

    @property
    def pending(self) -> int:
        return len(self.queue)

    def finished(self, wait: bool = True):
        while self.queue:
            evaluation = self.queue.popleft()
            self.ran.append(evaluation.candidate.name)
            status = Status(evaluation.candidate.source.splitlines()[0].lstrip("# ").strip())
            yield evaluation, new_result(evaluation.problem, evaluation.candidate, evaluation.config, status)


def evaluation_of(tmp_path, name: str, first_line: str = "# ok", solution_set: str = "a") -> Evaluation:
    path = tmp_path / f"{name}.py"
    path.write_text(f"{first_line}\ndef solution(tensor):\n    return tensor\n")
    return Evaluation(ALLGATHER, Candidate.from_file(path, name=name), solution_set)


def judge(store, evaluations, reuse, executor=None):
    executor = executor or VerdictFromSource()
    with EvaluationLoop(store, CONFIG, executor, reuse=reuse) as loop:
        for index, item in enumerate(evaluations):
            loop.submit(replace(item, tag=index))
        done = sorted(loop.finished(), key=lambda stored: stored.evaluation.tag)
        assert loop.pending == 0
    return done, executor


def rows(store) -> list[tuple]:
    return [(r.solution_set, r.solution, r.status.value) for r in store.results()]


def test_restore_judges_a_file_once_and_stores_it_under_every_set_that_holds_it(tmp_path):
    with ResultStore(tmp_path / "r.sqlite") as store:
        first = evaluation_of(tmp_path, "same")
        twin = Evaluation(first.problem, Candidate.from_file(first.candidate.path, name="copy"), "b")
        done, executor = judge(store, [first, twin], "restore")
        assert executor.ran == ["same"] and [d.resumed for d in done] == [False, True]
        assert done[1].result.details.verdict_of == done[0].result_id
        again, executor = judge(store, [first], "restore")  # a rerun resumes: nothing judged, nothing stored
        assert executor.ran == [] and again[0].resumed and again[0].result_id == done[0].result_id
        assert rows(store) == [("a", "same", "ok"), ("b", "copy", "ok")]


def test_as_stored_hands_back_the_first_row_and_never_hands_back_no_reuse(tmp_path):
    with ResultStore(tmp_path / "r.sqlite") as store:
        first = evaluation_of(tmp_path, "same")
        done, _ = judge(store, [first], "as_stored")
        moved = Evaluation(first.problem, first.candidate, "elsewhere")
        reused, executor = judge(store, [moved], "as_stored")
        assert executor.ran == [] and reused[0].result_id == done[0].result_id
        assert reused[0].result.solution_set == "a"  # the row as it was stored, not copied
        fresh, executor = judge(store, [moved, moved], "never")
        assert executor.ran == ["same", "same"] and not any(d.resumed for d in fresh)
        assert len({d.result_id for d in fresh}) == 2 and len(rows(store)) == 3


def test_a_verdict_reused_in_another_experiment_is_stored_again_under_it(tmp_path):
    """An experiment's report holds every result it reused, never another experiment's row: the same file judged
    in `default` and then asked for in `sweep` is not judged again, and is stored again in `sweep`."""
    with ResultStore(tmp_path / "r.sqlite") as store:
        first = evaluation_of(tmp_path, "same")
        done, _ = judge(store, [first], "as_stored")
        assert done[0].result.experiment == "default"
        for reuse in ("as_stored", "restore"):
            again, executor = judge(store, [replace(first, experiment="sweep")], reuse)
            assert executor.ran == [] and again[0].resumed and again[0].result.experiment == "sweep"
            assert again[0].result.details.verdict_of == done[0].result_id
        assert [(r.experiment, r.solution) for r in store.results()] == [("default", "same"), ("sweep", "same")]


def test_no_verdict_is_judged_again_and_a_twin_gets_its_own_attempt(tmp_path):
    with ResultStore(tmp_path / "r.sqlite") as store:
        broken = evaluation_of(tmp_path, "pkb_failed", "# harness_error")
        done, executor = judge(store, [broken, broken], "restore")
        assert executor.ran == ["pkb_failed", "pkb_failed"]  # the twin was not answered with a harness error
        assert [d.result.status for d in done] == [Status.HARNESS_ERROR] * 2
        _, executor = judge(store, [broken], "restore")
        assert executor.ran == ["pkb_failed"]


def test_run_evaluations_keeps_their_order_and_reports_each_result(tmp_path):
    with ResultStore(tmp_path / "r.sqlite") as store:
        evaluations = [evaluation_of(tmp_path, "one"), evaluation_of(tmp_path, "two", "# mismatch"),
                       evaluation_of(tmp_path, "one")]
        seen = []
        results = run_evaluations(evaluations, CONFIG, store,
                                  lambda e, r, resumed: seen.append((e.candidate.name, resumed)), VerdictFromSource())
        assert [r.status for r in results] == [Status.OK, Status.MISMATCH, Status.OK]
        assert sorted(seen) == [("one", False), ("one", True), ("two", False)]


def test_an_evaluations_own_config_overrides_the_loop_config(tmp_path):
    with ResultStore(tmp_path / "r.sqlite") as store:
        executor = VerdictFromSource()
        loop = EvaluationLoop(store, CONFIG, executor, reuse="never", keep_paths=False)
        loop.submit(replace(evaluation_of(tmp_path, "four"), config=replace(CONFIG, world_size=4)))
        loop.submit(replace(evaluation_of(tmp_path, "trials"), config=replace(CONFIG, trials=7)))
        done = list(loop.finished())
        assert [(d.result.world_size, d.result.num_trials) for d in done] == [(4, 1), (2, 7)]
        assert all(d.result.details.solution_path is None for d in done)
        with pytest.raises(ValueError, match="reuse must be one of"):
            EvaluationLoop(store, CONFIG, executor, reuse="sometimes")
