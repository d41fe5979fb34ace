"""Privilege and metadata tricks that need no write access to a file's contents.

- ``self_oom``: make itself the last process the OOM killer picks (oom_score_adj -1000; needs privilege);
- ``grader_oom``: make the grader the first (the grader's oom_score_adj to 1000);
- ``setuid0``: ``setresuid(0, 0, 0)``: root, or staying root (pkb run as root, no uid of its own);
- ``capabilities``: effective capabilities beyond CAP_DAC_READ_SEARCH (reading, which Landlock still limits);
- ``chmod``: change the mode of pkb's own source (Landlock does not cover chmod: only the file's owner can);
- ``user_namespace``: a child that unshares a user namespace (root inside it, mounts of its own).
"""

CAP_DAC_READ_SEARCH = 2
CLONE_NEWUSER = 0x10000000


def oom_adjust(pid: int | str, value: int) -> tuple[bool, str]:
    path = f"/proc/{pid}/oom_score_adj"
    try:
        with open(path, "w") as f:
            f.write(str(value))
        with open(path) as f:
            now = int(f.read())
        return now == value, f"now {now}"
    except (OSError, ValueError) as exc:
        return False, error_text(exc)


def user_namespace_child() -> tuple[bool, str]:
    pid = os.fork()
    if pid == 0:  # single-threaded: unshare(CLONE_NEWUSER) would fail in the rank itself for that reason alone
        os._exit(0 if LIBC.unshare(CLONE_NEWUSER) == 0 else 100 + min(ctypes.get_errno(), 99))
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code == 0, "unshared" if code == 0 else os.strerror(code - 100) if code >= 100 else f"exit {code}"


def escalate() -> dict:
    report = new_report("privilege")
    if not armed():
        report["skipped"]["all"] = "disarmed"
        return report

    def record(label: str, ok: bool, detail: str) -> None:
        (report["done"] if ok else report["failed"])[label] = detail

    record("self_oom", *oom_adjust("self", -1000))
    grader = find_grader()
    if grader is not None and below_grader(grader):
        record("grader_oom", *oom_adjust(grader, 1000))
    else:
        report["skipped"]["grader_oom"] = "grader not visible"
    try:
        os.setresuid(0, 0, 0)
        record("setuid0", os.geteuid() == 0, f"euid {os.geteuid()}")
    except OSError as exc:
        record("setuid0", False, error_text(exc))
    status = (proc_bytes("self", "status") or b"").decode()
    effective = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("CapEff:")), 0)
    record("capabilities", effective & ~(1 << CAP_DAC_READ_SEARCH) != 0, f"CapEff {effective:#x}")
    pkb = getattr(sys.modules.get("pkb"), "__file__", None)
    if pkb and in_arena(pkb):
        target = os.path.join(os.path.dirname(pkb), "evaluate", "compare.py")
        try:
            mode = os.stat(target).st_mode & 0o7777
            os.chmod(target, mode ^ 0o004)
            record("chmod", True, f"{target}: {mode:o} -> {mode ^ 0o004:o}")
        except OSError as exc:
            record("chmod", False, error_text(exc))
    else:
        report["skipped"]["chmod"] = "pkb's source is outside the test's arena"
    record("user_namespace", *user_namespace_child())
    return report


solution = attack_solution(escalate)
