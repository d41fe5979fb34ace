"""The process tree as /proc shows it, read once per call: who is whose child."""

from __future__ import annotations

import os


def _stat_fields(path: str) -> list[bytes] | None:
    """The fields of a /proc ``stat`` file after the command name, from the state on (``proc(5)``: the name,
    in parentheses, may itself hold spaces and parentheses, so it ends at the last ``)``); None if unreadable."""
    try:
        with open(path, "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children_by_parent(include_zombies: bool = True) -> dict[int, list[int]]:
    """Every process's children (parent pid -> child pids), from one walk of /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(f"/proc/{entry.name}/stat")
        if fields is None:  # gone since the walk saw it
            continue
        try:
            parent = int(fields[1])
        except (IndexError, ValueError):
            continue
        if include_zombies or fields[0] != b"Z":
            children.setdefault(parent, []).append(int(entry.name))
    return children


def descendants(roots: list[int], tree: dict[int, list[int]]) -> set[int]:
    """``roots`` and every process below them in ``tree`` (``children_by_parent``)."""
    found, stack = set(), list(roots)
    while stack:
        pid = stack.pop()
        if pid not in found:
            found.add(pid)
            stack.extend(tree.get(pid, ()))
    return found


def asleep(roots: list[int], tree: dict[int, list[int]]) -> bool:
    """Whether every thread of ``roots`` and of every process below them is asleep (state ``S``: waiting for
    something, such as a peer in a collective; not running, not in an uninterruptible wait); a process that
    is gone counts as asleep."""
    for pid in descendants(roots, tree):
        try:
            threads = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for thread in threads:
            fields = _stat_fields(f"/proc/{pid}/task/{thread}/stat")
            if fields and fields[0] not in (b"S", b"Z", b"X"):
                return False
    return True


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, own: bool = True, reaped: bool = True) -> float:
    """CPU seconds ``pid`` has used itself (``own``) and that its children it has waited for used
    (``reaped``); 0 for a process that is gone."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    if fields is None:
        return 0.0
    try:
        ticks = [int(v) for v in fields[11:15]]  # utime stime cutime cstime
    except ValueError:
        return 0.0
    return (sum(ticks[:2]) * own + sum(ticks[2:]) * reaped) / _TICKS


def helpers_cpu_seconds(ranks: list[int], tree: dict[int, list[int]]) -> float:
    """CPU seconds used by the processes that ``ranks`` started, and theirs (compilers, build tools, worker
    pools): alive now, or reaped by their parent (which then holds their time). Never decreases while the
    ranks live."""
    helpers = descendants(ranks, tree) - set(ranks)
    return sum(cpu_seconds(pid, own=False) for pid in ranks) + sum(cpu_seconds(pid) for pid in helpers)
