"""The candidate sandbox's parts (pkb.runtime.sandbox, confine, jail, builds), on the CPU.

tests/integration/test_containment.py runs whole attacks through ``pkb run``; these check the mechanisms one
by one: what the machine offers and what ``required`` does with it, the seccomp filter, the tree of
processes ended with and without a pid namespace, the build broker's cache, and what an evaluation leaves
behind. The checks that need no process (build requests, scratch removal): tests/unit/test_sandbox_checks.py.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.evaluate.session import Session
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime import confine, sandbox
from pkb.runtime.modes import Mode

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux's")
FULL_SET_HERE = os.geteuid() == 0 and sandbox.landlock_abi() >= 6 and all(
    why is None for why in sandbox._namespaces_offered().values())

HONEST = """
import torch.distributed as dist

def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return out
"""


def _evaluate(tmp_path, body: str, level: str = "auto", name: str = "allreduce_probe.py", trials: int = 1):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    config = EvalConfig(world_size=2, mode=Mode.CPU, trials=trials, cases="upstream", sandbox=level)
    return evaluate(get_problem("allreduce"), Candidate.from_file(path), config)


def _processes_named(marker: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if Path(entry.path, "comm").read_text().strip() == marker:
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


# -- what the machine offers ---------------------------------------------------------------------------


@pytest.mark.skipif(not FULL_SET_HERE, reason="needs root, Landlock ABI 6 and namespaces (CI has them)")
def test_root_on_a_landlock_kernel_gets_the_full_set_and_every_result_says_so(tmp_path):
    assert sandbox.check_sandbox("required").full
    result = _evaluate(tmp_path, HONEST, level="required")
    assert result.status is Status.OK, result.message
    assert result.details.sandbox["full"] is True
    assert set(result.details.sandbox["enforced"]) == set(sandbox.PROTECTIONS)


def test_required_refuses_a_machine_without_the_full_set_and_says_what_is_missing(monkeypatch):
    partial = sandbox.SandboxStatus("required", ["rlimits"], {"landlock-fs": "this kernel has no Landlock"})
    monkeypatch.setattr(sandbox, "offered", lambda level: partial)
    with pytest.raises(sandbox.SandboxUnavailable, match="landlock-fs: this kernel has no Landlock"):
        sandbox.check_sandbox("required")
    assert sandbox.check_sandbox("auto") is partial  # auto goes on with what there is
    with pytest.raises(sandbox.SandboxUnavailable):
        Session(Mode.CPU, 2, "required")


def test_off_records_that_nothing_was_enforced(tmp_path):
    result = _evaluate(tmp_path, HONEST, level="off")
    assert result.status is Status.OK, result.message
    assert result.details.sandbox["full"] is False and result.details.sandbox["enforced"] == []
    assert set(result.details.sandbox["missing"]) == set(sandbox.PROTECTIONS)


@pytest.mark.skipif(sandbox.landlock_abi() < 3, reason="needs Landlock")
def test_a_protection_left_out_by_the_environment_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("PKB_SANDBOX_SKIP", "seccomp")
    result = _evaluate(tmp_path, HONEST)
    assert result.status is Status.OK, result.message
    assert result.details.sandbox["missing"].get("seccomp") == "left out by PKB_SANDBOX_SKIP"
    assert "seccomp" not in result.details.sandbox["enforced"]
    monkeypatch.setenv("PKB_SANDBOX_SKIP", "no-such-protection")
    with pytest.raises(ValueError, match="unknown protections"):
        sandbox.skipped_protections()


# -- seccomp --------------------------------------------------------------------------------------------


def test_the_namespace_probe_starts_a_fresh_process_not_a_fork_of_the_caller(monkeypatch):
    """The grader may have threads (``pkb serve`` has): a fork of it may deadlock in the child. The probe
    answers the same with ``os.fork`` unavailable, from a thread, and its answer is the cached one."""
    answer = sandbox._namespaces_offered()

    def refuse_fork():
        raise AssertionError("the namespace probe forked the calling process")

    monkeypatch.setattr(os, "fork", refuse_fork)
    sandbox._namespaces_offered.cache_clear()
    try:
        probed = []
        thread = threading.Thread(target=lambda: probed.append(sandbox._namespaces_offered()))
        thread.start()
        thread.join()
        assert probed == [answer]
        if os.geteuid() == 0:  # root: every answer comes from the probe process, none assumed
            assert set(answer) == {"pid-namespace", "network-namespace", "mount-namespace"}
            assert all(why is None or why.startswith("unshare/mount refused") for why in answer.values())
    finally:
        sandbox._namespaces_offered.cache_clear()


@pytest.mark.skipif(sandbox.seccomp_arch() is None, reason="no syscall table for this machine")
def test_the_seccomp_filter_refuses_namespaces_and_mounts_and_lets_threads_and_subprocesses_run():
    pid = os.fork()
    if pid == 0:  # the child installs the filter and reports through its exit status
        code = 0
        try:
            confine._check(confine._libc.prctl(confine.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
            confine._install_seccomp()
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(confine.CLONE_NEWNS) != -1 or ctypes.get_errno() != 1:  # EPERM
                code |= 1
            if libc.mount(b"none", b"/tmp", b"tmpfs", 0, None) != -1 or ctypes.get_errno() != 1:
                code |= 2
            done = []
            thread = threading.Thread(target=lambda: done.append(1))
            thread.start()
            thread.join()
            if done != [1]:
                code |= 4
            if os.system("true") != 0:
                code |= 8
        except BaseException:
            code |= 16
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"failures bitmask {os.waitstatus_to_exitcode(status)}"


# -- nothing outlives the evaluation ---------------------------------------------------------------------

DETACHED = """
import ctypes, os, time
import torch.distributed as dist

MARKER = {marker!r}

def _detach():
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(15, MARKER.encode(), 0, 0, 0)  # PR_SET_NAME
            time.sleep(120)
        os._exit(0)
    time.sleep(0.2)

_detach()

def _name(pid):
    try:
        return open(f"/proc/{{pid}}/comm").read().strip()
    except OSError:  # a process that ended between the listing and the read (without a PID namespace: any)
        return None

def solution(tensor):
    alive = [p for p in os.listdir("/proc") if p.isdigit() and _name(p) == MARKER]
    if not alive:
        raise RuntimeError("the detached process did not start")
    out = tensor.clone()
    dist.all_reduce(out)
    return out
"""


@pytest.mark.skipif(sandbox.landlock_abi() < 3, reason="needs Landlock")
@pytest.mark.parametrize("skip", ["", "pid-namespace,mount-namespace"], ids=["pid-namespace", "subreaper"])
def test_a_double_forked_setsid_process_dies_with_its_evaluation(tmp_path, monkeypatch, skip):
    monkeypatch.setenv("PKB_SANDBOX_SKIP", skip)
    marker = f"pkbdet{os.getpid() % 10000}{len(skip)}"
    result = _evaluate(tmp_path, DETACHED.format(marker=marker))
    try:
        assert result.status is Status.OK, result.message  # the process existed while the candidate ran
        if skip:
            assert "pid-namespace" in result.details.sandbox["missing"]
        deadline = time.monotonic() + 5
        while _processes_named(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_named(marker) == []
    finally:
        for pid in _processes_named(marker):
            os.kill(pid, 9)


# -- the build broker ---------------------------------------------------------------------------------

BUILDS = """
import os, time
import torch.distributed as dist
from pkb.kernels import load_cuda

_began = time.monotonic()
_module = load_cuda("pkb_sandbox_test_add", "", cpp_sources="int add_one(int x) {{ return x + 1; }} // {salt}",
                    functions=["add_one"], with_cuda=False)
_seconds = time.monotonic() - _began
_tamper = {tamper!r}
if _tamper:
    with open(_module.__file__, "wb") as handle:  # plant something else under this build's name
        handle.write(b"not an ELF file")

def solution(tensor):
    assert _module.add_one(41) == 42
    print("build seconds", _seconds, flush=True)
    out = tensor.clone()
    dist.all_reduce(out)
    return out
"""


@pytest.mark.skipif(not shutil.which("g++") or not shutil.which("ninja"), reason="needs g++ and ninja")
@pytest.mark.skipif(sandbox.landlock_abi() < 3, reason="needs Landlock")
def test_the_broker_builds_once_and_no_candidate_can_write_what_another_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    salt = f"{os.getpid()}-{time.time()}"
    with Session(Mode.CPU, 2, "auto") as session:
        config = EvalConfig(world_size=2, mode=Mode.CPU, trials=1, cases="upstream")
        honest, attacker = tmp_path / "honest.py", tmp_path / "attacker.py"
        honest.write_text(BUILDS.format(salt=salt, tamper=False))
        attacker.write_text(BUILDS.format(salt=salt, tamper=True))
        problem = get_problem("allreduce")
        first = evaluate(problem, Candidate.from_file(honest), config, session)
        assert first.status is Status.OK, first.message
        libraries = list((tmp_path / "extensions" / "pkb-broker").glob("*/*.so"))
        assert len(libraries) == 1, libraries
        before = hashlib.sha256(libraries[0].read_bytes()).hexdigest()
        attacked = evaluate(problem, Candidate.from_file(attacker), config, session)
        assert attacked.status is not Status.OK
        assert "Permission denied" in attacked.message or "Read-only" in attacked.message, attacked.message
        assert hashlib.sha256(libraries[0].read_bytes()).hexdigest() == before
        began = time.monotonic()
        again = evaluate(problem, Candidate.from_file(honest), config, session)
        assert again.status is Status.OK, again.message
        assert time.monotonic() - began < 20  # loaded from the cache: the first build took far longer
        assert list((tmp_path / "extensions" / "pkb-broker").glob("*/*.so")) == libraries


@pytest.mark.skipif(not shutil.which("g++") or not shutil.which("ninja"), reason="needs g++ and ninja")
@pytest.mark.skipif(sandbox.landlock_abi() < 3, reason="needs Landlock")
def test_a_build_nobody_waits_for_any_more_is_stopped_with_its_evaluation(tmp_path, monkeypatch):
    """A candidate whose evaluation ends while its extension builds (here: its other rank fails at once)
    takes the build with it: no build slot stays busy beyond its evaluation (a candidate cannot starve
    later ones of builds). Its waiting for the build is not counted against it, but it gains nothing."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    path = tmp_path / "slow_build.py"
    path.write_text("import torch.distributed as dist\nif dist.get_rank() == 1:\n    raise RuntimeError('rank 1 gives up')\n"
                    + BUILDS.format(salt=f"{os.getpid()}-{time.time()}-slow", tamper=False))
    with Session(Mode.CPU, 2, "auto") as session:
        config = EvalConfig(world_size=2, mode=Mode.CPU, trials=1, cases="upstream")
        began = time.monotonic()
        result = evaluate(get_problem("allreduce"), Candidate.from_file(path), config, session)
        assert result.status is Status.IMPORT_ERROR and "rank 1 gives up" in result.message, result.message
        assert time.monotonic() - began < 15  # ended with the failure, not after the build
        broker = session._broker
        deadline = time.monotonic() + 10
        while (broker._running or not all(build.done() for build in broker._builds.values())) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert broker._running == {} and all(build.done() for build in broker._builds.values())
        assert not list((tmp_path / "extensions" / "pkb-broker").glob("*/*.so"))  # killed before it finished


NOISY = HONEST.replace("def solution(tensor):", """
import os, sys


def solution(tensor):
    sys.stdout.write("x" * (1 << 20) + "\\n")  # a MiB of output on every call
    with open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "scratch.bin"), "wb") as handle:
        handle.write(os.urandom(1 << 20))""")


@pytest.mark.parametrize("level", ["auto", "off"])
def test_nothing_of_an_evaluation_outlives_it_on_disk(tmp_path, monkeypatch, level):
    """Every rank's log and the sandbox's scratch directory are removed with the group (before: one log
    folder per group stayed in the temporary directory, as large as the candidate made its output); the
    end of the output is kept for the messages that quote it."""
    import tempfile

    from pkb.runtime.group import finish_teardowns

    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    path = tmp_path / "allreduce_noisy.py"
    path.write_text(NOISY)
    config = EvalConfig(world_size=2, mode=Mode.CPU, trials=1, cases="upstream", sandbox=level)
    with Session(Mode.CPU, 2, level) as session:
        result = evaluate(get_problem("allreduce"), Candidate.from_file(path), config, session)
        assert result.status is Status.OK, result.message
    finish_teardowns()
    assert sorted(p.name for p in temporary.iterdir()) == []


def test_a_scratch_directory_holds_nothing_a_candidate_can_import(tmp_path):
    """pkb's folders in a candidate's scratch directory (its working directory) have names no import can
    reach, and the working directory is not on the import path: before, ``import triton`` found pkb's
    Triton cache folder as an empty namespace package where Triton is not installed."""
    import importlib.util

    triton_here = importlib.util.find_spec("triton") is not None
    result = _evaluate(tmp_path, HONEST.replace("def solution(tensor):", f"""
import importlib.util, os, sys


def solution(tensor):
    here = os.path.realpath(os.getcwd())
    on_path = [entry for entry in sys.path if os.path.realpath(entry or ".") == here]
    importable = [name for name in os.listdir(here) if name.isidentifier()]
    triton = importlib.util.find_spec("triton") is not None
    if on_path or importable or triton != {triton_here}:
        raise RuntimeError(f"working directory on the path: {{on_path}}; importable there: {{importable}}; "
                           f"triton found: {{triton}}")"""))
    assert result.status is Status.OK, result.message
