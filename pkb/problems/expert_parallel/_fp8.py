"""FP8 (e4m3) delayed scaling shared by the fp8 gradient and parameter problems.

Delayed scaling (Transformer Engine's recipe, margin 0, amax_compute_algo="max"): the scale of this
step comes from the history of past amaxes, scale = 448 / max(history) in fp32 (1 when the history
is all zero); values are multiplied by it, saturated to +-448 and rounded to nearest-even e4m3, and
decoded as code / scale. This step's amax, max |x| over the whole tensor (all ranks, reduced with
MAX as Transformer Engine reduces amaxes), enters the history at position 0; the oldest entry drops:
updated = [amax, history[0], ..., history[-2]].
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def delayed_scale(amax_history: torch.Tensor) -> torch.Tensor:
    """0-d fp32 scale from the history: 448 / max(history), or 1 if the history holds only zeros."""
    amax = amax_history.float().max()
    return torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))


def quantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of values * scale, saturated to +-448."""
    return (values.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def updated_history(amax_history: torch.Tensor, local_values: torch.Tensor, group=None) -> torch.Tensor:
    """The history with the global amax of this step (MAX over ranks of max |x|) pushed in front."""
    amax = local_values.abs().max().float() if local_values.numel() else torch.zeros((), device=local_values.device)
    amax = amax.reshape(1).clone()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return torch.cat([amax.to(amax_history.dtype), amax_history[:-1]])


def gaussian_amax(num_values: int) -> float:
    """About the largest |x| among ``num_values`` N(0, 1) draws: sqrt(2 ln n)."""
    return math.sqrt(2.0 * math.log(max(num_values, 2)))


def history_like(gen, length: int, typical_amax: float, dtype: torch.dtype) -> torch.Tensor:
    """An amax history of 0.4x to 1.1x ``typical_amax``: its max is near the amax this step will have,
    so in some trials the largest values saturate at +-448 and in others they do not."""
    values = typical_amax * (0.4 + 0.7 * torch.rand(length, generator=gen, device=gen.device))
    return values.to(dtype)
