"""Honest: all-gather K and V (exact data movement), then ordinary attention of this rank's queries against the
whole sequence in fp32 (one softmax over all keys, causal mask at the global positions), rounded once. Fewer
roundings than the ring's LSE merges."""

import torch
import torch.distributed as dist


def solution(q, k, v, softmax_scale=None, causal=False, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    ks = [torch.empty_like(k) for _ in range(world)]
    vs = [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k.contiguous(), group=group)
    dist.all_gather(vs, v.contiguous(), group=group)
    K = torch.cat(ks, 1).float().permute(0, 2, 1, 3)
    V = torch.cat(vs, 1).float().permute(0, 2, 1, 3)
    Q = q.float().permute(0, 2, 1, 3)
    s = torch.matmul(Q, K.transpose(-1, -2)) * scale
    S = q.shape[1]
    if causal:
        qp = rank * S + torch.arange(S)
        kp = torch.arange(K.shape[2])
        s = s.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.matmul(p, V)
    return o.permute(0, 2, 1, 3).to(q.dtype)
