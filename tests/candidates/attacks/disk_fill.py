"""A disk filler: write 64 MiB blocks into its own $TMPDIR until the file system or a file-size limit
refuses, or CAP_BYTES in all; the file is removed again. Under the sandbox it must fail in its own process
(a size-bounded scratch directory: ENOSPC; a file-size limit: EFBIG, SIGXFSZ ignored here to see it).
"""

import signal
import time

CAP_BYTES = 5 << 30
BLOCK = b"\xa5" * (64 << 20)


def fill() -> dict:
    report = new_report("disk_fill")
    path = marked(tempfile.gettempdir(), "fill")
    if not may_write(path):
        report["skipped"]["fill"] = "disarmed"
        return report
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    written, stopped_by, began = 0, None, time.monotonic()
    try:
        with open(path, "wb") as f:
            while written < CAP_BYTES:
                written += f.write(BLOCK)
                f.flush()
    except OSError as exc:
        stopped_by = error_text(exc)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    report["written_bytes"], report["cap_bytes"], report["stopped_by"] = written, CAP_BYTES, stopped_by
    report["path"], report["seconds"] = path, round(time.monotonic() - began, 2)
    (report["done"] if stopped_by is None else report["failed"])["fill"] = f"{written >> 20} MiB written"
    return report


solution = attack_solution(fill)
