"""Gather to a root: the root ends with all ranks' tensors stacked on a new leading dimension.

Per rank: tensor [*shape], dst (int, the root)  ->  on dst: [W, *shape], slice r = rank r's tensor;
on every other rank: an unchanged copy of its own tensor (bit-exact). The input is left unchanged.
A test case puts the root on the last rank; the upstream case passes the tensor alone (dst left at
its default, 0), as upstream's factory does.

Cost (nccl-tests): with S the per-rank bytes, the total is W*S and the root must receive the
(W-1)/W of it it does not hold: link bytes (W-1) * S; busbw = (W-1)/W * W*S / t.
HBM: the root writes W*S; every rank reads S.
"""

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem, Tolerance
from pkb.problems.collectives._common import (BENCHMARK_CASES, buffer, constant, message_bytes, root_arguments,
                                              rooted_cases, upstream_cases)


def make_inputs(case, rank, world_size, gen):
    return (buffer(case, gen), *root_arguments(case, "dst", world_size))


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: every element rank + 1."""
    return (constant(case, rank + 1, device),)  # dst omitted: the function's default, 0


def reference(tensor, dst=0):
    tensor = tensor.contiguous()
    if dist.get_rank() != dst:
        dist.gather(tensor, None, dst=dst)
        return tensor.clone()
    out = torch.empty((dist.get_world_size(), *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    dist.gather(tensor, list(out.unbind(0)), dst=dst)
    return out


def cost(case, world_size):
    size = message_bytes(case)
    return Cost(link_bytes=(world_size - 1) * size, hbm_bytes=(1 + world_size) * size, pattern="gather")


PROBLEM = Problem(
    name="gather", version=3, upstream_id=6, category="collectives", source="NCCL gather",
    world_sizes=(2, 4, 8), upstream=upstream_cases(dst="omitted"),
    tests=rooted_cases("dst"), benchmarks=BENCHMARK_CASES, tolerance=Tolerance.exact(),
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
