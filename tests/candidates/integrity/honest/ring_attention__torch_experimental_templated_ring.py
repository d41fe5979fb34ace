"""Honest (real library code): torch's own context-parallel ring attention,
torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention (what
context_parallel() dispatches SDPA to), with the contiguous layout (load balancing off, as the problem's) and the
CPU flash SDPA kernel (aten._scaled_dot_product_flash_attention_for_cpu; on CUDA, the flash kernel) as the block
op: block outputs in the inputs' dtype, LSEs in fp32, merged in fp32 with the sigmoid/logsigmoid update."""

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel import _attention as cp


def solution(q, k, v, softmax_scale=None, causal=False, group=None):
    group = group if group is not None else dist.group.WORLD
    cp._cp_options.enable_load_balance = False
    op = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu if q.device.type == "cpu"
          else torch.ops.aten._scaled_dot_product_flash_attention)
    # [B, S, H, D] -> [B, H, S, D]
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, *_ = cp._templated_ring_attention(group, 2, op, qt, kt, vt, is_causal=causal, scale=scale)
    return out.transpose(1, 2).contiguous().to(q.dtype)
