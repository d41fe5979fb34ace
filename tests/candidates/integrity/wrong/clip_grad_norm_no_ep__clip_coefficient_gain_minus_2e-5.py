"""Wrong: the reference's norm, and then the gradients clipped with a coefficient 2e-5 smaller (beyond torch's 1e-6 / norm, which the problem declares). In fp32 it is hundreds of
standard errors of the bias test from the range pkb allows; in bf16 it is below a rounding (only the fp32 row is
run)."""

import torch
import torch.distributed as dist


def solution(grad_tensors, max_norm, norm_type=2.0, fsdp_group=None):
    p = float(norm_type)
    device = grad_tensors[0].device if grad_tensors else torch.device("cpu")
    term = torch.zeros((), dtype=torch.float32, device=device)
    for g in grad_tensors:
        term = term + torch.linalg.vector_norm(g.float(), p) ** p
    if fsdp_group is not None:
        dist.all_reduce(term, group=fsdp_group)
    total_norm = term ** (1.0 / p)
    if total_norm > max_norm:
        coef = (max_norm / total_norm) * (1.0 - 2e-5)
        for g in grad_tensors:
            g.mul_(coef)
    return total_norm
