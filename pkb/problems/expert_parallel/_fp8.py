"""FP8 (e4m3) delayed scaling shared by the fp8 gradient and parameter problems (upstream 52 and 53).

The upstream recipe, per rank and per call (each rank keeps its own history; nothing is reduced):
    amax    = max |x| over this rank's tensor (fp32)
    history = [history[1], ..., history[L-1], amax]  (the oldest entry drops, the newest goes last;
              stored in the history's dtype, so amax is rounded to bf16 there)
    scale   = max(max(history), 1e-12) / 448         (fp32; a dequantization scale: code * scale ~ x)
    code    = e4m3(x / scale)                        (IEEE fp32 quotient, round to nearest even)
    decoded = (float(code) * scale), rounded to x's dtype
The history includes this step's amax, so |x / scale| <= 448 up to amax's bf16 rounding (at most
448 * (1 + 2^-9)), which rounds to 448: no value saturates or overflows.

A knife edge, and how the inputs avoid it: ``amax / 448`` is rounded once by the CPU, but a GPU
divides a tensor by a Python number as a multiplication by the number's fp32 reciprocal, which
rounds differently for about half of all bf16 amaxes. One ulp of scale moves a code across an e4m3
rounding boundary now and then, and that element's decoded value by one e4m3 step. The shared-gpu
mode compares a GPU candidate with the CPU reference, and saw this (one element in 300, upstream's
own file). So every amax that can set the scale (the history's entries, and the largest |x|, planted
as such) is a bf16 value whose scale is the same either way (``settled``): the answer is then one
answer on every device, and the tolerance stays that of the reduction.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pkb.problems.expert_parallel._common import dtype_of

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12


def updated_history(amax_history: torch.Tensor, local_values: torch.Tensor) -> torch.Tensor:
    """[history[1:], max |local_values|]: this rank's amax pushed in last (in the history's dtype)."""
    amax = local_values.abs().max().float()
    return torch.cat([amax_history[1:], amax.reshape(1).to(amax_history.dtype)])


def dequant_scale(history: torch.Tensor) -> torch.Tensor:
    """0-d fp32 scale max(max(history), 1e-12) / 448 (the max taken in the history's dtype)."""
    return history.max().clamp(min=MIN_AMAX).float() / FP8_MAX


def encode(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of values / scale."""
    return (values.float() / scale).to(FP8_DTYPE)


def decode(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """code * scale in fp32, rounded to ``dtype``; ``scale`` broadcasts (one per source rank)."""
    return (codes.float() * scale).to(dtype)


def gather_scales(scale: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's 0-d fp32 scale, [W] in rank order."""
    world_size = dist.get_world_size(group)
    scales = torch.empty(world_size, dtype=torch.float32, device=scale.device)
    dist.all_gather_into_tensor(scales, scale.reshape(1).contiguous(), group=group)
    return scales


def upstream_fp8_inputs(case, num_values: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's: ``num_values`` N(0, 1) in the run's dtype (amax unsettled) and a bf16 history of
    ``case["history"]`` entries of 1e-8, so this step's amax always sets the scale."""
    values = torch.randn(num_values, dtype=dtype_of(case), device=device)
    return values, torch.full((case["history"],), 1e-8, dtype=torch.bfloat16, device=device)


def gaussian_amax(num_values: int) -> float:
    """About the largest |x| among ``num_values`` N(0, 1) draws: sqrt(2 ln n)."""
    return math.sqrt(2.0 * math.log(max(num_values, 2)))


def history_like(gen, length: int, typical_amax: float, dtype: torch.dtype) -> torch.Tensor:
    """An amax history of 0.4x to 1.1x ``typical_amax``: in some trials its max sets the scale, in
    others this step's amax (pushed in last) does."""
    values = typical_amax * (0.4 + 0.7 * torch.rand(length, generator=gen, device=gen.device))
    return settled(values).to(dtype)


_RECIPROCAL = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)


def settled(values: torch.Tensor) -> torch.Tensor:
    """``values`` (non-negative) rounded up to bf16 values whose scale ``v / 448`` equals ``v * fp32(1/448)``
    in fp32 (57 of the 128 bf16 values in each binade; the next one is at most 4 bf16 steps up)."""
    v = values.detach().to("cpu", torch.bfloat16)  # decided on the CPU: a GPU's `/ 448` is the other way
    for _ in range(16):
        f = v.float()
        unsettled = (f.double() / FP8_MAX).float() != f * _RECIPROCAL  # one rounding of the quotient vs the product
        if not bool(unsettled.any()):
            return v.to(values.device)
        v = torch.where(unsettled, (v.view(torch.int16) + 1).view(torch.bfloat16), v)
    raise AssertionError("no settled bf16 amax within 16 steps")  # never: the gaps are at most 4


def plant_settled_amax(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its largest |x| replaced, sign kept, by the settled bf16 value at or above it (so this
    step's amax sets a device-independent scale whenever it sets the scale)."""
    from torch._subclasses.fake_tensor import is_fake

    flat = x.reshape(-1)
    if flat.numel() == 0 or is_fake(x):  # `pkb show` describes shapes without values
        return x
    index = int(flat.float().abs().argmax())
    peak = flat[index].float()
    flat[index] = (torch.sign(peak) * settled(peak.abs()).float()).to(x.dtype)
    return x
