"""WRONG: the recipe's mean, then every element pushed by +-0.45 of its rtol (one bf16 ulp on about half of them) at random.

A problem without an exact answer (``exact_dtype`` None) is judged against the reference's output: no sensitivity,
so no tail test; e_r = 0, so the RMS test allows 8x one rounding's RMS (sqrt(1/3) half-ulps each), about 4.6 half-ulps
RMS; the element-wise bound is the tolerance (rtol 2^-7: one ulp). Honest kernels here differ from the recipe on
a few elements by one rounding; this one differs on most elements, by a coin flip each (no bias).
"""
import torch
import torch.distributed as dist


def _dequantized(flat_grad, block_size):
    values = flat_grad.float()
    numel = values.numel()
    padded = torch.nn.functional.pad(values, (0, -numel % block_size)).view(-1, block_size)
    scale = padded.abs().amax(dim=1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round(padded / safe), -127, 127).to(torch.int8)
    return (codes.float() * scale).view(-1)[:numel]


def solution(flat_grad, block_size):
    total = _dequantized(flat_grad, block_size)
    dist.all_reduce(total)
    mean = (total / dist.get_world_size()).double()
    idx = torch.arange(mean.numel())
    sign = torch.where((idx * 2654435761 % 1009) % 2 == 0, 1.0, -1.0).double()
    rtol = 2.0 ** -{torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[flat_grad.dtype]
    return (mean * (1 + 0.45 * rtol * sign)).to(flat_grad.dtype)
