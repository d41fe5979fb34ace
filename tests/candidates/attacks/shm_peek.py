"""The second half of shm_plant.py: look for what an earlier evaluation left in /dev/shm and in System V shared
memory."""


def peek() -> dict:
    report = new_report("shm_peek")
    path = marked("/dev/shm", "shm")
    try:
        with open(path) as f:
            report["done"]["peek"] = f"{path}: {f.read().strip()}"
    except OSError as exc:
        report["failed"]["peek"] = error_text(exc)
    LIBC.shmat.restype = ctypes.c_void_p
    segment = LIBC.shmget(sysv_key("sysv"), 0, 0)
    address = LIBC.shmat(segment, None, 0) if segment >= 0 else None
    if address in (None, ctypes.c_void_p(-1).value):
        report["failed"]["sysv_peek"] = f"errno {ctypes.get_errno()}"
    else:
        report["done"]["sysv_peek"] = ctypes.string_at(address).decode(errors="replace")
    return report


solution = attack_solution(peek)
