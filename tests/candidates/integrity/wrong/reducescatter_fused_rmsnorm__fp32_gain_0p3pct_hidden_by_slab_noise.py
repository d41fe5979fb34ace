"""WRONG: the reference computed in fp32, then a systematic +0.3 % gain hidden under random gains per row slab (sd 0.7 %, bounded; the 32 slabs the bias test's cluster-robust standard error uses).

The slab gains inflate the cluster-robust standard error of the gain so that 6 standard errors exceed the systematic 0.3 % (issue 53: no 0.25 % bias may pass).
"""
import importlib

import torch

_problem = importlib.import_module("pkb.problems.tensor_parallel.reducescatter_fused_rmsnorm")


def _raise(value):
    if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_raise(v) for v in value)
    return value


def _like(value, model):
    if isinstance(value, torch.Tensor) and isinstance(model, torch.Tensor) and value.is_floating_point():
        return _slab_gain(value.double()).to(model.dtype)
    if isinstance(value, (list, tuple)):
        return type(model)(_like(v, m) for v, m in zip(value, model))
    return model


def _slab_gain(x):
    if x.dim() == 0 or x.numel() < 2:
        return x
    axis = 0 if x.shape[0] >= 2 else x.dim() - 1
    size = x.shape[axis]
    slab = torch.arange(size, device=x.device) * min(32, size) // size
    seed = int(x.float().abs().sum().item() * 1000) % (2 ** 31)
    gains = (torch.rand(min(32, size), generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 - 1) * 3 ** 0.5
    shape = [1] * x.dim()
    shape[axis] = size
    return x * (1 + 0.003 + 0.007 * gains[slab].view(shape))


def _toward_zero(value, dtype):
    if dtype != torch.bfloat16:
        return value
    return ((value.float().view(torch.int32) & ~0xFFFF).view(torch.float32))


def solution(*args):
    model = _problem.reference(*args)  # for the output dtypes (every rank makes the same calls)
    wide = _problem.reference(*_raise(args))
    return _like(wide, model)
