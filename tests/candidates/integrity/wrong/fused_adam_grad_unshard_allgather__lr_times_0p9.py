"""WRONG: Adam with 0.9x the learning rate (a wrong lr schedule: a 10 % smaller step).

Same reasoning as ``__skips_the_update``: the error is a tenth of the update, aligned with the gradient's moment and not
with the weight, sub-ulp to two ulps in bf16; no test of the rule looks at an error correlated with anything but the
output value itself.
"""
import torch
import torch.distributed as dist


def solution(grad_shard, master_shard, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step):
    w, m, v = (t.to(torch.float32, copy=True) for t in (master_shard, exp_avg, exp_avg_sq))
    g = grad_shard.float()
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    w.addcdiv_(m, denom, value=-(0.9 * lr) / (1 - beta1 ** step))
    shard = w.to(master_shard.dtype)
    params = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(params, shard)
    return params
