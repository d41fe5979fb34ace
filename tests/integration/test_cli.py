"""The command line as a user runs it (``python -m pkb.cli``, a process each): ``list``, ``show``, ``eval``'s
exit codes and JSON, what cpu mode skips, ``--perf`` in cpu mode, and runs that resume, after an interruption
too."""

from __future__ import annotations

import json
import os
import resource
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("argv, said", [
    (["eval", "nonexistent", "x.py"], "unknown problem 'nonexistent'; `pkb list` shows all"),
    (["eval", "allreduse", "x.py"], "unknown problem 'allreduse'; did you mean 1 allreduce"),
    (["run", "--problems", "999"], "unknown problem '999'; `pkb list` shows all"),
    (["eval", "1", "x.py", "--world_size", "4"], "did you mean --world-size? (`pkb eval --help`"),
])
def test_a_usage_error_is_said_in_a_fraction_of_a_second_without_importing_torch(argv, said):
    """As a user types it (issue 54.3): exit 2 and what to give instead, with torch never imported (``-X importtime``
    lists every module the process imports) and well under a second of CPU (CPU, not wall time: the machine may
    be busy with other tests)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "pkb", *argv], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    wall_s = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert out.returncode == 2 and said in out.stderr, out.stderr[-2000:]
    assert "pkb.cli" in imported and "torch" not in imported
    assert cpu_s < 1.0, f"{cpu_s:.2f} s of CPU, {wall_s:.2f} s wall"


def test_skipped_only_when_the_candidate_needs_a_gpu(tmp_path):
    """cpu mode skips what it cannot run, decided by what the candidate does, not by words in its source."""
    needs_gpu = tmp_path / "1_allreduce_cuda.py"
    needs_gpu.write_text("import torch\nimport torch.distributed as dist\n"
                         "def solution(tensor):\n    out = tensor.to('cuda')\n    dist.all_reduce(out)\n    return out\n")
    out = pkb("eval", "1", str(needs_gpu), "--json")
    result = json.loads(out.stdout)
    assert result["status"] == "skipped" and "needs a GPU" in result["message"], out.stdout
    assert out.returncode == 0  # no failure, as in `pkb run` (README, "Verdicts and exit codes")

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
    """Off a GPU, --perf times the cases the run checks (what --cases asked for), each call on an input copy of its
    own, and says the times are not GPU performance."""
    out = pkb("eval", "reducescatter", "reference", "--perf", "--trials", "1", "--cases", "tests", "--json")
    result = json.loads(out.stdout)
    assert result["status"] == "ok" and result["times_are_gpu_performance"] is False
    assert [t["case"] for t in result["timings"]] == result["cases"]
    assert all(t["candidate_s"] > 0 and t["reference_s"] > 0 and t["calls_per_repeat"] >= 2 for t in result["timings"])
    assert result["speedup"] > 0
    text = pkb("eval", "reducescatter", "reference", "--perf", "--trials", "1", "--cases", "tests").stdout
    assert "not GPU performance" in text


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
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=as_from_a_terminal)
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


def test_ctrl_c_is_one_line_from_pkb_and_no_traceback_from_its_children(tmp_path):
    """Ctrl-C signals the terminal's whole foreground process group, pkb's children too: pkb says its one line and
    ends with 130, and no child prints a traceback of its own."""
    hangs = tmp_path / "hangs.py"
    hangs.write_text("import time\n\n\ndef solution(tensor):\n    time.sleep(3600)\n")
    process = subprocess.Popen([sys.executable, "-m", "pkb", "eval", "1", str(hangs), "--timeout", "300"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=as_from_a_terminal)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any("pkb.runtime.zygote" in line for line in command_lines_below(
            process.pid)):
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)  # as the terminal does on Ctrl-C
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and stderr.rstrip().endswith("pkb: interrupted"), stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr


def as_from_a_terminal() -> None:
    """In the child before it runs: Ctrl-C's signal as a shell leaves it to a command it starts (default action, not
    blocked). A test worker's own signal state is inherited otherwise: in the full suite's workers pkb started with
    SIGINT never delivered (neither the KeyboardInterrupt nor a wakeup byte came), which no terminal does."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def pids_below(pid: int) -> set[int]:
    """Every process descended from ``pid`` (read from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    below, found = {pid}, True
    while found:
        found = {child for child, parent in parents.items() if parent in below} - below
        below |= found
    return below - {pid}


def command_lines_below(pid: int) -> list[str]:
    """The command lines of every process descended from ``pid`` (read from /proc)."""
    lines = []
    for child in pids_below(pid):
        try:
            lines.append((Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return lines


def test_a_candidate_that_spins_dies_with_a_pkb_ended_by_sigterm(tmp_path):
    """SIGTERM (what `timeout`, CI's cancel and systemd send) ends pkb at once; every process of the evaluation ends
    with it. A rank's keeper changes to the candidate's uid, which clears the parent-death signal: it and the ranks
    spinning below it outlived pkb (a new user's walk through the docs, issue 54), until the signal was set again
    after the change."""
    spins = tmp_path / "spins.py"
    spins.write_text("def solution(tensor):\n    while True:\n        pass\n")
    process = subprocess.Popen([sys.executable, "-m", "pkb", "eval", "1", str(spins), "--timeout", "300", "--mode",
                                "cpu"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, below = time.monotonic() + 120, set()
    while time.monotonic() < deadline and len(below) < 6:  # the zygote, the jail, the keeper, the ranks
        time.sleep(0.5)
        below = pids_below(process.pid)
    assert len(below) >= 3, below
    time.sleep(2.0)  # the candidate's ranks are spinning in solution()
    below = pids_below(process.pid)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in below):
        time.sleep(0.2)
    left = [pid for pid in below if Path(f"/proc/{pid}").exists()]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} of the evaluation's {len(below)} processes outlived pkb"


def test_a_candidate_imports_from_the_graders_paths_not_from_a_folder_it_adds(tmp_path):
    """docs/usage.md, "What a candidate can import": a sandboxed rank reads the grader's import paths, PYTHONPATH
    included, and not a folder the candidate puts on ``sys.path`` itself."""
    library = tmp_path / "lib"
    library.mkdir()
    (library / "mylib.py").write_text("import torch.distributed as dist\n\n\ndef all_reduced(tensor):\n"
                                      "    out = tensor.clone()\n    dist.all_reduce(out)\n    return out\n")
    uses = "from mylib import all_reduced\n\n\ndef solution(tensor):\n    return all_reduced(tensor)\n"
    adds_its_path = tmp_path / "adds_its_path.py"
    adds_its_path.write_text(f"import sys\n\nsys.path.insert(0, {str(library)!r})\n" + uses)
    own = pkb("eval", "1", str(adds_its_path), "--trials", "1", "--sandbox", "required", "--json")
    if own.returncode == 2:
        pytest.skip(f"this machine cannot sandbox fully: {json.loads(own.stdout)['message']}")
    refused = json.loads(own.stdout)
    assert refused["status"] == "import_error" and "No module named 'mylib'" in refused["message"], own.stdout

    uses_the_library = tmp_path / "uses_the_library.py"
    uses_the_library.write_text(uses)
    given = subprocess.run([sys.executable, "-m", "pkb", "eval", "1", str(uses_the_library), "--trials", "1",
                            "--cases", "tests", "--sandbox", "required", "--json"], capture_output=True, text=True, cwd=REPO, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(library)})
    assert json.loads(given.stdout)["status"] == "ok", given.stdout + given.stderr


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


def test_ctrl_c_ends_pkb_even_where_its_main_thread_does_not_see_the_interrupt():
    """A main thread stuck where the KeyboardInterrupt never reaches pkb's handler (here: swallowed) would let the
    evaluation go on after Ctrl-C: pkb's own watcher says the line and exits 130 after its grace."""
    script = ("import sys, time, pkb.cli as cli\n"
              "cli.INTERRUPT_GRACE_S = 1.0\n"
              "cli._exit_after_an_interrupt_that_does_not_end_pkb()\n"
              "said = False\n"
              "while True:\n"
              "    try:\n"
              "        if not said:  # inside the try: a Ctrl-C right after the line is swallowed too\n"
              "            said = True\n"
              "            print('ready', flush=True)\n"
              "        time.sleep(100)\n"
              "    except KeyboardInterrupt:\n"
              "        pass\n")
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_terminal)
    assert process.stdout.readline().strip() == "ready"
    began = time.monotonic()
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130 and stderr.strip() == "pkb: interrupted", stderr
    assert 1.0 <= time.monotonic() - began < 30
