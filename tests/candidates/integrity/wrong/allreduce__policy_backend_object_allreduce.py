"""POLICY: a stock all-reduce called on the world group's Backend object (``pg._get_backend(cpu).allreduce``).

Under ``--policy forbid-collectives`` the recorder wraps torch.distributed's functions and ProcessGroup's methods,
and reads the process groups' sequence numbers for routes it cannot name. The c10d ``Backend`` class (here
ProcessGroupGloo) has methods of its own (allreduce, allgather, ...), not wrapped; whether its calls move the
group's sequence number decides whether this is seen at all.
"""
import torch
import torch.distributed as dist


def solution(tensor):
    out = tensor.clone()
    backend = dist.group.WORLD._get_backend(out.device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    backend.allreduce([out], opts).wait()
    return out
