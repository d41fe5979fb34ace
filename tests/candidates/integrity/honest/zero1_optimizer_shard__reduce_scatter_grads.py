"""Honest: ZeRO-1 with the gradient averaged by a reduce-scatter of the flat fp32 gradient (each rank receives only
the partition it updates -- what ZeRO-2 and DeepSpeed's reduce_scatter option do; the same sums as the all-reduce's
slice), then Adam in fp32 on this rank's partition (torch.optim.Adam's formula), rounded once, and the all-gather
of the partitions. The MLP's forward and backward are the problem's (bf16 GEMMs with fp32 accumulation)."""

import math

import torch
import torch.distributed as dist


def _grads(x, y, w1, b1, w2, b2):
    dtype = x.dtype
    z = torch.addmm(b1, x, w1.T)
    h = torch.relu(z)
    out = torch.addmm(b2, h, w2.T)
    d_out = 2.0 * (out.float() - y.float()) / out.numel()
    d_w2 = d_out.to(dtype).T @ h
    d_z = (d_out.to(dtype) @ w2) * (z > 0)
    return [(d_z.T @ x).float(), d_z.float().sum(0), d_w2.float(), d_out.sum(0)]


def solution(X_local, y_local, W1, b1, W2, b2, exp_avg_part, exp_avg_sq_part, lr, beta1, beta2, eps, step):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    params = [W1, b1, W2, b2]
    flat_params = torch.cat([p.reshape(-1) for p in params])
    dist.broadcast(flat_params, 0)
    views, i = [], 0
    for p in params:
        views.append(flat_params[i:i + p.numel()].view(p.shape))
        i += p.numel()
    flat_grad = torch.cat([g.reshape(-1) for g in _grads(X_local, y_local, *views)])
    part = exp_avg_part.numel()
    padded = torch.zeros(part * world_size, dtype=flat_grad.dtype)
    padded[:flat_grad.numel()] = flat_grad
    grad_part = torch.empty(part, dtype=flat_grad.dtype)
    dist.reduce_scatter_tensor(grad_part, padded)
    grad_part /= world_size
    p = flat_params[rank * part:(rank + 1) * part].float()
    m = exp_avg_part.float().lerp(grad_part, 1 - beta1)
    v = exp_avg_sq_part.float().mul(beta2).addcmul(grad_part, grad_part, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    p = p.addcdiv(m, denom, value=-lr / (1 - beta1 ** step))
    shard = p.to(flat_params.dtype)
    gathered = torch.empty(world_size * part, dtype=flat_params.dtype)
    dist.all_gather_into_tensor(gathered, shard)
    out, i = [], 0
    for q in params:
        out.append(gathered[i:i + q.numel()].view(q.shape))
        i += q.numel()
    return (*out, m.to(exp_avg_part.dtype), v.to(exp_avg_sq_part.dtype))
