"""Writing outside the scratch directory: leave a MARKER-named file wherever it should not be able to.

Outside (each must be refused under the sandbox): the folder the candidate file was given in (hinted: the
sandbox may run a copy of the file from its scratch directory), the directory this file runs from, the
grader's home and cwd (from /proc/PID/environ and /proc/PID/cwd, else hinted), the database's directory,
pkb's package directory, and /tmp. Inside (each must work: the sandbox must leave a candidate somewhere to
write): its own $TMPDIR and /dev/shm; those files are removed again.
"""

OUTSIDE = ("solutions", "source_dir", "home", "cwd", "db_dir", "pkb", "tmp")
INSIDE = ("own_tmpdir", "dev_shm")


def places() -> dict[str, str | None]:
    grader = find_grader()
    environ = environ_of(grader) if grader else {}
    try:
        cwd = os.readlink(f"/proc/{grader}/cwd") if grader else None
    except OSError:
        cwd = None
    pkb = getattr(sys.modules.get("pkb"), "__file__", None)
    return {"solutions": HINTS.get("solutions"), "source_dir": os.path.dirname(os.path.abspath(__file__)),
            "home": environ.get("HOME") or HINTS.get("home"), "cwd": cwd or HINTS.get("cwd"),
            "db_dir": HINTS.get("db") and os.path.dirname(HINTS["db"]), "pkb": pkb and os.path.dirname(pkb),
            "tmp": "/tmp", "own_tmpdir": tempfile.gettempdir(), "dev_shm": "/dev/shm"}


def write_everywhere() -> dict:
    report = new_report("write_outside")
    for label, directory in places().items():
        if not directory:
            report["skipped"][label] = "not found"
            continue
        path = marked(directory, label)
        if not may_write(path):
            report["skipped"][label] = f"{path}: outside the test's arena"
            continue
        try:
            with open(path, "w") as f:
                f.write(f"written by a candidate ({MARKER})\n")
            report["done"][label] = path
            if label in INSIDE:
                os.unlink(path)
        except OSError as exc:
            report["failed"][label] = f"{path}: {error_text(exc)}"
    return report


solution = attack_solution(write_everywhere)
