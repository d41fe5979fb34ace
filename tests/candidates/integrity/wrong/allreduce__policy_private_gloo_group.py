"""POLICY: the stock all-reduce on a private ProcessGroupGloo that the candidate builds itself from the default store.

``dist.ProcessGroupGloo(PrefixStore(..., default store), rank, world, timeout)`` is a c10d Backend never registered
in ``c10d._world.pg_map``: its methods are not among the wrapped entry points (ProcessGroup's and
torch.distributed's), and the recorder's sequence-number check only reads the groups of ``pg_map``. Under
``--policy forbid-collectives`` the stock gloo all-reduce then runs with ``collectives_used`` empty.
"""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_group = []


def _private():
    if not _group:
        store = dist.PrefixStore("private_gloo", c10d._get_default_store())
        _group.append(dist.ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(),
                                            datetime.timedelta(seconds=60)))
    return _group[0]


def solution(tensor):
    out = tensor.clone()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    _private().allreduce([out], opts).wait()
    return out
