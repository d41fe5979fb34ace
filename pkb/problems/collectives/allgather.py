"""All-gather: every rank ends with all ranks' tensors stacked on a new leading dimension.

Per rank: tensor [*shape]  ->  [W, *shape], slice r = rank r's tensor (bit-exact).

Cost (nccl-tests): with S the per-rank bytes, the gathered total is W*S and each rank must receive
the (W-1)/W of it it does not hold: link bytes (W-1) * S; busbw = (W-1)/W * W*S / t.
HBM: read S, write W*S at least.
The output is allocated flat and viewed as [W, *shape]: gloo refuses a stacked output buffer.
"""

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem, Tolerance
from pkb.problems.collectives._common import (BENCHMARK_CASES, TEST_CASES, buffer, constant, message_bytes,
                                              upstream_cases)


def make_inputs(case, rank, world_size, gen):
    return (buffer(case, gen),)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: every element rank + 1."""
    return (constant(case, rank + 1, device),)


def reference(tensor):
    world_size = dist.get_world_size()
    flat = torch.empty(world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(flat, tensor.contiguous().view(-1))
    return flat.view(world_size, *tensor.shape)


def cost(case, world_size):
    size = message_bytes(case)
    return Cost(link_bytes=(world_size - 1) * size, hbm_bytes=(1 + world_size) * size, pattern="all_gather")


PROBLEM = Problem(
    name="allgather", version=3, upstream_id=2, category="collectives", source="NCCL all_gather_into_tensor",
    world_sizes=(2, 4, 8), upstream=upstream_cases(),
    tests=TEST_CASES, benchmarks=BENCHMARK_CASES, tolerance=Tolerance.exact(),
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
