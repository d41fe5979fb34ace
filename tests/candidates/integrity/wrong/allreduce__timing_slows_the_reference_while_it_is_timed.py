"""WRONG (timing): slows the *reference* down while the parent times it, from the candidate's idle processes.

``time_case`` prepares the reference, then the candidate (the candidate's warm-up calls run here), then times the
reference, then the candidate. The candidate's rank processes stay alive and idle while the reference is timed, and
nothing stops them from running threads then. On its warm-up calls (a TimedLoop ``prepare`` frame on the stack) the
candidate starts four busy threads per rank (torch matmuls, which release the GIL, so the worker's blocking read of its
next job is not delayed); they stop at the candidate's own ``make_copies`` call, before its repeats start. The
reference's repeats (and its refresh and check phases) run on a machine the candidate keeps busy; the candidate's
run on a quiet one. The all-reduce itself is honest. On a GPU the same works with a kernel spinning on a side stream
(or NVLink traffic) while the reference's group is timed.
"""
import sys
import threading

import torch
import torch.distributed as dist

_stop = threading.Event()
_threads = []


def _hog():
    a = torch.randn(192, 192)
    big = torch.empty(16 << 20)
    other = torch.empty(16 << 20)
    while not _stop.is_set():
        a = torch.tanh(a @ a)
        other.copy_(big)  # memory bandwidth too


def _phase():
    f = sys._getframe(2)
    while f is not None:
        s = f.f_locals.get("self")
        if s is not None and type(s).__name__ == "TimedLoop" and f.f_code.co_name in ("prepare", "make_copies",
                                                                                       "repeat"):
            return f.f_code.co_name
        f = f.f_back
    return None


def solution(tensor):
    phase = _phase()
    if phase == "prepare" and not any(t.is_alive() for t in _threads):
        _stop.clear()
        _threads[:] = [threading.Thread(target=_hog, daemon=True) for _ in range(4)]
        for t in _threads:
            t.start()
    elif phase in ("make_copies", "repeat") and _threads:
        _stop.set()
        for t in _threads:
            t.join()
        _threads.clear()
    out = tensor.clone()
    dist.all_reduce(out)
    return out
