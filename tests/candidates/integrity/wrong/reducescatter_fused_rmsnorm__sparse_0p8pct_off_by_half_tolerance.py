"""WRONG: the reference's answer with 0.8 % of every floating output's elements off by 0.5x the dtype's default tolerance.

Element-wise the rule allows max(T, 3 roundings, 3x the reference's largest error); the shape test allows 1 % (or 3x the reference's share) of elements beyond 8 median errors, the tail test 5 % beyond 32 scales; errors of random sign carry no bias, and their RMS is within 8x the reference's.
"""
import importlib

import torch

_problem = importlib.import_module("pkb.problems.tensor_parallel.reducescatter_fused_rmsnorm")


def _floats(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value) if value.is_floating_point() and value.numel() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_floats(v, fn) for v in value)
    return value


def _corrupt(t):
    # every 125th element (0.8 %) off by 0.5 x (atol + rtol |x|) of the dtype's default tolerance, sign by index
    from pkb.problem import default_tolerance
    tol = default_tolerance(t.dtype)
    flat = t.reshape(-1).double()
    idx = torch.arange(flat.numel(), device=t.device)
    sign = torch.where((idx * 2654435761 % 97) % 2 == 0, 1.0, -1.0).double()
    bad = (idx % 125) == 7
    flat = torch.where(bad, flat + sign * 0.5 * (tol.atol + tol.rtol * flat.abs()), flat)
    return flat.to(t.dtype).view(t.shape)


def solution(*args):
    return _floats(_problem.reference(*args), _corrupt)
