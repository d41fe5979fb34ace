"""What every attack in this folder shares. tests/integration/test_containment.py writes a candidate file as
this prelude, with ARENA, MARKER and HINTS filled in, followed by one attack's file (which uses the names
defined here).

An attack is a candidate for problem 1 (``allreduce``). On its first call, on rank 0, it tries to escape its
evaluation, then raises ``RuntimeError("ATTACK-REPORT {json}")``: a ``runtime_error`` verdict whose
``details["error"]`` says what it managed (``done``: label -> what), what was refused (``failed``: label ->
the error) and what it left alone (``skipped``: label -> why). The other ranks answer zeros.

Harmless even where nothing contains it:
- as shipped (ARENA empty) an attack is disarmed: it changes nothing outside its own process;
- it writes, replaces or chmods only paths inside ARENA (the test's throw-away directory: a copy of pkb, its
  database, caches and home), and files named after MARKER in /tmp, /dev/shm and its own $TMPDIR;
- it signals only processes below the test (``HINTS["test_pid"]``) that descend from the grader the test
  started (whose command line names ARENA), ptraces only processes below the test, and reads the memory and
  environment of the test's own processes only;
- whatever it starts carries MARKER (as its name or argv[0]) and ends by itself within a minute.
"""

import ctypes
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

ARENA = ""  # the test's throw-away directory ("" = disarmed)
MARKER = "pkbatk-unarmed"  # names what an attack leaves behind: files, processes (at most 15 characters)
HINTS: dict = {}  # what the test knows (paths, pids, ports): an attacker could guess as much

LIBC = ctypes.CDLL(None, use_errno=True)


def armed() -> bool:
    return os.path.isabs(ARENA)


def in_arena(path: str) -> bool:
    if not armed():
        return False
    root, real = os.path.realpath(ARENA), os.path.realpath(path)
    return real == root or real.startswith(root + os.sep)


def may_write(path: str) -> bool:
    """Inside ARENA, or a MARKER-named file directly in /tmp, /dev/shm or this process's own $TMPDIR."""
    if not armed():
        return False
    if os.path.basename(path).startswith(MARKER):
        directory = os.path.dirname(os.path.abspath(path))
        if directory in ("/tmp", "/dev/shm", os.path.abspath(tempfile.gettempdir())):
            return True
    return in_arena(path)


def marked(directory: str, label: str) -> str:
    return os.path.join(directory, f"{MARKER}-{label}")


def sysv_key(label: str) -> int:
    """A System V IPC key named by MARKER and ``label`` (what shmget takes: the machine's segments are found by it)."""
    import zlib

    return zlib.crc32(f"{MARKER}-{label}".encode()) & 0x7FFFFFFF  # as tests/helpers/containment.py's sysv_key


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# -- processes, as /proc shows them ------------------------------------------------------------------


def proc_bytes(pid: int, name: str) -> bytes | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return None


def argv_of(pid: int) -> list[str]:
    data = proc_bytes(pid, "cmdline") or b""
    return [part.decode(errors="replace") for part in data.split(b"\0") if part]


def environ_of(pid: int) -> dict[str, str]:
    data = proc_bytes(pid, "environ") or b""
    pairs = (part.decode(errors="replace").partition("=") for part in data.split(b"\0") if b"=" in part)
    return {key: value for key, _, value in pairs}


def parent_of(pid: int) -> int:
    stat = proc_bytes(pid, "stat")
    try:
        return int(stat.rsplit(b")", 1)[1].split()[1]) if stat else 0
    except (IndexError, ValueError):
        return 0


def ancestors(pid: int) -> list[int]:
    """``pid``'s parent, grandparent, ... as far as this process can see (pid 0 or 1 ends the chain)."""
    chain = []
    pid = parent_of(pid)
    while pid > 1 and pid not in chain and len(chain) < 64:
        chain.append(pid)
        pid = parent_of(pid)
    return chain


def all_pids() -> list[int]:
    try:
        return sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return []


def names_arena(pid: int) -> bool:
    return armed() and any(ARENA in arg for arg in argv_of(pid))


def find_grader() -> int | None:
    """The pkb process the test started: the nearest ancestor whose command line names ARENA, else any
    process below the test that does (a real attacker would take any ``pkb`` process)."""
    for pid in ancestors(os.getpid()):
        if names_arena(pid):
            return pid
    for pid in all_pids():
        if pid != os.getpid() and names_arena(pid) and below_test(pid):
            return pid
    return None


def below_test(pid: int) -> bool:
    """A strict descendant of the test process (never the test itself, never pid 1)."""
    return armed() and pid > 1 and HINTS.get("test_pid") in ancestors(pid)


def below_grader(pid: int) -> bool:
    """The grader the test started, or a process it started (its zygote, its rank processes)."""
    return below_test(pid) and any(names_arena(p) for p in [pid, *ancestors(pid)])


def log_dir_of(pid: int) -> str | None:
    """Where a rank process's stdout goes: pkb's per-group log directory (pkb-reference-*, pkb-candidate-*)."""
    try:
        return os.path.dirname(os.readlink(f"/proc/{pid}/fd/1"))
    except OSError:
        return None


def find_zygote(grader: int | None) -> int | None:
    """pkb's rank-process server: a child of the grader (or of the test) running pkb.runtime.zygote."""
    owners = {grader, HINTS.get("test_pid")} - {None}
    for pid in [*ancestors(os.getpid()), *all_pids()]:
        if parent_of(pid) in owners and any("pkb.runtime.zygote" in arg for arg in argv_of(pid)):
            return pid
    return None


def find_reference_ranks(zygote: int | None) -> list[int]:
    """The trusted reference ranks: children of the zygote that log into a pkb-reference-* directory."""
    if zygote is None:
        return []
    return [pid for pid in all_pids() if parent_of(pid) == zygote and "pkb-reference-" in (log_dir_of(pid) or "")]


def current_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def attack_solution(attack, on_rank: int = 0):
    """A ``solution(tensor)`` that runs ``attack()`` (returning the report dict) once, on rank ``on_rank``, and
    raises the report; every other call answers zeros."""
    calls = []

    def solution(tensor):
        calls.append(1)
        if len(calls) == 1 and current_rank() == on_rank:
            report = attack()
            raise RuntimeError("ATTACK-REPORT " + json.dumps(report, default=str, sort_keys=True))
        return torch.zeros_like(tensor)

    return solution


def new_report(name: str) -> dict:
    return {"attack": name, "armed": armed(), "done": {}, "failed": {}, "skipped": {}}
