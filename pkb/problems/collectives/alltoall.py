"""All-to-all: rank r sends chunk d of its tensor to rank d and receives chunk r of every rank.

Per rank: tensor [W, *shape] (chunk d is for rank d)  ->  [W, *shape], chunk s = rank s's chunk r
(bit-exact). The input is left unchanged. The case's shape is one chunk's.

Cost (nccl-tests): with S the per-rank input bytes (W chunks), each rank must send and receive the
(W-1)/W of it that is not its own: link bytes (W-1)/W * S; busbw = (W-1)/W * S / t.
HBM: read S, write S.
"""

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem, Tolerance
from pkb.problems.collectives._common import (BENCHMARK_CASES, TEST_CASES, buffer, constant, message_bytes,
                                              upstream_cases)


def make_inputs(case, rank, world_size, gen):
    return (buffer(case, gen, world_size),)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: chunk d of rank r holds 10 r + d (each chunk's origin and destination readable)."""
    return (torch.stack([constant(case, 10 * rank + d, device) for d in range(world_size)]),)


def reference(tensor):
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor.contiguous())
    return out


def cost(case, world_size):
    input_bytes = world_size * message_bytes(case)
    return Cost(link_bytes=(world_size - 1) / world_size * input_bytes, hbm_bytes=2 * input_bytes,
                pattern="all_to_all")


PROBLEM = Problem(
    name="alltoall", version=3, upstream_id=8, category="collectives", source="NCCL all_to_all_single",
    world_sizes=(2, 4, 8), upstream=upstream_cases(),
    tests=TEST_CASES, benchmarks=BENCHMARK_CASES, tolerance=Tolerance.exact(),
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
