"""Honest (a faithful port of the real library): zhuzilin ring-flash-attention's ring_flash_attn_func forward with
flash-attn's kernel numerics. Each ring step runs a FlashAttention-style block: S = QK^T accumulated in fp32, the
softmax in fp32 (row max, exp, row sum), P rounded to the input dtype for the PV GEMM (fp32 accumulation), the
block output rounded to the input dtype and its LSE kept in fp32 -- exactly what flash_attn's _flash_attn_forward
returns -- then merged in fp32 with ring-flash-attn's update_out_and_lse (sigmoid / logsigmoid form), and the result
rounded once more to the input dtype. K/V travel by send/recv around the ring. Every rounding is one the library
makes; nothing is lost."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _flash_block(q, k, v, scale, causal, q_start, k_start):
    # q [B, S, H, D] -> [B, H, S, D]
    qf = q.float().permute(0, 2, 1, 3)
    kf = k.float().permute(0, 2, 1, 3)
    vf = v.float().permute(0, 2, 1, 3)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        qp = q_start + torch.arange(q.shape[1])
        kp = k_start + torch.arange(k.shape[1])
        s = s.masked_fill(kp[None, :] > qp[:, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = torch.matmul(p.to(q.dtype).float(), vf) / l
    lse = (m + torch.log(l)).squeeze(-1)  # [B, H, S]
    return o.permute(0, 2, 1, 3).to(q.dtype), lse


def _update(out, lse, block_out, block_lse):
    # ring_flash_attn.utils._update_out_and_lse
    block_out = block_out.float()
    block_lse = block_lse.transpose(-2, -1).unsqueeze(-1)  # [B, S, H, 1]
    if out is None:
        return block_out, block_lse
    out = out - torch.sigmoid(block_lse - lse) * (out - block_out)
    lse = lse - F.logsigmoid(lse - block_lse)
    return out, lse


def solution(q, k, v, softmax_scale=None, causal=False, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    S = q.shape[1]
    nxt = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    prv = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    out = lse = None
    kk, vv = k.contiguous(), v.contiguous()
    for step in range(world):
        if step + 1 < world:
            nk, nv = torch.empty_like(kk), torch.empty_like(vv)
            ops = [dist.P2POp(dist.isend, kk, nxt, group), dist.P2POp(dist.isend, vv, nxt, group),
                   dist.P2POp(dist.irecv, nk, prv, group), dist.P2POp(dist.irecv, nv, prv, group)]
            reqs = dist.batch_isend_irecv(ops)
        source = (rank - step) % world
        if not causal or source <= rank:
            bo, bl = _flash_block(q, kk, vv, scale, causal and source == rank, rank * S, source * S)
            out, lse = _update(out, lse, bo, bl)
        if step + 1 < world:
            for r in reqs:
                r.wait()
            kk, vv = nk, nv
    return out.to(q.dtype)
