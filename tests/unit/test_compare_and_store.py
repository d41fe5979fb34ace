"""The harness around the problems, in this process: output comparison (a reply walked and judged leaf by leaf,
against the reference's output where there is no exact answer), the results database, and the sandbox level (the
flag, the check before any work, its place in the store's key). The command line as a user runs it:
tests/integration/test_cli.py. pkb's accuracy rule against the exact answer: tests/unit/test_accuracy_rule.py."""

from __future__ import annotations

import sqlite3

import pytest
import torch

from pkb.evaluate.accuracy import Judge, Where
from pkb.evaluate.result import SCHEMA_VERSION, Details, EvalResult
from pkb.options import Status
from pkb.problem import Tolerance
from pkb.store.db import ResultStore, StoreError

CLOSE = lambda dtype: Tolerance(1e-3, 1e-3)  # noqa: E731


def compare(expected, got, tolerance_for):
    """One rank's reply judged as an evaluation judges it, with no exact answer (against the reference's output)."""
    return Judge(torch.float32).reply(Where(0, "c", 0), "outputs", expected, got, tolerance_for, None, "out")


# -- comparison -------------------------------------------------------------------------------------


def test_mismatch_report_names_the_output_the_count_and_the_worst_elements():
    expected = [torch.zeros(4, 5), torch.arange(6.0).reshape(2, 3)]
    got = [torch.zeros(4, 5), torch.arange(6.0).reshape(2, 3)]
    got[1][1, 2] += 0.5
    got[1][0, 1] += 0.01
    mismatch = compare(expected, got, CLOSE)
    assert mismatch.path == "out[1] (rank 0, case c, trial 0)"
    assert mismatch.num_bad == 2 and mismatch.numel == 6
    assert mismatch.max_abs_err == pytest.approx(0.5) and mismatch.max_abs_at == (1, 2)
    assert mismatch.max_rel_err == pytest.approx(0.1)
    assert (mismatch.expected, mismatch.got) == (5.0, 5.5)
    assert "2 of 6 elements off the reference's output" in mismatch.describe()


def test_values_within_tolerance_match_and_nan_placement_must_agree():
    expected = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    assert compare(expected, expected + torch.tensor([5e-4, 0, 0, 0]), CLOSE) is None
    moved_nan = torch.tensor([float("nan"), 1.0, float("inf"), -2.0])
    mismatch = compare(expected, moved_nan, CLOSE)
    assert mismatch.num_bad == 2 and "NaN or inf" in mismatch.reason
    assert compare(expected, torch.tensor([1.0, float("nan"), float("-inf"), -2.0]), CLOSE).num_bad == 1


def test_integers_are_exact_and_exact_floats_are_bit_equal():
    assert compare(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]), CLOSE).num_bad == 1
    exact = lambda dtype: Tolerance.exact()  # noqa: E731
    assert compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 2**-20]), exact).num_bad == 1
    nans = torch.tensor([1.0, float("nan")])
    assert compare(nans, nans.clone(), exact) is None  # bit for bit, NaN where NaN
    assert compare(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), exact) is None


def test_complex_outputs_are_compared_on_both_parts():
    expected = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64)
    assert compare(expected, torch.tensor([1 + 1.1j, 2 - 1j], dtype=torch.complex64), CLOSE).max_abs_at == (0, 1)
    assert compare(expected, expected.clone(), CLOSE) is None


@pytest.mark.parametrize(("got", "reason"), [
    (torch.zeros(3, 2), "expected shape [2, 3], got [3, 2]"),
    (torch.zeros(2, 3, dtype=torch.float64), "expected dtype torch.float32"),
    ([torch.zeros(2, 3)], "expected a tensor, got list"),
    ({"__unsupported__": "LazyTensor"}, "unsupported object (LazyTensor)"),
])
def test_structure_shape_and_dtype_differences_are_mismatches(got, reason):
    assert reason in compare(torch.zeros(2, 3), got, CLOSE).reason


# -- results database -------------------------------------------------------------------------------


def _result(**overrides) -> EvalResult:
    fields = dict(problem="allreduce", problem_version=1, solution="x", solution_sha256="abc", status=Status.OK,
                  message="fine", details=Details(rank=1), mode="cpu", world_size=2, num_trials=3, speedup=float("inf"))
    fields.update(overrides)
    return EvalResult(**fields)


def test_results_round_trip_with_schema_version(tmp_path):
    with ResultStore(tmp_path / "r.sqlite") as store:
        assert store.schema_version == SCHEMA_VERSION
        store.add(_result(), "key1")
        store.add(_result(status=Status.MISMATCH, message="off"), "key2")
        assert store.has("key1") and not store.has("key3")
        rows = list(store.results())
    assert [r.status for r in rows] == [Status.OK, Status.MISMATCH]
    assert rows[0].details == Details(rank=1) and rows[0].schema_version == SCHEMA_VERSION
    raw = sqlite3.connect(tmp_path / "r.sqlite").execute("SELECT speedup, status, pkb_version FROM results").fetchall()
    assert raw[0][0] is None and raw[1][1] == "mismatch" and raw[0][2]


def test_a_database_from_a_newer_pkb_is_refused(tmp_path):
    path = tmp_path / "new.sqlite"
    sqlite3.connect(path).execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer than this pkb"):
        ResultStore(path)


# -- the sandbox level: the flag, the check before any work, the store's key -------------------------------


def fake_check(calls: list, missing: dict[str, str] | None = None):
    """A stand-in for pkb.runtime.sandbox.check_sandbox: ``missing`` protections (none: the full set);
    ``required`` with any missing raises, as the real check does."""
    from pkb.runtime.sandbox import PROTECTIONS, SandboxStatus, SandboxUnavailable

    missing = missing or {}

    def check(level, mode):
        calls.append((level, mode))
        if level == "required" and missing:
            raise SandboxUnavailable(f"--sandbox required: this machine lacks {', '.join(missing)} "
                                     f"({'; '.join(missing.values())}); fix that, or use --sandbox auto")
        return SandboxStatus(level, [name for name in PROTECTIONS if name not in missing], dict(missing))

    return check


def test_the_sandbox_flag_reaches_the_config_and_is_said_on_stderr(monkeypatch, capsys):
    from pkb.cli import build_parser
    from pkb.commands import make_config
    from pkb.registry import get_problem
    from pkb.runtime import sandbox
    from pkb.runtime.modes import Mode

    calls: list = []
    parse = lambda *extra: build_parser().parse_args(["eval", "1", "reference", "--mode", "cpu", *extra])  # noqa: E731
    assert parse().sandbox == "auto"
    from pkb.console import UsageError

    with pytest.raises(UsageError, match=r"argument --sandbox: must be one of \['auto', 'required', 'off'\]"):
        parse("--sandbox", "loose")  # pkb's usage error: exit status 2 (pkb.cli.main)

    monkeypatch.setattr(sandbox, "check_sandbox", fake_check(calls))
    config = make_config(parse("--sandbox", "required"), get_problem(1))
    assert config.sandbox == "required" and calls == [("required", Mode.CPU)]
    assert f"sandbox: required (full: {', '.join(sandbox.PROTECTIONS)})" in capsys.readouterr().err

    monkeypatch.setattr(sandbox, "check_sandbox", fake_check(calls, {"network-namespace": "no user namespaces"}))
    assert make_config(parse(), get_problem(1)).sandbox == "auto"
    assert "sandbox: auto (partial; missing: network-namespace (no user namespaces))" in capsys.readouterr().err
    assert make_config(parse("--json"), get_problem(1)).sandbox == "auto" and capsys.readouterr().err == ""

    calls.clear()
    assert make_config(parse("--sandbox", "off"), get_problem(1)).sandbox == "off"
    assert "sandbox: off (candidates run unconfined: for debugging only)" in capsys.readouterr().err


def test_sandbox_required_on_a_machine_without_the_full_set_is_a_usage_error_before_any_work(monkeypatch, capsys,
                                                                                            tmp_path):
    from pkb.cli import main
    from pkb.runtime import sandbox

    calls: list = []
    monkeypatch.setattr(sandbox, "check_sandbox", fake_check(calls, {"landlock-fs": "kernel 5.4 has no Landlock"}))
    assert main(["eval", "1", "reference", "--mode", "cpu", "--sandbox", "required"]) == 2
    err = capsys.readouterr().err
    assert "pkb: error: --sandbox required: this machine lacks landlock-fs (kernel 5.4 has no Landlock)" in err
    db = tmp_path / "never.sqlite"
    assert main(["run", "--problems", "1", "--mode", "cpu", "--sandbox", "required", "--db", str(db)]) == 2
    assert "lacks landlock-fs" in capsys.readouterr().err and not db.exists()  # refused before any evaluation
    assert [level for level, _ in calls] == ["required", "required"]


def test_the_sandbox_level_is_in_the_evaluation_key_and_auto_keeps_the_key_of_earlier_databases():
    from pkb.loop import evaluation_key
    from pkb.evaluate.candidate import Candidate
    from pkb.evaluate.config import EvalConfig
    from pkb.registry import get_problem
    from pkb.runtime.modes import Mode
    from pkb.store.db import run_key

    problem = get_problem("allreduce")
    candidate = Candidate.reference_of(problem)
    key = lambda level: evaluation_key(problem, candidate, EvalConfig(2, Mode.CPU, sandbox=level))  # noqa: E731
    before = lambda suffix: run_key("allreduce", problem.version, candidate.sha256, "cpu", 2, 3,  # noqa: E731
                                    "|report" + suffix)
    assert key("auto") == before("")  # the key pkb wrote before the sandbox existed
    assert key("off") == before("|sandbox=off") and key("required") == before("|sandbox=required")
    assert len({key("auto"), key("off"), key("required")}) == 3


class RecordingExecutor:
    """Answers every evaluation ``ok`` at once and remembers which evaluations it was given (no rank processes)."""

    name = "recording"

    def __init__(self):
        self.submitted: list = []
        self._queue: list = []

    def submit(self, evaluation) -> None:
        self.submitted.append(evaluation)
        self._queue.append(evaluation)

    @property
    def pending(self) -> int:
        return len(self._queue)

    def finished(self, wait: bool = True):
        from pkb.evaluate.evaluator import new_result

        while self._queue:
            evaluation = self._queue.pop(0)
            yield evaluation, new_result(evaluation.problem, evaluation.candidate, evaluation.config, Status.OK)


def test_a_result_of_sandbox_off_is_never_resumed_by_a_sandboxed_run(tmp_path):
    from pkb.executor import Evaluation
    from pkb.loop import run_evaluations
    from pkb.evaluate.candidate import Candidate
    from pkb.evaluate.config import EvalConfig
    from pkb.registry import get_problem
    from pkb.runtime.modes import Mode

    problem = get_problem("allreduce")
    evaluations = [Evaluation(problem, Candidate.reference_of(problem), "reference")]

    def evaluated(level: str) -> int:
        executor = RecordingExecutor()
        with ResultStore(tmp_path / "r.sqlite") as store:
            run_evaluations(evaluations, EvalConfig(2, Mode.CPU, sandbox=level), store, executor=executor)
        return len(executor.submitted)

    assert evaluated("off") == 1 and evaluated("off") == 0  # resumed at the same level
    assert evaluated("auto") == 1 and evaluated("auto") == 0  # the unconfined result is not reused
    assert evaluated("required") == 1 and evaluated("off") == 0
