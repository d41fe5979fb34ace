"""WRONG: the reference computed in fp32 and every floating output multiplied by 1 + 1e-3 before rounding.

A systematic multiplicative bias of the same sign on every element, rank and trial, under one unit roundoff.
"""
import importlib

import torch

_problem = importlib.import_module("pkb.problems.context_parallel.ring_attention")


def _raise(value):
    if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_raise(v) for v in value)
    return value


def _like(value, model):
    if isinstance(value, torch.Tensor) and isinstance(model, torch.Tensor) and value.is_floating_point():
        return (value.double() * (1 + 1e-3)).to(model.dtype)
    if isinstance(value, (list, tuple)):
        return type(model)(_like(v, m) for v, m in zip(value, model))
    return model


def _toward_zero(value, dtype):
    if dtype != torch.bfloat16:
        return value
    return ((value.float().view(torch.int32) & ~0xFFFF).view(torch.float32))


def solution(*args):
    model = _problem.reference(*args)  # for the output dtypes (every rank makes the same calls)
    wide = _problem.reference(*_raise(args))
    return _like(wide, model)
