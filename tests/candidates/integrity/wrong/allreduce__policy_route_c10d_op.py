"""POLICY route: the dispatcher's own c10d operator, ``torch.ops.c10d.allreduce_`` (what ProcessGroup's C++ methods
dispatch to), called directly with the boxed group and a TorchScript ReduceOp. Expected under ``--policy
forbid-collectives``: ``forbidden`` (``c10d_op.allreduce_``)."""
import torch
import torch.distributed as dist


def solution(tensor):
    out = tensor.clone()
    _, work = torch.ops.c10d.allreduce_([out], dist.group.WORLD.boxed(), torch.classes.c10d.ReduceOp(), None, False)
    work.wait()
    return out
