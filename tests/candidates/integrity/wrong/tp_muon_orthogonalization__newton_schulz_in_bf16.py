"""Newton-Schulz in bf16 (Keller Jordan's single-GPU Muon habit) where the problem computes in fp32: Megatron's
tensor-parallel Muon (Emerging-Optimizers), the problem's source, normalises and iterates in fp32 and rounds to the
input's dtype once at the end ("bf16 (fp32 compute)", catalog row 86). Here every Gram matrix, all-reduce and addmm
is in bf16: the result's RMS error is some 10x the reference's (issue 53 measured 9-11x), all of it from arithmetic
below the problem's precision. Wrong for this problem in bf16 runs too."""

import torch
import torch.distributed as dist

QUINTIC = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
COEFFICIENTS = {"simple": ((3.4445, -4.7750, 2.0315),), "quintic": QUINTIC}


@torch.no_grad()
def solution(x, steps=5, coefficient_type="quintic", partition_dim=1, group=None):
    group = group or dist.group.WORLD
    coefficients = COEFFICIENTS[coefficient_type]
    work = x.mT.contiguous() if partition_dim == 0 else x
    in_dtype = work.dtype
    work = work.to(torch.bfloat16)
    norm_sq = (work * work).sum()
    dist.all_reduce(norm_sq, group=group)
    work = work / torch.sqrt(norm_sq).clamp_min(1e-7)
    for step in range(steps):
        a, b, c = coefficients[step % len(coefficients)]
        gram = work @ work.mT
        dist.all_reduce(gram, group=group)
        update = torch.addmm(gram, gram, gram, alpha=c, beta=b)
        work = torch.addmm(work, update, work, alpha=1.0, beta=a)
    work = work.to(in_dtype)
    return work.mT.contiguous() if partition_dim == 0 else work.contiguous()
