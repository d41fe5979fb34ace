"""Containment: candidates that try to escape their evaluation, run against a throw-away copy of pkb.

The attacks are candidate files for problem 1 (allreduce) in tests/candidates/attacks/ (their prelude says
how each stays harmless when nothing contains it). Each kind of damage is first shown to be real with
``--sandbox off`` (pkb's comparison rewritten, a forged row written by a process that outlived its
evaluation, the grader killed, files written outside, other processes' memory read), then the same attacks
run under the default sandbox, where nothing of the sort may happen: every file of a ``pkb run`` gets its
own verdict and no attacker's is ``ok``, pkb's source, the database and the build caches are as they were,
nothing an attacker started is still alive, nothing was written outside its scratch directory.

``pkb`` runs from a copy of the package in a tmp directory (PYTHONPATH), with its home, temporary directory,
build caches, working directory and database there too; the attacks act only inside that directory, in
files named after a marker in /tmp and /dev/shm, and on processes below the test that descend from the
``pkb`` it started.
"""

from __future__ import annotations

import compileall
import ctypes
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest

import pkb
from pkb.solution_files import solution_files
from pkb.evaluate.candidate import Candidate
from pkb.evaluate.config import EvalConfig
from pkb.evaluate.evaluator import evaluate
from pkb.evaluate.session import Session
from pkb.options import Status
from pkb.registry import get_problem
from pkb.runtime.modes import Mode
from helpers.containment import (ATTACK_ORDER, ATTACKS, CONTAINED, nothing_done, remove_sysv_segment,
                                 shm_plant_contained)
from helpers.sources import HONEST_ALLREDUCE

PKB_PACKAGE = Path(pkb.__file__).resolve().parent
# The mode of the whole-run test: cpu in CI; shared-gpu on a GPU machine, for device evidence.
RUN_MODE = os.environ.get("PKB_CONTAINMENT_MODE", "cpu")

WRONG = """
import torch

def solution(tensor):
    return torch.zeros_like(tensor)
"""

RUN_TIMEOUT_S = 420  # a whole `pkb run` of the attack folder; it takes well under a minute when contained
LEFTOVER_GRACE_S = 10.0  # how long processes of an ended evaluation may take to disappear


def landlock_abi() -> int:
    """The kernel's Landlock ABI (landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)); 0: none."""
    if sys.platform != "linux":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return max(int(libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))), 0)


pytestmark = pytest.mark.skipif(sys.platform != "linux",
                                reason="containment relies on Linux (Landlock, namespaces, /proc)")
needs_landlock = pytest.mark.skipif(landlock_abi() == 0, reason="this kernel has no Landlock (not built in, or not "
                                                                "in the lsm= boot list): pkb cannot sandbox here")


# -- the sandbox's interface (pkb.runtime.sandbox; one place to adapt) -------------------------------------


def sandbox_flag(level: str | None) -> list[str]:
    """``pkb eval|run`` arguments for ``--sandbox level`` (None: the default, auto)."""
    return [] if level is None else ["--sandbox", level]


def open_session(level: str) -> Session:
    return Session(Mode.CPU, 2, sandbox=level)


def eval_config(level: str, **settings) -> EvalConfig:
    return EvalConfig(**{"world_size": 2, "mode": Mode.CPU, "trials": 1, "timeout": 60.0, "sandbox": level,
                         **settings})


def expect_full_sandbox(sandbox: dict | None, what: str) -> None:
    """``details.sandbox`` of a result must show the full set: as root on a kernel with Landlock ABI 6 or later
    (this project's CI) nothing may be missing; elsewhere a partial sandbox skips the test, saying what is missing."""
    assert sandbox, f"{what}: the result carries no details.sandbox"
    if sandbox.get("full"):
        return
    if os.geteuid() == 0 and landlock_abi() >= 6:
        pytest.fail(f"{what}: the sandbox is partial as root on Landlock ABI {landlock_abi()}: {sandbox}")
    pytest.skip(f"the sandbox is partial on this machine (missing: {sandbox.get('missing')}); containment needs the "
                "full set (root, Landlock ABI 6+)")


def require_sandbox_cli(arena: "Arena") -> None:
    """Never run the attacks through a pkb without a sandbox and call it contained."""
    shown = arena.pkb("run", "--help", timeout=60)
    assert "--sandbox" in shown.stdout, "this pkb has no --sandbox option: the sandbox has not landed"


# -- the arena: a throw-away pkb, its home, caches and database ------------------------------------------


class Listener:
    """A TCP port on 127.0.0.1 and an abstract unix socket; records what arrives (the network attack)."""

    def __init__(self, marker: str):
        self.received: list[tuple[str, bytes]] = []
        self.abstract = f"pkb-containment-{marker}"
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.tcp_port = self.tcp.getsockname()[1]
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix.bind("\0" + self.abstract)
        self.unix.listen()
        self.closed = threading.Event()
        self.threads = [threading.Thread(target=self._serve, args=(name, server), daemon=True)
                        for name, server in (("tcp", self.tcp), ("abstract", self.unix))]
        for thread in self.threads:
            thread.start()

    def _serve(self, name: str, server: socket.socket) -> None:
        server.settimeout(0.2)
        while not self.closed.is_set():
            try:
                connection, _ = server.accept()
            except (socket.timeout, OSError):
                continue
            with connection:
                connection.settimeout(2)
                try:
                    self.received.append((name, connection.recv(256)))
                except OSError:
                    self.received.append((name, b""))

    def close(self) -> None:
        self.closed.set()
        for thread in self.threads:
            thread.join(timeout=2)
        self.tcp.close()
        self.unix.close()


class Arena:
    """``root``/src/pkb (a copy of pkb, byte-compiled), home, tmp, work (the cwd), solutions, results.sqlite and
    the build caches (torch_extensions, triton) with a cached extension and a Triton kernel planted in them."""

    def __init__(self, root: Path, listener: Listener | None = None, copy_pkb: bool = True):
        self.root = root
        self.marker = "pkbatk" + secrets.token_hex(4)  # 14 characters: fits a process name (comm)
        self.listener = listener
        self.src, self.home, self.tmp, self.work = root / "src", root / "home", root / "tmp", root / "work"
        self.solutions, self.db = root / "solutions", root / "work" / "results.sqlite"
        self.torch_extensions, self.triton = root / "caches" / "torch_extensions", root / "caches" / "triton"
        for directory in (self.home, self.tmp, self.work, self.solutions):
            directory.mkdir(parents=True)
        self.plant_caches()
        if copy_pkb:
            shutil.copytree(PKB_PACKAGE, self.src / "pkb", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            # byte-compiled now, so that pkb itself has no cache left to write and any change in src is an attack's
            compileall.compile_dir(self.src / "pkb", quiet=1)
            imported = self.python("-c", "import pkb; print(pkb.__file__)").stdout.strip()
            assert imported == str(self.src / "pkb" / "__init__.py"), f"the copy is not the pkb that runs: {imported}"

    def plant_caches(self) -> None:
        extension, triton_kernel = self.torch_extensions / "py311_cpu" / "fake_ext", self.triton / "3HZKQ7RCA2"
        for path, content in ((extension / "fake_ext.so", b"\x7fELF cached ext"),
                              (extension / "build.ninja", b"rule cc\n"),
                              (self.torch_extensions / "pkb" / "pkb_peer_0123abcd" / "pkb_peer.so", b"\x7fELF pkb ext"),
                              (self.torch_extensions / "pkb-broker" / "pkb_peer_0123abcd" / "pkb_peer_0123abcd.so",
                               b"\x7fELF brokered ext"),
                              (triton_kernel / "kernel.json", b'{"name": "kernel"}'),
                              (triton_kernel / "kernel.so", b"\x7fELF triton kernel")):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)

    def environment(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "PKB_"))}
        env.update(PYTHONPATH=str(self.src), HOME=str(self.home), TMPDIR=str(self.tmp),
                   XDG_CACHE_HOME=str(self.home / ".cache"), TORCH_EXTENSIONS_DIR=str(self.torch_extensions),
                   TRITON_CACHE_DIR=str(self.triton), PYTHONUNBUFFERED="1")
        return env

    def hints(self) -> dict:
        caches_env = {"TORCH_EXTENSIONS_DIR": str(self.torch_extensions), "TRITON_CACHE_DIR": str(self.triton),
                      "HOME": str(self.home)}
        hints = {"test_pid": os.getpid(), "solutions": str(self.solutions), "home": str(self.home),
                 "cwd": str(self.work), "db": str(self.db), "caches_env": caches_env}
        if self.listener is not None:
            hints.update(tcp_port=self.listener.tcp_port, abstract=self.listener.abstract)
        return hints

    def attack_source(self, attack: str) -> str:
        """The attack's candidate file: the prelude, armed for this arena, then the attack."""
        prelude = (ATTACKS / "_prelude.py").read_text()
        for placeholder, value in (('ARENA = ""', f"ARENA = {str(self.root)!r}"),
                                   ('MARKER = "pkbatk-unarmed"', f"MARKER = {self.marker!r}"),
                                   ("HINTS: dict = {}", f"HINTS: dict = {self.hints()!r}")):
            assert prelude.count(placeholder) == 1, f"_prelude.py has no {placeholder}: the attacks would be disarmed"
            prelude = prelude.replace(placeholder, value)
        return prelude + "\n\n# ---- " + attack + " ----\n" + (ATTACKS / f"{attack}.py").read_text()

    def write_run_folder(self, attacks: tuple[str, ...], honest: bool = True, wrong: bool = False) -> dict[str, str]:
        """The solution files of a `pkb run` (attackers first, in ``attacks`` order): {stem: attack or role}."""
        files = {f"1_allreduce_a{index:02d}_{attack}": attack for index, attack in enumerate(attacks, start=1)}
        for stem, attack in files.items():
            (self.solutions / f"{stem}.py").write_text(self.attack_source(attack))
        if honest:
            (self.solutions / "1_allreduce_honest.py").write_text(HONEST_ALLREDUCE)
            files["1_allreduce_honest"] = "honest"
        if wrong:
            (self.solutions / "1_allreduce_wrong.py").write_text(WRONG)
            files["1_allreduce_wrong"] = "wrong"
        ordered = [path.stem for path in solution_files(self.solutions)["allreduce"]]
        assert ordered == list(files), f"pkb would run the files in another order: {ordered}"
        return files

    def python(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=self.work, env=self.environment(), capture_output=True,
                              text=True, timeout=timeout)

    def pkb(self, *args: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
        return self.python("-m", "pkb", *args, timeout=timeout)

    def pkb_run(self, sandbox: str | None = None, parallel: int = 1) -> subprocess.CompletedProcess:
        return self.pkb("run", "--solutions", str(self.solutions), "--mode", RUN_MODE, "--world-size", "2",
                        "--trials", "1", "--timeout", "60", "--db", str(self.db), "--parallel", str(parallel),
                        *sandbox_flag(sandbox))

    def rows(self) -> dict[str, dict]:
        """The results table by solution name (with ``result``: the stored result as a dict)."""
        if not self.db.exists():
            return {}
        with closing(sqlite3.connect(self.db)) as conn:
            conn.row_factory = sqlite3.Row
            rows = [dict(row) for row in conn.execute("SELECT * FROM results ORDER BY id")]
        by_name: dict[str, dict] = {}
        for row in rows:
            assert row["solution"] not in by_name, f"two rows for {row['solution']}"
            by_name[row["solution"]] = {**row, "result": json.loads(row["result_json"])}
        return by_name

    def stray_files(self) -> list[str]:
        """Files named after the marker where no candidate may write: anywhere in the arena but the grader's
        $TMPDIR (where pkb keeps the candidates' scratch directories), in /tmp and in /dev/shm."""
        found = [path for path in self.root.rglob(f"*{self.marker}*") if self.tmp not in path.parents]
        found += [path for directory in (Path("/tmp"), Path("/dev/shm")) for path in directory.glob(f"{self.marker}*")]
        return sorted(str(path) for path in found)

    def clean_up(self) -> None:
        """Kill whatever an attack left running and remove its files outside the arena."""
        kill_marked_processes(self.marker)
        remove_sysv_segment(self.marker)
        for directory in (Path("/tmp"), Path("/dev/shm")):
            for path in directory.glob(f"{self.marker}*"):
                shutil.rmtree(path) if path.is_dir() else path.unlink()


def tree_digest(root: Path) -> dict[str, tuple[int, str]]:
    """Every path under ``root``: (mode, sha256 of the content, or "dir"): any change to pkb's copy shows."""
    digest = {}
    for directory, names, files in os.walk(root):
        for name in names + files:
            path = Path(directory) / name
            info = path.lstat()
            content = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
            digest[str(path.relative_to(root))] = (info.st_mode, content)
    return digest


def changed(before: dict, after: dict) -> list[str]:
    return sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))


def cache_changes(before: dict, after: dict) -> list[str]:
    """``changed``, except new empty directories: the grader makes its own (the build broker's)."""
    grown = {key for key in after.keys() - before.keys() if after[key][1] == "dir"}
    return [key for key in changed(before, after)
            if key not in grown or any(other.startswith(key + "/") and other not in grown for other in after)]


def marked_processes(marker: str) -> dict[int, str]:
    """Live processes (zombies aside) whose name or command line carries ``marker``: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name, state = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:][:1]
        if state not in ("Z", "X") and (marker in name or marker in command):
            found[int(entry.name)] = command.strip() or name
    return found


def wait_for_marked_processes_to_end(marker: str, seconds: float = LEFTOVER_GRACE_S) -> dict[int, str]:
    deadline = time.monotonic() + seconds
    while True:
        alive = marked_processes(marker)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.25)


def kill_marked_processes(marker: str) -> None:
    for pid in marked_processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


ATTACK_REPORT = re.compile(r"ATTACK-REPORT (\{.*\})")


def attack_report(result: dict) -> dict | None:
    """The report an attack raised (tests/candidates/attacks/_prelude.py), from a stored or returned result."""
    text = f"{result.get('details', {}).get('error', '')}\n{result.get('message', '')}"
    match = ATTACK_REPORT.search(text)
    return json.loads(match.group(1)) if match else None


def tail(process: subprocess.CompletedProcess, limit: int = 3000) -> str:
    return f"exit {process.returncode}\nstdout: {process.stdout[-limit:]}\nstderr: {process.stderr[-limit:]}"


@pytest.fixture
def listener():
    opened = Listener(secrets.token_hex(4))
    yield opened
    opened.close()


# -- every attack in one `pkb run`, under the default sandbox ---------------------------------------------


@needs_landlock
@pytest.mark.parametrize("parallel", [1, 2], ids=["one at a time", "side by side"])
def test_no_attack_escapes_a_pkb_run(tmp_path, listener, parallel):
    """All attacks, then an honest and a wrong file, in one `pkb run` with the default sandbox: one
    evaluation at a time, and two side by side in one pkb process (an attacker beside another evaluation)."""
    arena = Arena(tmp_path / "arena", listener)
    require_sandbox_cli(arena)
    files = arena.write_run_folder(ATTACK_ORDER, honest=True, wrong=True)
    source_before, caches_before = tree_digest(arena.src), tree_digest(arena.root / "caches")
    try:
        process = arena.pkb_run(parallel=parallel)
        leftovers = wait_for_marked_processes_to_end(arena.marker)

        assert process.returncode in (0, 1), f"pkb run did not finish on its own: {tail(process)}"
        rows = arena.rows()
        assert set(rows) == set(files), f"rows {sorted(rows)} != files {sorted(files)} (forged or missing rows)"
        assert len({row["run_key"] for row in rows.values()}) == len(files), "two rows share a run key"
        for name, row in rows.items():
            assert row["status"] == row["result"]["status"], f"{name}: its row and its stored result disagree"
            expect_full_sandbox(row["result"]["details"].get("sandbox"), name)
        assert rows["1_allreduce_honest"]["status"] == "ok", rows["1_allreduce_honest"]["message"]
        assert rows["1_allreduce_wrong"]["status"] == "mismatch", rows["1_allreduce_wrong"]["message"]
        failures = []
        for name, attack in files.items():
            if attack in CONTAINED:
                result = rows[name]["result"]
                try:
                    assert result["status"] != "ok", f"{name} is ok"
                    CONTAINED[attack](attack_report(result), result, arena)
                except AssertionError as exc:
                    failures.append(f"{attack}: {exc}")
        assert not failures, "\n".join(failures)

        source_changes = changed(source_before, tree_digest(arena.src))
        assert not source_changes, f"pkb's source changed: {source_changes}"
        caches_changed = cache_changes(caches_before, tree_digest(arena.root / "caches"))
        assert not caches_changed, f"the build caches changed: {caches_changed}"
        assert not leftovers, f"still alive {LEFTOVER_GRACE_S:.0f} s after the run: {leftovers}"
        assert not arena.stray_files(), f"written outside: {arena.stray_files()}"
        assert not listener.received, f"reached the test's sockets: {listener.received}"
    finally:
        arena.clean_up()


# -- the same damage, uncontained: the attacks are real ----------------------------------------------------


def test_source_tampering_is_real_without_the_sandbox(tmp_path):
    """With --sandbox off the attacker rewrites pkb's compare.py: a later evaluation passes a wrong answer."""
    arena = Arena(tmp_path / "arena")
    arena.write_run_folder(("source_tamper",), honest=False)
    before = tree_digest(arena.src)
    try:
        process = arena.pkb_run(sandbox="off")
        assert process.returncode in (0, 1), tail(process)
        compare_py = arena.src / "pkb" / "evaluate" / "compare.py"
        assert "planted by a candidate" in compare_py.read_text(), "compare.py was not rewritten"
        assert "pkb/evaluate/compare.py" in changed(before, tree_digest(arena.src))
        wrong = arena.work / "wrong.py"
        wrong.write_text(WRONG)
        fooled = arena.pkb("eval", "allreduce", str(wrong), "--mode", "cpu", "--world-size", "2", "--trials", "1")
        assert fooled.returncode == 0 and ": ok" in fooled.stdout, f"the tampered pkb still judged: {tail(fooled)}"
    finally:
        arena.clean_up()


def test_database_forgery_is_real_without_the_sandbox(tmp_path):
    """With --sandbox off a detached process outlives the run and forges the attacker's row to ok."""
    arena = Arena(tmp_path / "arena")
    files = arena.write_run_folder(("db_forgery",), honest=True)
    attacker = next(name for name, role in files.items() if role == "db_forgery")
    try:
        process = arena.pkb_run(sandbox="off")
        assert process.returncode in (0, 1), tail(process)
        assert marked_processes(arena.marker), "no detached forger outlived the run"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and f"{attacker}_forged" not in arena.rows():
            time.sleep(0.25)
        rows = arena.rows()
        assert f"{attacker}_forged" in rows, f"no forged row: {sorted(rows)}"
        assert rows[attacker]["status"] == "ok", "the attacker's own row was not rewritten"
    finally:
        arena.clean_up()
    assert not wait_for_marked_processes_to_end(arena.marker, 5), "the forger survived being killed"


def test_killing_the_grader_is_real_without_the_sandbox(tmp_path):
    """With --sandbox off the attacker kills `pkb run`: the files after it never get a verdict."""
    arena = Arena(tmp_path / "arena")
    arena.write_run_folder(("kill_grader",), honest=True)
    try:
        process = arena.pkb_run(sandbox="off")
        assert process.returncode == -signal.SIGKILL, f"pkb run survived: {tail(process)}"
        assert "1_allreduce_honest" not in arena.rows()
    finally:
        arena.clean_up()


# -- attack by attack, in-process (attacks that cannot harm the test process) ---------------------------------


@pytest.fixture(scope="module")
def sandboxed():
    with open_session("auto") as session:
        yield session


@pytest.fixture(scope="module")
def unsandboxed():
    with open_session("off") as session:
        yield session


def evaluate_attack(session: Session, arena: Arena, attack: str, level: str) -> dict:
    path = arena.solutions / f"1_allreduce_{attack}.py"
    path.write_text(arena.attack_source(attack))
    result = evaluate(get_problem("allreduce"), Candidate.from_file(path), eval_config(level), session)
    return result.to_dict()


FOCUSED = ("write_outside", "read_memory", "privilege", "network", "fork_bomb", "memory_hog")


@needs_landlock
@pytest.mark.parametrize("attack", FOCUSED)
def test_the_sandbox_contains(attack, sandboxed, tmp_path, listener):
    """One attack, evaluated in this process under the default sandbox: nothing gets through, nothing it
    started outlives the evaluation, nothing is written outside, nothing reaches the test's sockets."""
    arena = Arena(tmp_path, listener, copy_pkb=False)
    try:
        result = evaluate_attack(sandboxed, arena, attack, "auto")
        expect_full_sandbox(result["details"].get("sandbox"), attack)
        assert result["status"] != Status.OK.value
        CONTAINED[attack](attack_report(result), result, arena)
        assert not wait_for_marked_processes_to_end(arena.marker), "processes outlived the evaluation"
        assert not arena.stray_files(), f"written outside: {arena.stray_files()}"
        assert not listener.received, f"reached the test's sockets: {listener.received}"
    finally:
        arena.clean_up()


@needs_landlock
def test_dev_shm_is_private_to_an_evaluation(sandboxed, tmp_path):
    """A file one evaluation leaves in /dev/shm is neither the machine's nor visible to the next evaluation."""
    arena = Arena(tmp_path, copy_pkb=False)
    try:
        planted = evaluate_attack(sandboxed, arena, "shm_plant", "auto")
        expect_full_sandbox(planted["details"].get("sandbox"), "shm_plant")
        shm_plant_contained(attack_report(planted), planted, arena)
        peeked = evaluate_attack(sandboxed, arena, "shm_peek", "auto")
        nothing_done(attack_report(peeked), peeked, arena)
    finally:
        arena.clean_up()


# Without the sandbox, the same attacks get through (so that the tests above can fail). Reading memory and
# ptrace need root where Yama allows an ordinary user to trace only its own descendants (the grader is an
# ancestor of its ranks); privilege needs pkb to run as root.
UNCONTAINED = {
    "write_outside": ("solutions", "home", "cwd", "tmp"),
    "read_memory": ("test:environ", "zygote:environ")
                   + (("test:mem", "zygote:mem", "zygote:ptrace", "reference0:mem") if os.geteuid() == 0 else ()),
    "network": ("tcp_loopback", "abstract_unix"),
    "privilege": ("setuid0", "capabilities", "user_namespace"),
}


@pytest.mark.parametrize("attack", UNCONTAINED)
def test_the_attack_is_real_without_the_sandbox(attack, unsandboxed, tmp_path, listener):
    """The in-process attacks above, with the sandbox off: they get what they are after."""
    if attack == "privilege" and os.geteuid() != 0:
        pytest.skip("pkb is not root here: there is no privilege to keep")
    arena = Arena(tmp_path, listener, copy_pkb=False)
    try:
        result = evaluate_attack(unsandboxed, arena, attack, "off")
        report = attack_report(result)
        assert report is not None and report["armed"], result["message"]
        missing = [label for label in UNCONTAINED[attack] if label not in report["done"]]
        assert not missing, f"uncontained, {attack} did not get {missing}: {report}"
        if attack == "network":
            assert {name for name, data in listener.received if data == arena.marker.encode()} == {"tcp", "abstract"}
        if attack == "write_outside":
            assert len(arena.stray_files()) >= 4, arena.stray_files()
    finally:
        arena.clean_up()


def test_dev_shm_is_shared_without_the_sandbox(unsandboxed, tmp_path):
    """Unconfined, the next evaluation reads what the previous one left in /dev/shm."""
    arena = Arena(tmp_path, copy_pkb=False)
    try:
        evaluate_attack(unsandboxed, arena, "shm_plant", "off")
        peeked = attack_report(evaluate_attack(unsandboxed, arena, "shm_peek", "off"))
        assert "peek" in peeked["done"] and "sysv_peek" in peeked["done"], peeked
    finally:
        arena.clean_up()


# -- output: a candidate that prints without end fills neither the grader's disk nor its memory -------------

FLOOD_BYTES = 256 << 20  # each rank's output
FLOOD = f"""
import os
import sys

BLOCK = (b"x" * 1023 + b"\\n") * 1024


def solution(tensor):
    written = 0
    while written < {FLOOD_BYTES}:
        written += sys.stdout.buffer.write(BLOCK)
    sys.stdout.buffer.write(f"FLOOD-END wrote={{written}}\\n".encode())
    sys.stdout.buffer.flush()
    os._exit(3)
"""


class LogWatcher:
    """The largest rank log seen under ``folder`` (the grader's temporary directory), sampled every 5 ms."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.largest = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            for log in self.folder.glob("pkb-*/rank*.log"):
                try:
                    self.largest = max(self.largest, log.stat().st_size)
                except OSError:
                    pass
            time.sleep(0.005)

    def __enter__(self) -> "LogWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.parametrize("level", [pytest.param("auto", marks=needs_landlock), "off"])
def test_a_flood_of_output_stays_off_the_graders_disk_in_the_sandbox(level, tmp_path, monkeypatch):
    """Each rank prints 256 MiB and exits. Under the sandbox its log on the grader's disk never passes
    ``LOG_BYTES`` and its end is still the rank's last line (the crash's ``log_tail``); with the sandbox
    off the whole flood lands there (the damage is real)."""
    from pkb.runtime.jail import LOG_BYTES

    grader_tmp = tmp_path / "grader-tmp"
    grader_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(grader_tmp))  # where this session's groups keep their logs
    path = tmp_path / "1_allreduce_flood.py"
    path.write_text(FLOOD)
    with LogWatcher(grader_tmp) as watcher, open_session(level) as session:
        result = evaluate(get_problem("allreduce"), Candidate.from_file(path), eval_config(level), session)
    assert result.status is Status.CRASH, result.message
    assert f"FLOOD-END wrote={FLOOD_BYTES}" in (result.details.log_tail or ""), result.details.log_tail
    if level == "off":
        assert watcher.largest >= FLOOD_BYTES // 2, f"the flood never reached the grader's disk: {watcher.largest}"
    else:
        expect_full_sandbox(result.details.sandbox, "flood")
        assert 0 < watcher.largest <= LOG_BYTES, f"a rank's log reached {watcher.largest} bytes"
