"""Wrong: the reference's norm, and then the gradients clipped with a coefficient 5e-6 larger (the declared bias of torch's clipping runs the other way: the gradients come out smaller, never larger). In fp32 it is hundreds of
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
        coef = (max_norm / total_norm) * (1.0 + 5e-6)
        for g in grad_tensors:
            g.mul_(coef)
    return total_norm
