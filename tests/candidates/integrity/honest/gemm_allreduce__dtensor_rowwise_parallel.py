"""Honest (real library code): torch.distributed.tensor.parallel.RowwiseParallel applied with parallelize_module to
an nn.Linear(K, N, bias=False) on a 1-D device mesh; its weight is this rank's K shard (B_local^T) as a Shard(1)
DTensor, the input the local Shard(-1) activations, and DTensor all-reduces the Partial output to Replicate."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module


def solution(A_local, B_local):
    world = dist.get_world_size()
    mesh = init_device_mesh(A_local.device.type, (world,))
    k_local, n = B_local.shape
    with torch.device("meta"):
        layer = torch.nn.Linear(k_local * world, n, bias=False, dtype=A_local.dtype)
    layer = parallelize_module(layer, mesh, RowwiseParallel())
    layer.weight = torch.nn.Parameter(DTensor.from_local(B_local.t().contiguous(), mesh, [Shard(1)], run_check=False),
                                      requires_grad=False)
    with torch.no_grad():
        out = layer(A_local)
    return out.to_local() if isinstance(out, DTensor) else out
