"""Broadcast: every rank ends with the root's tensor.

Per rank: tensor [*shape] (random, distinct per rank), src (int, the root)  ->  [*shape] = the
root's tensor (bit-exact); the input is left unchanged. A test case puts the root on the last rank;
the upstream case passes the tensor alone (src left at its default, 0), as upstream's factory does.

Cost (nccl-tests): with S the buffer's bytes, every non-root rank must receive S and the root must
send it; a pipelined chain does both at once. link bytes S; busbw = S / t. HBM: read S, write S.
"""

import torch.distributed as dist

from pkb.problem import Cost, Problem, Tolerance
from pkb.problems.collectives._common import (BENCHMARK_CASES, buffer, constant, message_bytes, root_arguments,
                                              rooted_cases, upstream_cases)


def make_inputs(case, rank, world_size, gen):
    return (buffer(case, gen), *root_arguments(case, "src", world_size))


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: every element rank + 1."""
    return (constant(case, rank + 1, device),)  # src omitted: the function's default, 0


def reference(tensor, src=0):
    out = tensor.clone()
    dist.broadcast(out, src=src)
    return out


def cost(case, world_size):
    size = message_bytes(case)
    return Cost(link_bytes=size, hbm_bytes=2 * size, pattern="broadcast")


PROBLEM = Problem(
    name="broadcast", version=3, upstream_id=3, category="collectives", source="NCCL broadcast",
    world_sizes=(2, 4, 8), upstream=upstream_cases(src="omitted"),
    tests=rooted_cases("src"), benchmarks=BENCHMARK_CASES, tolerance=Tolerance.exact(),
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
