"""The second half of shm_plant.py: look for what an earlier evaluation left in /dev/shm."""


def peek() -> dict:
    report = new_report("shm_peek")
    path = marked("/dev/shm", "shm")
    try:
        with open(path) as f:
            report["done"]["peek"] = f"{path}: {f.read().strip()}"
    except OSError as exc:
        report["failed"]["peek"] = error_text(exc)
    return report


solution = attack_solution(peek)
