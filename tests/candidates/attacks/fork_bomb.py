"""A bounded fork bomb: start processes until the kernel refuses one, or CAP of them.

Each child is ``sleep LIFE_S`` (argv[0] MARKER) in a session of its own, so it also outlives an evaluation
that kills only its ranks' process groups. Uncontained it stops at CAP and every child exits by itself
after LIFE_S: it cannot take a machine down. Started with ``posix_spawn`` (a vfork-style clone, then exec):
the process limit counts it as any fork, without copying a torch-sized address space 5,000 times.
"""

import shutil
import time

CAP = 5000
LIFE_S = 20


def bomb() -> dict:
    report = new_report("fork_bomb")
    sleep = shutil.which("sleep") or "/bin/sleep"
    started, stopped_by, began = 0, None, time.monotonic()
    if not armed():
        report["skipped"]["bomb"] = "disarmed"
        return report
    while started < CAP:
        try:
            os.posix_spawn(sleep, [MARKER, str(LIFE_S)], {}, setsid=True)
            started += 1
        except OSError as exc:
            stopped_by = error_text(exc)
            break
    report["started"], report["cap"], report["stopped_by"] = started, CAP, stopped_by
    report["seconds"] = round(time.monotonic() - began, 2)
    (report["done"] if stopped_by is None else report["failed"])["bomb"] = f"{started} processes started"
    return report


solution = attack_solution(bomb)
