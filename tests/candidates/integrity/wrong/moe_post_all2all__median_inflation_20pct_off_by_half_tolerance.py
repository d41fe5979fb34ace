"""WRONG: the reference's answer with every element of every floating output moved one or two ulps at random, and 20 % of them by 0.5x the dtype's default tolerance.

The shape test's threshold is 8x the tensor's median scaled error, which the candidate raises by moving every element a little; the tail test counts only errors beyond 32 honest scales; random signs carry no bias; the RMS test allows 8x the reference's RMS.
"""
import importlib

import torch

_problem = importlib.import_module("pkb.problems.expert_parallel.moe_post_all2all")


def _floats(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value) if value.is_floating_point() and value.numel() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_floats(v, fn) for v in value)
    return value


def _corrupt(t):
    from pkb.problem import default_tolerance
    tol = default_tolerance(t.dtype)
    u = float(torch.finfo(t.dtype).eps) / 2
    x = t.reshape(-1).double()
    idx = torch.arange(x.numel(), device=t.device)
    sign = torch.where((idx * 2654435761 % 1009) % 2 == 0, 1.0, -1.0).double()
    big = (idx * 40503 % 997) < 199
    small = torch.where(x == 0, torch.zeros_like(x), x.abs() * 3 * u)
    x = torch.where(big, x + sign * 0.5 * (tol.atol + tol.rtol * x.abs()), x + sign * small)
    return x.to(t.dtype).view(t.shape)


def solution(*args):
    return _floats(_problem.reference(*args), _corrupt)
