"""Honest (real library arithmetic): apex / DeepSpeed FusedAdam's update (multi_tensor_adam, ADAM_MODE_0) in fp32:
m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; m_hat = m / bc1; v_hat = v / bc2; p -= lr * m_hat / (sqrt(v_hat) + eps),
rounded once to the master's dtype, then all-gathered. The same Adam as torch's, arranged as the fused kernel does."""

import torch
import torch.distributed as dist


def solution(grad_shard, master_shard, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, step):
    g = grad_shard.float()
    p = master_shard.float()
    m = beta1 * exp_avg.float() + (1 - beta1) * g
    v = beta2 * exp_avg_sq.float() + (1 - beta2) * g * g
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    update = (m / bc1) / (torch.sqrt(v / bc2) + eps)
    p = p - lr * update
    shard = p.to(master_shard.dtype)
    params = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype)
    dist.all_gather_into_tensor(params, shard)
    return params
