"""Reduce-scatter (sum) along dim 0: rank r ends with the sum over ranks of block r.

Per rank: tensor [W*rows, *rest] (random, distinct per rank), where the case's shape is the
output's [rows, *rest]  ->  [rows, *rest] = sum over ranks s of tensor_s[r*rows:(r+1)*rows].
The input is left unchanged.

Cost (nccl-tests): with S the per-rank input bytes (W blocks), each rank must receive (W-1)/W * S
worth of partial sums; busbw = (W-1)/W * S / t. HBM: read S, write S/W.
"""

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem
from pkb.problems.collectives._common import (BENCHMARK_CASES, TEST_CASES, buffer, constant, dtype_of, message_bytes,
                                              sum_tolerance, upstream_cases)


def make_inputs(case, rank, world_size, gen):
    block = buffer(case, gen, world_size)  # [W, rows, *rest]
    return (block.reshape(world_size * case["shape"][0], *case["shape"][1:]),)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: [W * M, N] of rank + 1."""
    rows, *rest = case["shape"]
    return (torch.full((world_size * rows, *rest), float(rank + 1), dtype=dtype_of(case), device=device),)


def reference(tensor):
    world_size = dist.get_world_size()
    out = torch.empty((tensor.shape[0] // world_size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    dist.reduce_scatter_tensor(out, tensor.contiguous(), op=dist.ReduceOp.SUM)
    return out


def cost(case, world_size):
    input_bytes = world_size * message_bytes(case)
    return Cost(link_bytes=(world_size - 1) / world_size * input_bytes,
                hbm_bytes=input_bytes + input_bytes / world_size, pattern="reduce_scatter")


PROBLEM = Problem(
    name="reducescatter", version=3, upstream_id=7, category="collectives", source="NCCL reduce_scatter (SUM)",
    world_sizes=(2, 4, 8), upstream=upstream_cases(),
    tests=TEST_CASES, benchmarks=BENCHMARK_CASES, tolerance=sum_tolerance,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
