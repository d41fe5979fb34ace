"""Reduce (sum) to a root: the root ends with the sum of all ranks' tensors.

Per rank: tensor [*shape], dst (int, the root)  ->  on dst: [*shape] = sum over ranks; on every other
rank: an unchanged copy of its own tensor. (Upstream left the non-root output to whatever NCCL
leaves in the buffer, which is implementation-defined; here it is defined.) The input is left
unchanged. A test case puts the root on the last rank; the upstream case passes dst=0 as a Python int.

Cost (nccl-tests): with S the buffer's bytes, the root must receive S worth of partial sums
(pipelined chain); link bytes S; busbw = S / t. HBM: read S, write S.
"""

import torch.distributed as dist

from pkb.problem import Cost, Problem
from pkb.problems.collectives._common import (BENCHMARK_CASES, buffer, constant, message_bytes, root_arguments,
                                              rooted_cases, sum_tolerance, upstream_cases)


def make_inputs(case, rank, world_size, gen):
    return (buffer(case, gen), *root_arguments(case, "dst", world_size))


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: every element rank + 1."""
    return (constant(case, rank + 1, device), 0)


def reference(tensor, dst=0):
    out = tensor.clone()
    dist.reduce(out, dst=dst, op=dist.ReduceOp.SUM)
    return out if dist.get_rank() == dst else tensor.clone()


def cost(case, world_size):
    size = message_bytes(case)
    return Cost(link_bytes=size, hbm_bytes=2 * size, pattern="reduce")


PROBLEM = Problem(
    name="reduce", version=3, upstream_id=4, category="collectives", source="NCCL reduce (SUM)",
    world_sizes=(2, 4, 8), upstream=upstream_cases(dst=0),
    tests=rooted_cases("dst"), benchmarks=BENCHMARK_CASES, tolerance=sum_tolerance,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
