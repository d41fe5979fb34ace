"""The attacks of tests/candidates/attacks and what containing each means: the order of the whole-run
containment test (tests/integration/test_containment.py) and each attack's check, which the unit tests
hold against the folder's files."""

from __future__ import annotations

import ctypes
import zlib
from pathlib import Path

ATTACKS = Path(__file__).resolve().parents[1] / "candidates" / "attacks"

# The order of the attacks in a `pkb run` (it takes a folder's files in name order): the grader-killer last, so
# that uncontained it cannot hide what the others did; the honest and the wrong file after every attacker.
ATTACK_ORDER = ("source_tamper", "db_forgery", "cache_poison", "write_outside", "read_memory", "privilege",
                "network", "shm_plant", "shm_peek", "fork_bomb", "memory_hog", "disk_fill", "kill_grader")


# -- what containment means, attack by attack ---------------------------------------------------------------
# Each check gets the attack's report (None where the attack left none: it returns zeros, or it was killed), its
# result as a dict and the arena; it asserts what must hold under the sandbox.


def nothing_done(report: dict | None, result: dict, arena) -> None:
    assert report is not None, f"no report: {result.get('status')}: {result.get('message')}"
    assert report["armed"], "the attack ran disarmed: it tested nothing"
    assert not report["done"], f"{report['attack']} got through: {report['done']}"


def db_forgery_contained(report, result, arena) -> None:
    assert report is not None, f"no report: {result.get('status')}: {result.get('message')}"
    assert "forger" in report["done"] or "forger" in report["failed"], report  # it tried (its effect: no forged row)


def cache_poison_contained(report, result, arena) -> None:
    assert report is not None and report["armed"], f"no armed report: {result.get('message')}"
    grader_caches = (str(arena.torch_extensions), str(arena.triton), str(arena.home))
    reached = [label for label in report["done"] if any(cache in label for cache in grader_caches)]
    assert not reached, f"the grader's caches were written: {reached}"


# write_outside.py's places outside the scratch directory ("source_dir" is not one: the sandbox may run a copy of
# the file from its scratch directory; stray_files checks the folder the file was given in)
WRITES_OUTSIDE = ("solutions", "home", "cwd", "db_dir", "pkb", "tmp")


def write_outside_contained(report, result, arena) -> None:
    assert report is not None and report["armed"], f"no armed report: {result.get('message')}"
    outside = {label: path for label, path in report["done"].items() if label in WRITES_OUTSIDE}
    assert not outside, f"written outside the scratch directory: {outside}"
    inside = {label: report["failed"].get(label) for label in ("own_tmpdir", "dev_shm") if label not in report["done"]}
    assert not inside, f"the sandbox left no place to write: {inside}"


def fork_bomb_contained(report, result, arena) -> None:
    assert report is not None and report["armed"], f"no armed report: {result.get('message')}"
    assert report["stopped_by"] and report["started"] < report["cap"], \
        f"no process limit: {report['started']} of {report['cap']} started ({report['stopped_by']})"


def disk_fill_contained(report, result, arena) -> None:
    assert report is not None and report["armed"], f"no armed report: {result.get('message')}"
    assert report["stopped_by"], f"{report['written_bytes'] >> 20} MiB written to {report['path']} with no limit met"


def memory_hog_contained(report, result, arena) -> None:
    """It may get its few GiB or fail (a data limit, the OOM killer): in its own process, never the grader's."""
    assert result["status"] in ("runtime_error", "crash"), result.get("message")


def shm_plant_contained(report, result, arena) -> None:
    assert report is not None and report["armed"], f"no armed report: {result.get('message')}"
    assert "plant" in report["done"], f"/dev/shm was not writable: {report['failed']}"  # shared memory must work
    assert not Path(f"/dev/shm/{arena.marker}-shm").exists(), "the candidate's /dev/shm is the machine's"
    assert "sysv_plant" in report["done"], f"System V shared memory did not work: {report['failed']}"
    assert not remove_sysv_segment(arena.marker), \
        "the candidate's System V shared memory is the machine's (no IPC namespace of its own)"


def remove_sysv_segment(marker: str) -> bool:
    """Remove the System V segment shm_plant.py makes for ``marker`` from this machine's IPC namespace (the key of
    _prelude.py's ``sysv_key``); whether there was one."""
    key = zlib.crc32(f"{marker}-sysv".encode()) & 0x7FFFFFFF
    libc = ctypes.CDLL(None, use_errno=True)
    segment = libc.shmget(key, 0, 0)
    if segment >= 0:
        libc.shmctl(segment, 0, None)  # IPC_RMID: leave the machine as it was
    return segment >= 0


CONTAINED = {
    "source_tamper": lambda report, result, arena: None,  # returns zeros; the tree digest of pkb's copy decides
    "db_forgery": db_forgery_contained,
    "cache_poison": cache_poison_contained,
    "write_outside": write_outside_contained,
    "read_memory": nothing_done,
    "privilege": nothing_done,
    "network": nothing_done,
    "shm_plant": shm_plant_contained,
    "shm_peek": nothing_done,
    "fork_bomb": fork_bomb_contained,
    "memory_hog": memory_hog_contained,
    "disk_fill": disk_fill_contained,
    "kill_grader": nothing_done,
}
