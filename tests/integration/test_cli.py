"""The command line as a user runs it (``python -m pkb.cli``, a process each): ``list``, ``show``, ``eval``'s
exit codes and JSON, what cpu mode skips, ``--perf`` in cpu mode, and runs that resume, after an interruption
too."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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


# -- the timeout bounds loading (issue 49) -------------------------------------------------------------------


HANGS_AT_IMPORT = "import time\n\ntime.sleep(3600)  # never gets past its import\n\n\ndef solution(tensor):\n" \
                  "    return tensor\n"


def test_a_candidate_that_hangs_at_import_times_out_within_the_users_timeout(tmp_path):
    hangs = tmp_path / "1_allreduce_hangs.py"
    hangs.write_text(HANGS_AT_IMPORT)
    started = time.monotonic()
    out = pkb("eval", "1", str(hangs), "--mode", "cpu", "--timeout", "20", "--trials", "1", "--json", timeout=75)
    assert time.monotonic() - started < 60
    result = json.loads(out.stdout)
    assert out.returncode == 1 and result["status"] == "timeout", out.stdout + out.stderr
    assert "loading the candidate" in result["message"] and "within 20 s" in result["message"]
