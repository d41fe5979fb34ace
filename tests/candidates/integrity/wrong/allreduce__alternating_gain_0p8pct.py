"""WRONG: the correct sum times 1.008 on even flat indices and 0.992 on odd ones.

Every element is off by 0.8 % of itself, half of them up and half down, so the least-squares fit e ~ alpha + beta x
of the bias test sees no gain (the two signs cancel) and no offset; the error is proportional to each element's own
scale, so no element stands out in the outlier test; 0.8 % is under the bf16 rtol (4u = 1.6 %) element-wise; and its
RMS is about 4.6x the larger of the reference's and one rounding's, under RMS_FACTOR = 8. An all-reduce that
returns x (1 +- 0.8 %) is wrong (a rounding is 0.2-0.4 % at most and follows no pattern); the rule misses it
because in bf16 the RMS budget leaves room for ~4.6 roundings of *any* unbiased, non-heavy-tailed error pattern.
Passes `pkb eval allreduce <this> --mode cpu --world-size 2` as `ok`.
"""
import torch
import torch.distributed as dist

EPS = 0.008


def solution(tensor):
    out = tensor.float()
    dist.all_reduce(out)
    flat = out.reshape(-1)
    sign = 1.0 - 2.0 * (torch.arange(flat.numel()) % 2).float()
    return (flat * (1.0 + EPS * sign)).view(tensor.shape).to(tensor.dtype)
