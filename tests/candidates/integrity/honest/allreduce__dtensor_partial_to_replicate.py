"""Honest (real library code): DTensor: each rank's buffer as the local piece of a Partial (sum) DTensor on a 1-D
device mesh, redistributed to Replicate (torch issues the all-reduce)."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate


def solution(tensor):
    device_type = tensor.device.type
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    d = DTensor.from_local(tensor.clone(), mesh, [Partial("sum")], run_check=False)
    return d.redistribute(mesh, [Replicate()]).to_local().clone()
