"""Honest (FlashAttention-2's own arithmetic): ring attention with the online softmax in fp32 computed as
FlashAttention-2 does it on the GPU: exp2 instead of exp, with the softmax scale folded into
scale_log2 = softmax_scale * log2(e) (one fp32 constant, as flash_fwd_kernel's params.scale_softmax_log2), so
p = exp2(s * scale_log2 - m * scale_log2); running max, running sum and un-normalised accumulator rescaled as each
K/V block arrives, normalised once at the end and rounded once."""

import math

import torch
import torch.distributed as dist


def solution(q, k, v, softmax_scale=None, causal=False, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    B, S, H, D = q.shape
    scale_log2 = torch.tensor(scale * math.log2(math.e), dtype=torch.float32)
    Q = q.float().permute(0, 2, 1, 3)
    m = torch.full((B, H, S, 1), float("-inf"))
    l = torch.zeros(B, H, S, 1)
    acc = torch.zeros(B, H, S, v.shape[-1])
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    kk, vv = k.contiguous(), v.contiguous()
    for step in range(world):
        source = (rank - step) % world
        if not causal or source <= rank:
            K = kk.float().permute(0, 2, 1, 3)
            V = vv.float().permute(0, 2, 1, 3)
            s = torch.matmul(Q, K.transpose(-1, -2))  # raw scores; the scale is folded into exp2
            if causal and source == rank:
                idx = torch.arange(S)
                s = s.masked_fill(idx[None, :] > idx[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp2(m * scale_log2 - safe * scale_log2)
            p = torch.exp2(s * scale_log2 - safe * scale_log2)
            l = l * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, V)
            m = m_new
        if step + 1 < world:
            nk, nv = torch.empty_like(kk), torch.empty_like(vv)
            ops = [dist.P2POp(dist.isend, kk, nxt, group), dist.P2POp(dist.isend, vv, nxt, group),
                   dist.P2POp(dist.irecv, nk, prv, group), dist.P2POp(dist.irecv, nv, prv, group)]
            for r in dist.batch_isend_irecv(ops):
                r.wait()
            kk, vv = nk, nv
    out = acc / l
    return out.permute(0, 2, 1, 3).to(q.dtype)
