"""All-reduce as reduce-scatter + all-gather, accumulating in fp32: a different decomposition and a
different rounding than the reference's all_reduce, which the tolerance must accept.

Per rank: tensor [*shape] -> [*shape], the sum over ranks. The flat buffer is padded to a multiple
of W, reduce-scattered in fp32 (each rank owns one 1/W slice of the sum), rounded once to the input
dtype, and all-gathered. Bytes per rank: (W-1)/W of the fp32 buffer in, (W-1)/W of the result out.
Runs anywhere torch.distributed does (gloo on CPU, NCCL on GPUs).
"""

import torch
import torch.distributed as dist


def solution(tensor):
    world_size = dist.get_world_size()
    flat = tensor.reshape(-1).to(torch.float32)
    padded = -(-flat.numel() // world_size) * world_size
    flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
    mine = torch.empty(padded // world_size, dtype=torch.float32, device=tensor.device)
    dist.reduce_scatter_tensor(mine, flat, op=dist.ReduceOp.SUM)
    gathered = torch.empty(padded, dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(gathered, mine.to(tensor.dtype))
    return gathered[: tensor.numel()].view(tensor.shape)
