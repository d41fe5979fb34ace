"""All-reduce (sum): every rank ends with the elementwise sum of all ranks' tensors.

Per rank: tensor [*shape] (random, distinct per rank)  ->  [*shape] = sum over ranks; the input is
left unchanged.

Cost (nccl-tests PERFORMANCE.md): with S the buffer's bytes, a ring or any other optimal algorithm
moves 2(W-1)/W * S into (and out of) each rank: (W-1)/W for the reduce-scatter half, the same again
for the all-gather half. busbw = 2(W-1)/W * S / t. HBM: read S, write S at least.
The reduction runs in the buffer's dtype as NCCL's does; the tolerance allows for any order.
"""

import torch.distributed as dist

from pkb.problem import Cost, Problem
from pkb.problems.collectives._common import (BENCHMARK_CASES, TEST_CASES, buffer, constant, message_bytes,
                                              sum_tolerance, upstream_cases)


def make_inputs(case, rank, world_size, gen):
    return (buffer(case, gen),)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: every element rank + 1."""
    return (constant(case, rank + 1, device),)


def reference(tensor):
    out = tensor.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def cost(case, world_size):
    size = message_bytes(case)
    return Cost(link_bytes=2 * (world_size - 1) / world_size * size, hbm_bytes=2 * size, pattern="all_reduce")


PROBLEM = Problem(
    name="allreduce", version=3, upstream_id=1, category="collectives", source="NCCL all_reduce (SUM)",
    world_sizes=(2, 4, 8), upstream=upstream_cases(),
    tests=TEST_CASES, benchmarks=BENCHMARK_CASES, tolerance=sum_tolerance,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
