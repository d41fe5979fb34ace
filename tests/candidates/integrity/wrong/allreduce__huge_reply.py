"""STATUS: replies with the right output plus 256 MiB of extra tensors (an attempt on the parent's memory).
Expected: the parent refuses a reply over 4x the reference's bytes + 16 MiB and counts it the candidate's failure."""
import torch
import torch.distributed as dist


def solution(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return [out, torch.zeros(64 << 20, dtype=torch.float32)]
