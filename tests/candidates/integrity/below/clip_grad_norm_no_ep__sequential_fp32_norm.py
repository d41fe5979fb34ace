"""Honest in bf16, below the run's tolerance in fp32: the local norm term |g|^p summed in fp32 in plain sequential
order (one accumulator walking every element of every gradient, numpy's float32 accumulate: torch.cumsum on the CPU
accumulates in double, which would not be this kernel), all-reduced in fp32, then clipped in place exactly as the
reference (fp32 coefficient, one rounding to the gradient dtype). Over upstream's 3M squares per rank the running
sum's rounding swamps the smallest squares, always downward: the norm comes out some 2.6e-4 low, within bf16's
tolerance (`ok`) and beyond fp32's (1e-4 relative: pkb fails it by design, `mismatch`; the paper's 1e-2 passes it)."""

import numpy as np
import torch
import torch.distributed as dist


def solution(grad_tensors, max_norm, norm_type=2.0, fsdp_group=None):
    p = float(norm_type)
    device = grad_tensors[0].device if grad_tensors else torch.device("cpu")
    term = torch.zeros((), dtype=torch.float32, device=device)
    for g in grad_tensors:
        v = g.detach().float().reshape(-1)
        if v.numel():
            powered = v * v if p == 2.0 else v.abs().pow(p)
            running = np.add.accumulate(powered.cpu().numpy(), dtype=np.float32)  # one fp32 accumulator, in order
            term = term + torch.tensor(float(running[-1]), dtype=torch.float32, device=device)
    if fsdp_group is not None:
        dist.all_reduce(term, group=fsdp_group)
    total_norm = term ** (1.0 / p)
    if total_norm > max_norm:
        coef = max_norm / total_norm
        for g in grad_tensors:
            g.mul_(coef)
    return total_norm
