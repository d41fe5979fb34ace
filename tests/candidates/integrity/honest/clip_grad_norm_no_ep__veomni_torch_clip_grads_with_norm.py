"""Honest (real library code -- the problem's own source): VeOmni's FSDP2 clip_grad_norm path
(veomni/distributed/fsdp2/clip_grad_norm.py, _local_pth_sum + _fsdp2_reduce_group): each rank's sum of
||g||_p^p via torch._foreach_norm and _foreach_pow_ in fp32, all-reduced over the FSDP group, total ** (1/p),
then torch.nn.utils.clip_grads_with_norm_ -- torch's own clipping, which multiplies every gradient in place by
clamp(max_norm / (total_norm + 1e-6), max=1). The 1e-6 is torch's, in every VeOmni / torch clip_grad_norm_."""

import torch
import torch.distributed as dist


def solution(grad_tensors, max_norm, norm_type=2.0, fsdp_group=None):
    p = float(norm_type)
    device = grad_tensors[0].device if grad_tensors else torch.device("cpu")
    local = [g.detach().to(torch.float32) for g in grad_tensors]
    res = torch.tensor(0.0, device=device, dtype=torch.float32)
    if local:
        out = torch._foreach_pow_(list(torch._foreach_norm(local, p)), p)
        res += torch.sum(torch.stack(out))
    if fsdp_group is not None:
        dist.all_reduce(res, op=dist.ReduceOp.SUM, group=fsdp_group)
    total_norm = res ** (1.0 / p)
    params = []
    for g in grad_tensors:
        param = torch.nn.Parameter(torch.empty_like(g))
        param.grad = g
        params.append(param)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm
