"""Honest (real library code, installed for the test only: pip install --no-deps fairscale): fairscale's
RowParallelLinear(input_is_parallel=True, bias=False) holding this rank's K shard of the weight (B_local^T), in the
inputs' dtype; its forward is F.linear then reduce_from_model_parallel_region (an all-reduce)."""

import torch
import torch.distributed as dist
from fairscale.nn.model_parallel import initialize as fs_init
from fairscale.nn.model_parallel.layers import RowParallelLinear


def solution(A_local, B_local):
    world = dist.get_world_size()
    if not fs_init.model_parallel_is_initialized():
        fs_init.initialize_model_parallel(world)
    k_local, n = B_local.shape
    layer = RowParallelLinear(k_local * world, n, bias=False, input_is_parallel=True,
                              init_method=lambda w: w)
    layer = layer.to(A_local.dtype)
    with torch.no_grad():
        layer.weight.copy_(B_local.t())
        return layer(A_local)
