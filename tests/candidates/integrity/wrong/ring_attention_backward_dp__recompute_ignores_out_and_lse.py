"""Wrong for this problem (it ignores two of its arguments): the context-parallel attention backward that
recomputes instead of reading its `out` and `lse`: all-gather K and V over the CP group, recompute this rank's
attention probabilities P and output O in fp32 from q and k, delta = rowsum(dO * O), dS = P * (dO V^T - delta),
dQ = scale dS K, and the K/V gradients of the whole sequence, reduce-scattered over the CP group in fp32 so each rank
gets its block's; rounded to the inputs' dtype and averaged over the DP group in that dtype as the reference does.
The function is the gradient given the forward's saved `out` and `lse` (FlashAttention's backward reads the saved O
for delta, as upstream's reference does); this one answers for the unrounded forward instead. In bf16 the two differ
by the rounding of `out`, concentrated where delta moves a whole row: 0.36-0.40 % of dq beyond 8 median errors where
the reference has 0.02 % (`mismatch`, the outlier test, every run). In fp32 the difference is near the noise: it
fails most runs (0.56-0.91 % on the causal case) and passes some (a `known` row)."""

import torch
import torch.distributed as dist


def _size(g):
    return dist.get_world_size(g) if g is not None else dist.get_world_size()


def solution(dout, q, k, v, out, softmax_lse, softmax_scale=None, causal=False, cp_group=None, dp_group=None):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    world, me = _size(cp_group), dist.get_rank(cp_group)
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    rep = Hq // Hkv
    ks = [torch.empty_like(k) for _ in range(world)]
    vs = [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k.contiguous(), group=cp_group)
    dist.all_gather(vs, v.contiguous(), group=cp_group)
    K = torch.cat(ks, 1).float().permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)  # [B, Hq, S*W, D]
    V = torch.cat(vs, 1).float().permute(0, 2, 1, 3).repeat_interleave(rep, dim=1)
    Q = q.float().permute(0, 2, 1, 3)
    dO = dout.float().permute(0, 2, 1, 3)
    s = torch.matmul(Q, K.transpose(-1, -2)) * scale
    if causal:
        qp = me * S + torch.arange(S)
        s = s.masked_fill(torch.arange(S * world)[None, :] > qp[:, None], float("-inf"))
    P = torch.softmax(s, dim=-1)
    O = torch.matmul(P, V)
    delta = (dO * O).sum(-1, keepdim=True)
    dS = P * (torch.matmul(dO, V.transpose(-1, -2)) - delta)
    dQ = scale * torch.matmul(dS, K)
    dK = scale * torch.matmul(dS.transpose(-1, -2), Q)  # [B, Hq, S*W, D]
    dV = torch.matmul(P.transpose(-1, -2), dO)
    dK = dK.view(B, Hkv, rep, S * world, D).sum(2).permute(0, 2, 1, 3)  # [B, S*W, Hkv, D]
    dV = dV.view(B, Hkv, rep, S * world, -1).sum(2).permute(0, 2, 1, 3)
    dkv = torch.cat([dK, dV], dim=-1).contiguous()
    mine = torch.empty((B, S, Hkv, dkv.shape[-1]), dtype=torch.float32)
    chunks = [c.contiguous() for c in dkv.split(S, dim=1)]
    dist.reduce_scatter(mine, chunks, group=cp_group)
    grads = [dQ.permute(0, 2, 1, 3).to(q.dtype), mine[..., :D].to(k.dtype), mine[..., D:].to(v.dtype)]
    if dp_group is None or _size(dp_group) == 1:
        return tuple(grads)
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=dp_group)
    flat.div_(_size(dp_group))
    return tuple(part.view(g.shape) for part, g in zip(flat.split([g.numel() for g in grads]), grads))
