"""Honest: LayerNorm weight/bias gradients with each column reduced by a pairwise tree over the rows in the run's
own dtype (bf16 accumulation in a bf16 run, fp32 in an fp32 run: the products and every partial sum rounded to the
input dtype, as a kernel that keeps its tree in bf16 registers does), then all-reduced in the input dtype. A
pairwise tree keeps the error at about log2(rows) roundings."""

import torch
import torch.distributed as dist


def _tree(x):
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            x = torch.cat([x, torch.zeros_like(x[:1])])
        x = x[0::2] + x[1::2]
    return x[0] if x.shape[0] else torch.zeros(x.shape[1:], dtype=x.dtype)


def solution(X_hat, dY):
    if dY.shape[0] == 0:
        d_gamma = torch.zeros(dY.shape[1], dtype=dY.dtype)
        d_beta = torch.zeros(dY.shape[1], dtype=dY.dtype)
    else:
        d_beta = _tree(dY.clone())
        d_gamma = _tree(dY * X_hat)
    dist.all_reduce(d_beta)
    dist.all_reduce(d_gamma)
    return d_gamma, d_beta
