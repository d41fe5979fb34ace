import torch
import torch.distributed as dist


def solution(tensor):  # a ring the other way round: the ranks added last to first, rounded after each addition
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    out = parts[-1].clone()
    for part in reversed(parts[:-1]):
        out = (out.float() + part.float()).to(tensor.dtype)
    return out
