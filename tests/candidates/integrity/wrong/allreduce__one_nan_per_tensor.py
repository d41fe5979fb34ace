"""WRONG: one NaN per output (its first element) where the reference and the exact answer are finite.
Expected: element-wise failure ("NaN or inf where neither the reference nor the exact answer has one")."""
import torch
import torch.distributed as dist


def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    out.view(-1)[0] = float("nan")
    return out
