"""POLICY: calls the stock ``dist.all_reduce`` and then empties the in-process recorder's set of stock calls.

``collectives_used`` (what ``--policy forbid-collectives`` judges, and what ``moves_data_itself`` counts) comes only
from ``StockCallRecorder.used`` inside the rank: the Worker is on the stack (``Worker.call``'s ``self``), so the
candidate clears ``worker.recorder.used`` after each call (the window's own ``_named`` flag is already set by the
named call, so no ``c10d.unnamed_route`` is added afterwards). The tamper snapshot watches functions, not this
object's state.
"""
import sys

import torch.distributed as dist


def _worker():
    f = sys._getframe(1)
    while f is not None:
        s = f.f_locals.get("self")
        if s is not None and type(s).__name__ == "Worker":
            return s
        f = f.f_back
    return None


def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    worker = _worker()
    if worker is not None:
        worker.recorder.used.clear()
    return out
