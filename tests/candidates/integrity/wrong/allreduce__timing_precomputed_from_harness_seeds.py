"""WRONG (timing): inflates the speedup by doing every timed call's work before the clock runs.

The timing loop's input copies for every repeat are made from seeds that sit in the rank's memory (the TimedLoop's
``seeds``, refreshed with a fixed public formula ``_round_seed``), and ``make_copies`` calls each copy once,
untimed. On that untimed call this candidate walks the stack to the TimedLoop, regenerates the inputs of every
copy for every repeat (``timed.make_inputs(_round_seed(seed, r))``), all-reduces them all honestly, and keeps the
results. In a timed repeat each call only looks its answer up (copy by identity, round by ``timed.round``): no
communication while the parent's clock runs. Every output is correct (right values for that repeat's inputs), so the
projections check and the final timed-output check pass. Correctness trials run the honest all-reduce.
"""
import sys

import torch
import torch.distributed as dist

_pre = {}
_done = set()


def _honest(t):
    out = t.clone()
    dist.all_reduce(out)
    return out


def _frames():
    f = sys._getframe(2)
    timed = worker = None
    names = []
    while f is not None:
        s = f.f_locals.get("self")
        if s is not None and type(s).__name__ == "TimedLoop" and timed is None:
            timed = s
        if s is not None and type(s).__name__ == "Worker" and worker is None:
            worker = s
        if s is not None and type(s).__name__ == "TimedLoop":
            names.append(f.f_code.co_name)
        f = f.f_back
    return timed, worker, names


def _round_seed(seed, r):
    return tuple(part ^ (0x9E3779B97F4A7C15 * r & (2**63 - 1)) for part in seed)


def solution(tensor):
    timed, worker, names = _frames()
    if timed is None:
        return _honest(tensor)
    if "make_copies" in names and id(timed) not in _done:
        _done.add(id(timed))
        repeats = int((worker.protocol or {}).get("num_repeats", 7)) if worker is not None else 7
        for k in range(len(timed.copies)):
            for r in range(repeats + 1):
                inputs = timed.make_inputs(_round_seed(timed.seeds[k], r))
                _pre[(id(timed), k, r)] = _honest(inputs[0])
    if "repeat" in names:
        for k, copy in enumerate(timed.copies):
            if copy[0] is tensor:
                found = _pre.get((id(timed), k, timed.round))
                if found is not None:
                    return found
    return _honest(tensor)
