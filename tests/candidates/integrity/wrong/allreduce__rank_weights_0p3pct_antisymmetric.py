"""WRONG: a weighted, not plain, sum: even ranks' tensors count 1.003 times and odd ranks' 0.997 times.

The answer is sum_r (1 + EPS c_r) x_r with c_r = +1 on even ranks and -1 on odd ones, so the error
e = EPS (x_0 - x_1 + x_2 - ...) is a fixed linear function of the *inputs* that is uncorrelated with the output
x = sum_r x_r (the ranks' inputs have the same distribution). The bias test fits e ~ alpha + beta x only, so beta and
alpha stay within a standard error or two of zero; e is a smooth, bell-shaped spread on every element (no outlier
tail), about 2x the reference's RMS error in bf16 (8x passes), and within the tolerance element-wise. A gradient
all-reduce that weighs some ranks' gradients 0.6 % more than others is wrong however the gains are arranged;
the rule misses it because it only looks for errors that follow the output value. Tensors of fewer than 64
elements are summed honestly: on the one-element case a cancelling sum (x_0 ~ -x_1) makes the error many
roundings of the tiny result, which the RMS test catches in about one run in three.
Passes `pkb eval allreduce <this> --mode cpu --world-size 2` (also 4) as `ok`.
"""
import torch
import torch.distributed as dist

EPS = 0.003


def solution(tensor):
    if tensor.numel() < 64:
        out = tensor.clone()
        dist.all_reduce(out)
        return out
    weight = 1.0 + EPS * (1.0 if dist.get_rank() % 2 == 0 else -1.0)
    out = tensor.float() * weight
    dist.all_reduce(out)
    return out.to(tensor.dtype)
