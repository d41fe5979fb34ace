"""The harness around the problems: output comparison, the results database, the CLI, resuming runs."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pkb.evaluate.compare import compare
from pkb.evaluate.result import SCHEMA_VERSION, EvalResult
from pkb.problem import Status, Tolerance
from pkb.store.db import ResultStore, StoreError

REPO = Path(__file__).resolve().parents[1]
CLOSE = lambda dtype: Tolerance(1e-3, 1e-3)  # noqa: E731


# -- comparison -------------------------------------------------------------------------------------


def test_mismatch_report_names_the_output_the_count_and_the_worst_elements():
    expected = [torch.zeros(4, 5), torch.arange(6.0).reshape(2, 3)]
    got = [torch.zeros(4, 5), torch.arange(6.0).reshape(2, 3)]
    got[1][1, 2] += 0.5
    got[1][0, 1] += 0.01
    mismatch = compare(expected, got, CLOSE)
    assert mismatch.path == "out[1]"
    assert mismatch.num_bad == 2 and mismatch.numel == 6
    assert mismatch.max_abs_err == pytest.approx(0.5) and mismatch.max_abs_at == (1, 2)
    assert mismatch.max_rel_at == (1, 2) and mismatch.max_rel_err == pytest.approx(0.1)
    assert (mismatch.expected, mismatch.got) == (5.0, 5.5)
    assert "2 of 6 elements off" in mismatch.describe()


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
                  message="fine", details={"rank": 1}, mode="cpu", world_size=2, num_trials=3, speedup=float("inf"))
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
    assert rows[0].details == {"rank": 1} and rows[0].schema_version == SCHEMA_VERSION
    raw = sqlite3.connect(tmp_path / "r.sqlite").execute("SELECT speedup, status, pkb_version FROM results").fetchall()
    assert raw[0][0] is None and raw[1][1] == "mismatch" and raw[0][2]


def test_a_database_from_a_newer_pkb_is_refused(tmp_path):
    path = tmp_path / "new.sqlite"
    sqlite3.connect(path).execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer than this pkb"):
        ResultStore(path)


# -- command line -----------------------------------------------------------------------------------


def pkb(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pkb.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


def test_list_json_has_the_documented_fields():
    out = pkb("list", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert {"name", "upstream_id", "category", "version", "world_sizes"} <= set(rows[0])
    assert rows[0]["name"] == "allreduce" and rows[0]["upstream_id"] == 1


def test_show_prints_reference_per_rank_inputs_and_cost_even_for_a_gib_case():
    out = pkb("show", "2", "--case", "bf16_1GiB", "--world-size", "8")
    assert out.returncode == 0, out.stderr
    assert "def reference(tensor)" in out.stdout
    assert "rank 7: tensor=bfloat16[524288, 1024]" in out.stdout
    assert "link 7 GiB" in out.stdout


def test_eval_exit_codes_and_json_status(tmp_path):
    good = pkb("eval", "allreduce", str(REPO / "pkb/solutions/1_allreduce_two_step.py"), "--json", "--trials", "1")
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["status"] == "ok"

    wrong = tmp_path / "wrong.py"
    wrong.write_text("def solution(tensor):\n    return tensor.clone()\n")
    bad = pkb("eval", "1", str(wrong), "--world-size", "4", "--trials", "1")
    assert bad.returncode == 1
    assert "mismatch" in bad.stdout and "rank 0" in bad.stdout and "elements off" in bad.stdout

    assert pkb("eval", "nonexistent", str(wrong)).returncode == 2
    missing = pkb("eval", "1", str(tmp_path / "missing.py"))
    assert missing.returncode == 2 and "not found" in missing.stderr
    no_gpu = pkb("eval", "1", str(wrong), "--mode", "cuda")
    assert no_gpu.returncode == 2 and "this machine can run --mode cpu" in no_gpu.stderr


def test_skipped_only_when_the_candidate_needs_a_gpu(tmp_path):
    """cpu mode skips what it cannot run, decided by what the candidate does, not by words in its source."""
    needs_gpu = tmp_path / "1_allreduce_cuda.py"
    needs_gpu.write_text("import torch\nimport torch.distributed as dist\n"
                         "def solution(tensor):\n    out = tensor.to('cuda')\n    dist.all_reduce(out)\n    return out\n")
    out = pkb("eval", "1", str(needs_gpu), "--json")
    result = json.loads(out.stdout)
    assert result["status"] == "skipped" and "needs a GPU" in result["message"], out.stdout
    assert out.returncode == 1

    cuda_only_on_gpu = tmp_path / "1_allreduce_portable.py"  # mentions CUDA, runs the CPU path here
    cuda_only_on_gpu.write_text("import torch\nimport torch.distributed as dist\n"
                                "def solution(tensor):\n    out = tensor.clone()\n"
                                "    if out.is_cuda:\n        torch.cuda.synchronize()\n"
                                "    dist.all_reduce(out)\n    return out\n")
    out = pkb("eval", "1", str(cuda_only_on_gpu), "--json", "--trials", "1")
    assert json.loads(out.stdout)["status"] == "ok", out.stdout

    declared = tmp_path / "1_allreduce_declared.py"
    declared.write_text("REQUIRES = ('cuda',)\ndef solution(tensor):\n    raise AssertionError('never run')\n")
    out = pkb("eval", "1", str(declared), "--json")
    assert json.loads(out.stdout)["status"] == "skipped", out.stdout

    wrong = tmp_path / "1_allreduce_wrong.py"  # an ordinary failure stays a failure
    wrong.write_text("def solution(tensor):\n    raise RuntimeError('CUDA error: an illegal memory access')\n")
    out = pkb("eval", "1", str(wrong), "--json")
    assert json.loads(out.stdout)["status"] == "runtime_error", out.stdout


def test_perf_runs_in_cpu_mode_and_is_labelled(tmp_path):
    out = pkb("eval", "reducescatter", "reference", "--perf", "--trials", "1", "--json")
    result = json.loads(out.stdout)
    assert result["status"] == "ok" and result["times_are_gpu_performance"] is False
    assert len(result["timings"]) == 4 and all(t["candidate_s"] > 0 and t["reference_s"] > 0 for t in result["timings"])
    assert result["speedup"] > 0


def test_run_resumes_and_stores_each_result(tmp_path):
    db = tmp_path / "runs.sqlite"
    first = pkb("run", "--problems", "1-2", "--db", str(db), "--json", "--trials", "1")
    assert first.returncode == 0, first.stderr
    rows = json.loads(first.stdout)
    assert [(r["problem"], r["solution"], r["status"]) for r in rows] == [
        ("allreduce", "reference", "ok"), ("allreduce", "1_allreduce_cuda_peer", "skipped"),
        ("allreduce", "1_allreduce_two_step", "ok"), ("allgather", "reference", "ok"),
        ("allgather", "2_allgather_cuda_peer", "skipped")]

    second = pkb("run", "--problems", "1-3", "--db", str(db), "--trials", "1")
    assert second.returncode == 0, second.stderr
    assert second.stderr.count("(stored earlier)") == 5
    count = sqlite3.connect(db).execute("SELECT COUNT(*) FROM results").fetchone()[0]
    assert count == 7  # the five from before, plus broadcast's self-check and its shipped solution


def test_an_interrupted_run_keeps_what_finished_and_resumes(tmp_path):
    db = tmp_path / "interrupted.sqlite"
    command = [sys.executable, "-m", "pkb.cli", "run", "--problems", "collectives", "--db", str(db), "--trials", "2"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    count = 0
    while time.monotonic() < deadline and count < 2:
        time.sleep(0.2)
        if db.exists():
            try:
                count = sqlite3.connect(db).execute("SELECT COUNT(*) FROM results").fetchone()[0]
            except sqlite3.OperationalError:
                count = 0
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    stored = sqlite3.connect(db).execute("SELECT COUNT(*) FROM results").fetchone()[0]
    assert stored >= 2
    resumed = pkb("run", "--problems", "collectives", "--db", str(db), "--trials", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("(stored earlier)") == stored
    # eight self-checks, the portable all-reduce, eight GPU solutions (skipped here)
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM results").fetchone()[0] == 17


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
    from pkb.cli import build_parser, make_config
    from pkb.runtime import sandbox
    from pkb.runtime.modes import Mode

    calls: list = []
    parse = lambda *extra: build_parser().parse_args(["eval", "1", "reference", "--mode", "cpu", *extra])  # noqa: E731
    assert parse().sandbox == "auto"
    with pytest.raises(SystemExit) as exit_info:
        parse("--sandbox", "loose")
    assert exit_info.value.code == 2

    monkeypatch.setattr(sandbox, "check_sandbox", fake_check(calls))
    config = make_config(parse("--sandbox", "required"), 2)
    assert config.sandbox == "required" and calls == [("required", Mode.CPU)]
    assert f"sandbox: required (full: {', '.join(sandbox.PROTECTIONS)})" in capsys.readouterr().err

    monkeypatch.setattr(sandbox, "check_sandbox", fake_check(calls, {"network-namespace": "no user namespaces"}))
    assert make_config(parse(), 2).sandbox == "auto"
    assert "sandbox: auto (partial; missing: network-namespace (no user namespaces))" in capsys.readouterr().err
    assert make_config(parse("--json"), 2).sandbox == "auto" and capsys.readouterr().err == ""

    calls.clear()
    assert make_config(parse("--sandbox", "off"), 2).sandbox == "off"
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
    from pkb.batch import evaluation_key
    from pkb.evaluate.candidate import Candidate
    from pkb.evaluate.evaluator import EvalConfig
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
    """Answers every task ``ok`` at once and remembers which tasks it was given (no rank processes)."""

    name = "recording"

    def __init__(self):
        self.submitted: list = []
        self._queue: list = []

    def submit(self, task) -> None:
        self.submitted.append(task)
        self._queue.append(task)

    @property
    def pending(self) -> int:
        return len(self._queue)

    def finished(self, wait: bool = True):
        from pkb.evaluate.evaluator import new_result

        while self._queue:
            task = self._queue.pop(0)
            yield task, new_result(task.problem, task.candidate, task.config, Status.OK)


def test_a_result_of_sandbox_off_is_never_resumed_by_a_sandboxed_run(tmp_path):
    from pkb.batch import Job, run_jobs
    from pkb.evaluate.candidate import Candidate
    from pkb.evaluate.evaluator import EvalConfig
    from pkb.registry import get_problem
    from pkb.runtime.modes import Mode

    problem = get_problem("allreduce")
    jobs = [Job(problem, Candidate.reference_of(problem), "reference")]

    def evaluated(level: str) -> int:
        executor = RecordingExecutor()
        with ResultStore(tmp_path / "r.sqlite") as store:
            run_jobs(jobs, EvalConfig(2, Mode.CPU, sandbox=level), store, executor=executor)
        return len(executor.submitted)

    assert evaluated("off") == 1 and evaluated("off") == 0  # resumed at the same level
    assert evaluated("auto") == 1 and evaluated("auto") == 0  # the unconfined result is not reused
    assert evaluated("required") == 1 and evaluated("off") == 0
