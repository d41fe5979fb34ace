"""Triton imported at the top: where Triton is not installed (or no GPU can run its kernels), the file
needs what the mode lacks and is ``skipped``, never failed; on a GPU it copies each rank's share with a
Triton kernel."""

import torch
import torch.distributed as dist
import triton
import triton.language as tl

EXPECTED = {"cpu": "skipped", "shared-gpu": "ok", "cuda": "ok"}


@triton.jit
def _copy_kernel(source, target, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(target + offsets, tl.load(source + offsets, mask=mask), mask=mask)


def solution(tensor):
    staged = torch.empty_like(tensor).contiguous()
    n = tensor.numel()
    if n:
        _copy_kernel[(triton.cdiv(n, 1024),)](tensor.contiguous(), staged, n, BLOCK=1024)
    out = tensor.new_empty((dist.get_world_size(),) + tuple(tensor.shape))
    dist.all_gather_into_tensor(out, staged)
    return out
