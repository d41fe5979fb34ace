import torch
import torch.distributed as dist


def solution(tensor):  # two-shot: reduce-scatter in fp32, round the shard once, all-gather it
    world_size = dist.get_world_size()
    flat = tensor.float().reshape(-1)
    padded = torch.zeros(-(-flat.numel() // world_size) * world_size, dtype=torch.float32)
    padded[:flat.numel()] = flat
    shard = torch.empty(padded.numel() // world_size, dtype=torch.float32)
    dist.reduce_scatter_tensor(shard, padded)
    out = torch.empty(padded.numel(), dtype=tensor.dtype)
    dist.all_gather_into_tensor(out, shard.to(tensor.dtype))
    return out[:flat.numel()].reshape(tensor.shape)
