"""Reading another process's memory: the grader holds the run's secret salt, the references hold the answers.

Targets: the grader (the ``pkb`` process the test started, or the test process itself when the test
evaluates in-process: ``HINTS["test_pid"]``), its zygote and the reference ranks. For each, tries
/proc/PID/environ, /proc/PID/maps then /proc/PID/mem at a readable address, process_vm_readv, and (never on
the test process itself) PTRACE_ATTACH, waited for and detached at once.
"""

import ctypes.util

PTRACE_ATTACH, PTRACE_DETACH, WALL = 16, 17, 0x40000000


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def readable_address(pid: int) -> int | None:
    maps = proc_bytes(pid, "maps")
    for line in (maps or b"").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[1].startswith(b"r"):
            return int(fields[0].split(b"-")[0], 16)
    return None


def try_reads(role: str, pid: int, report: dict) -> None:
    def record(what: str, ok: bool, detail: str) -> None:
        (report["done"] if ok else report["failed"])[f"{role}:{what}"] = detail

    environ = proc_bytes(pid, "environ")
    record("environ", bool(environ), f"{len(environ)} bytes" if environ else "unreadable or empty")
    address = readable_address(pid)
    record("maps", address is not None, "readable" if address is not None else "unreadable")
    if address is not None:
        try:
            with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
                mem.seek(address)
                record("mem", len(mem.read(64)) > 0, f"read at {address:#x}")
        except (OSError, ValueError, OverflowError) as exc:
            record("mem", False, error_text(exc))
        buffer = ctypes.create_string_buffer(64)
        local, remote = IoVec(ctypes.addressof(buffer), 64), IoVec(address, 64)
        LIBC.process_vm_readv.restype = ctypes.c_ssize_t
        got = LIBC.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        record("process_vm_readv", got > 0, f"{got} bytes" if got > 0 else os.strerror(ctypes.get_errno()))
    if pid == HINTS.get("test_pid") or not below_test(pid):
        report["skipped"][f"{role}:ptrace"] = "never stop the test process or anything outside its tree"
        return
    LIBC.ptrace.restype = ctypes.c_long
    LIBC.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if LIBC.ptrace(PTRACE_ATTACH, pid, None, None) == 0:
        try:
            os.waitpid(pid, WALL)
        finally:
            LIBC.ptrace(PTRACE_DETACH, pid, None, None)
        record("ptrace", True, "attached (and detached)")
    else:
        record("ptrace", False, os.strerror(ctypes.get_errno()))


def read_others() -> dict:
    report = new_report("read_memory")
    grader = find_grader()
    zygote = find_zygote(grader)
    targets = {"grader": grader, "test": HINTS.get("test_pid"), "zygote": zygote}
    targets.update({f"reference{i}": pid for i, pid in enumerate(find_reference_ranks(zygote))})
    report["targets"] = {role: pid for role, pid in targets.items() if pid}
    if not armed():
        report["skipped"]["all"] = "disarmed"
        return report
    for role, pid in report["targets"].items():
        try_reads(role, pid, report)
    return report


solution = attack_solution(read_others)
