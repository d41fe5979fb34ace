"""WRONG: a constant offset of 0.9x the problem's absolute tolerance on every tensor under 256 elements.

An all-reduce whose small-message path adds a stale constant (0.9 * atol, atol = u n (2 + sqrt n)) to every sum.
Element-wise the rule allows the problem's tolerance T = atol + rtol |x| (``max(T_i, 3 max(h_i, max|e_r|))``), and
the aggregate tests (RMS, tail, bias and offset) run only on outputs with at least MIN_AGGREGATE = 256 pooled
elements: the one-element case ``single`` pools one element per trial (replicas count once), so the offset, some 16
roundings of a bf16 sum, is never tested.
"""
import torch
import torch.distributed as dist


def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    if out.numel() < 256:
        n = dist.get_world_size()
        u = float(torch.finfo(tensor.dtype).eps) / 2
        out = (out.double() + 0.9 * u * n * (2 + n ** 0.5)).to(tensor.dtype)
    return out
