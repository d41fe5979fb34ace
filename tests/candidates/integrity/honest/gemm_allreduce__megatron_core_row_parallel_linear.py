"""Honest (real library code, installed for the test only: pip install --no-deps megatron-core): Megatron-core's
tensor_parallel.RowParallelLinear(input_is_parallel=True, bias=False) on a tensor-parallel group spanning the
world, in the inputs' dtype, holding this rank's K shard of the weight (B_local^T); its forward is the linear
then reduce_from_tensor_model_parallel_region (an all-reduce)."""

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import RowParallelLinear


def solution(A_local, B_local):
    world = dist.get_world_size()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
    k_local, n = B_local.shape
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                              params_dtype=A_local.dtype, perform_initialization=False)
    layer = RowParallelLinear(k_local * world, n, config=cfg, init_method=lambda w: w, bias=False,
                              input_is_parallel=True, skip_bias_add=True)
    with torch.no_grad():
        layer.weight.copy_(B_local.t())
        out, _ = layer(A_local)
    return out
