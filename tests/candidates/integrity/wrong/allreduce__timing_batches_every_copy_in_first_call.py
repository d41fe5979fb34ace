"""WRONG (timing): the first timed call of a repeat all-reduces every input copy of the repeat at once.

The TimedLoop is on the stack (``self`` of its ``repeat`` frame) and holds every input copy. On the first call of
each repeat the candidate concatenates all copies' buffers, runs ONE all-reduce, and keeps the pieces; the other
calls of the repeat return their piece. Every output is right for its own copy's current values, so the projections
and the final timed outputs agree, and the work really runs inside the repeat; but a latency-bound small all-reduce
is timed as 1/num_calls of a batched one: no real caller has its next calls' inputs when it makes the first.
"""
import sys

import torch
import torch.distributed as dist

_done = {}


def _timed():
    f = sys._getframe(2)
    while f is not None:
        s = f.f_locals.get("self")
        if s is not None and type(s).__name__ == "TimedLoop" and f.f_code.co_name == "repeat":
            return s
        f = f.f_back
    return None


def solution(tensor):
    timed = _timed()
    if timed is None:
        out = tensor.clone()
        dist.all_reduce(out)
        return out
    key = (id(timed), timed.round)
    found = _done.get(key)
    if found is None or not any(c[0] is tensor for c in timed.copies[:len(found)]):
        _done.clear()
        flats = [c[0].reshape(-1) for c in timed.copies]
        joined = torch.cat(flats)
        dist.all_reduce(joined)
        found = list(joined.split([f.numel() for f in flats]))
        _done[key] = found
    for k, c in enumerate(timed.copies):
        if c[0] is tensor:
            return found[k].view(tensor.shape).clone()
    out = tensor.clone()
    dist.all_reduce(out)
    return out
