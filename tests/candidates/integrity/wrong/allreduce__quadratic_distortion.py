"""WRONG: a systematic magnitude-dependent distortion e = g (x^2 - E x^2), invisible to a linear bias fit.

Each output is moved by g (x^2 - n) (n the world size, E x^2 for the sum of n N(0,1) buffers), g chosen so the
largest elements move by about two bf16 roundings: large sums are inflated, small ones shrunk, every time, on every
tensor. The bias test fits e ~ alpha + beta x: an error even in x with mean zero has alpha = beta = 0, and
its RMS is within 8x the reference's.
"""
import torch
import torch.distributed as dist


def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    n = dist.get_world_size()
    u = float(torch.finfo(tensor.dtype).eps) / 2
    x = out.double()
    g = 2 * u / (n ** 0.5 * 5)  # about 2 u |x| at |x| = 5 sqrt(n)
    return (x + g * (x * x - n)).to(tensor.dtype)
