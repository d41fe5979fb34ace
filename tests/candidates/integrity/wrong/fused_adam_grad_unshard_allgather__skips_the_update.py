"""WRONG: the optimizer does nothing: the old master parameters are all-gathered, no Adam step is taken.

In bf16 an Adam step (about 2.5e-4 here) is one or two ulps of a 0.02-sized weight. Every element is off by its
update, whose sign follows the gradient's moment, not the weight: the bias/offset fit e ~ alpha + beta x sees nothing;
the element-wise bound is max(T, 3x the reference's *largest* error), and the largest weights' half-ulp is bigger
than any update; the RMS test allows 8x one rounding's RMS; every element carries an error, so the median-based
shape test sees a bell, and the tail test measures errors against a sensitivity that includes rounding the weight.
"""
import torch
import torch.distributed as dist


def solution(grad_shard, master_shard, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step):
    params = torch.empty(dist.get_world_size() * master_shard.numel(), dtype=master_shard.dtype,
                         device=master_shard.device)
    dist.all_gather_into_tensor(params, master_shard.contiguous())
    return params
