"""POLICY route: the all-reduce asked of the ProcessGroup object itself (``pg.allreduce``), not through
``torch.distributed``'s functions. Expected under ``--policy forbid-collectives``: ``forbidden``
(``ProcessGroup.allreduce``)."""
import torch.distributed as dist


def solution(tensor):
    out = tensor.clone()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    dist.group.WORLD.allreduce([out], opts).wait()
    return out
