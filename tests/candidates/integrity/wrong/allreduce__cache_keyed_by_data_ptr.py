"""WRONG: caches the all-reduce by (data_ptr, shape, version): a repeated input buffer returns the stale sum.

The public benchmark hack, made rank-coherent (the ranks agree on a hit with a 1-element MIN all-reduce, so that no
rank skips a collective the others make). The harness reuses its input copies; a cache keyed on the buffer's
address and version counter skips the real all-reduce. Expected: the refresh writes new values in place (through
``.data``: same address, same version), so the projections after each timed repeat find the outputs of the repeat
before (``tampered``), and correctness trials see new buffers each time.
"""
import torch
import torch.distributed as dist

_cache = {}


def solution(tensor):
    key = (tensor.data_ptr(), tuple(tensor.shape), tensor._version)
    hit = torch.tensor([1 if key in _cache else 0], dtype=torch.int32)
    dist.all_reduce(hit, op=dist.ReduceOp.MIN)
    if int(hit):
        return _cache[key]
    out = tensor.clone()
    dist.all_reduce(out)
    _cache[key] = out
    return out
