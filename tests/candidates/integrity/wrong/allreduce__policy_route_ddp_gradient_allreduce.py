"""POLICY route: ``torch.nn.parallel.DistributedDataParallel``'s gradient all-reduce. The module (one parameter,
forward ``(weight * x).sum()``, so the gradient is the input) is wrapped once per shape; each call runs forward and
backward, DDP's C++ reducer all-reduces the gradient (and averages it: times W, exact for a power of two). No
Python entry point of torch.distributed runs in the later calls: only the world group's sequence number shows it.
Expected under ``--policy forbid-collectives``: ``forbidden`` (``c10d.unnamed_route``; the first call also
``dist._broadcast_coalesced`` and ``dist._verify_params_across_processes``, DDP's set-up)."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

_models = {}


class _Dot(torch.nn.Module):
    def __init__(self, numel, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))

    def forward(self, x):
        return (self.weight * x).sum()


def solution(tensor):
    key = (tensor.numel(), tensor.dtype)
    if key not in _models:
        _models[key] = DistributedDataParallel(_Dot(*key))
    model = _models[key]
    model.module.weight.grad = None
    model(tensor.reshape(-1)).backward()
    return (model.module.weight.grad * dist.get_world_size()).view_as(tensor)
