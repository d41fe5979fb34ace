"""Honest: the naive GEMM kernel (each output element a plain sequential dot product over this rank's K, fp32
accumulator: here as a loop of rank-1 updates over k, so every element walks k = 0, 1, 2, ... in order), rounded
once to the input dtype, then all-reduced in the input dtype as Megatron's RowParallelLinear does. Only the order
of the dot product differs from the GEMM library's blocked one."""

import torch
import torch.distributed as dist


def solution(A_local, B_local):
    acc = torch.float64 if A_local.dtype == torch.float64 else torch.float32
    a, b = A_local.to(acc), B_local.to(acc)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=acc, device=a.device)
    for k in range(a.shape[1]):
        out += a[:, k:k + 1] * b[k:k + 1, :]
    partial = out.to(A_local.dtype)
    dist.all_reduce(partial)
    return partial
