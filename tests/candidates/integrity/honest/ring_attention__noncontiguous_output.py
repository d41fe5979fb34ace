"""Honest: all-gather K and V, attention in fp32 on [B, H, S, D] tensors, and the result returned as the
transposed view [B, S, H, D] of the [B, H, S, D] buffer (not made contiguous: a view with other strides, the same
values in the same logical places)."""

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
        s = s.masked_fill(torch.arange(K.shape[2])[None, :] > qp[:, None], float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1), V).to(q.dtype).contiguous()  # [B, H, S, D]
    return o.transpose(1, 2)
