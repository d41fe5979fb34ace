"""A memory hog: allocate and touch 256 MiB blocks until the allocator refuses, or CAP_BYTES in all (a few
GiB: safe uncontained on a 24 GiB machine). Under the sandbox it must fail in its own process (a data limit:
``MemoryError``/allocator error, or the OOM killer, which the sandbox points at candidates first), never in
the grader's.
"""

import time

CAP_BYTES = 3 << 30
BLOCK_BYTES = 256 << 20


def hog() -> dict:
    report = new_report("memory_hog")
    if not armed():
        report["skipped"]["hog"] = "disarmed"
        return report
    blocks, stopped_by, began = [], None, time.monotonic()
    try:
        while len(blocks) * BLOCK_BYTES < CAP_BYTES:
            blocks.append(torch.ones(BLOCK_BYTES, dtype=torch.uint8))
    except (MemoryError, RuntimeError) as exc:
        stopped_by = error_text(exc)[:300]
    allocated = len(blocks) * BLOCK_BYTES
    report["allocated_bytes"], report["cap_bytes"], report["stopped_by"] = allocated, CAP_BYTES, stopped_by
    report["seconds"] = round(time.monotonic() - began, 2)
    (report["done"] if stopped_by is None else report["failed"])["hog"] = f"{allocated >> 20} MiB touched"
    del blocks
    return report


solution = attack_solution(hog)
