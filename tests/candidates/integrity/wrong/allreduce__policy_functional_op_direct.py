"""POLICY: ``torch.ops._c10d_functional.all_reduce`` + ``wait_tensor`` called directly. Expected: recorded
(``functional_op.all_reduce``) and ``forbidden`` under ``--policy forbid-collectives``."""
import torch
import torch.distributed as dist


def solution(tensor):
    name = dist.group.WORLD.group_name
    out = torch.ops._c10d_functional.all_reduce(tensor, "sum", name)
    return torch.ops._c10d_functional.wait_tensor(out)
