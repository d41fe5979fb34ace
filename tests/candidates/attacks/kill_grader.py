"""Killing the grader: SIGKILL the ``pkb`` process, its zygote and every other process the zygote started.

Walks /proc up this rank's parent chain to ``pkb run`` and its zygote, and scans for the zygote's children (the
reference ranks, spare rank groups); a run whose grader dies leaves every later file without a verdict.
Processes between this rank and the zygote are left alone: they belong to this evaluation (a sandbox's keeper),
and killing them ends only this evaluation. Only processes of the test's own tree are ever signalled (see the
prelude).
"""

import signal


def targets() -> list[tuple[str, int]]:
    grader = find_grader()
    zygote = find_zygote(grader)
    own_log = log_dir_of(os.getpid())
    own_processes = {os.getpid(), *ancestors(os.getpid())} - {grader, zygote}
    found = [("grader", grader), ("zygote", zygote)]
    found += [("zygote-child", pid) for pid in all_pids() if zygote is not None and parent_of(pid) == zygote]
    seen, ordered = set(), []
    for role, pid in found:
        if pid is None or pid in seen or pid in own_processes:
            continue
        seen.add(pid)
        if own_log is not None and log_dir_of(pid) == own_log:
            continue  # this evaluation's own ranks: killing them proves nothing
        ordered.append((role, pid))
    return ordered


def kill_all() -> dict:
    report = new_report("kill_grader")
    for role, pid in targets():
        label = f"{role}:{pid}"
        if not below_grader(pid):
            report["skipped"][label] = "not in the test's process tree"
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            report["done"][label] = "SIGKILL sent"
        except OSError as exc:
            report["failed"][label] = error_text(exc)
    if not report["done"] and not report["failed"]:
        report["failed"]["grader"] = "no process of the grader's is visible from here"
    return report


solution = attack_solution(kill_all)
