"""POLICY: drowns the parent's record of stock calls before taking one. The rank's recorder sends each new label to
the parent through its ``sink`` (found on the Worker, which is on the stack); the candidate calls that sink itself
with 5,000 invented labels, each ending in ``@network`` (a label the policy allows), so that the parent's record is
full when the real ``dist.all_reduce`` is noted, and then clears the rank's own record. Expected under ``--policy
forbid-collectives``: ``forbidden`` (past its limit the parent keeps ``pkb.too_many_stock_calls``, which no policy
allows)."""
import sys

import torch.distributed as dist

_flooded = []


def _worker():
    frame = sys._getframe(1)
    while frame is not None:
        found = frame.f_locals.get("self")
        if found is not None and type(found).__name__ == "Worker":
            return found
        frame = frame.f_back
    return None


def solution(tensor):
    worker = _worker()
    if worker is not None and not _flooded:
        _flooded.append(True)
        worker.recorder.sink([f"dist.flood_{i}@network" for i in range(5000)])
    out = tensor.clone()
    dist.all_reduce(out)
    if worker is not None:
        worker.recorder.used.clear()
    return out
