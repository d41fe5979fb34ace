"""Scatter from a root: rank r ends with slice r of the root's [W, *shape] tensor.

Per rank: tensor, src (int, the root). On src: tensor [W, *shape]; on every other rank: tensor
[*shape], a receive buffer of the output's shape (random, so an answer that returns it fails).
Output: [*shape] = slice `rank` of the root's tensor (bit-exact). Inputs are left unchanged.
A test case puts the root on the last rank; the upstream case passes the tensor alone (src left at
its default, 0), as upstream's factory does.

Cost (nccl-tests): with S the bytes of one slice, the total is W*S and the root must send the
(W-1)/W of it that is not its own: link bytes (W-1) * S; busbw = (W-1)/W * W*S / t.
HBM: read S, write S per rank (the root reads W*S).
"""

import torch
import torch.distributed as dist

from pkb.problem import Cost, Problem, Tolerance
from pkb.problems.collectives._common import (BENCHMARK_CASES, buffer, constant, message_bytes, root_arguments, root_of,
                                              rooted_cases, upstream_cases)


def make_inputs(case, rank, world_size, gen):
    tensor = buffer(case, gen, world_size) if rank == root_of(case, "src", world_size) else buffer(case, gen)
    return (tensor, *root_arguments(case, "src", world_size))


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: on the root (0) the W chunks i + 1 stacked, zeros elsewhere."""
    if rank == 0:
        return (torch.stack([constant(case, i + 1, device) for i in range(world_size)]),)
    return (constant(case, 0, device),)


def reference(tensor, src=0):
    if dist.get_rank() == src:
        chunks = [chunk.contiguous() for chunk in tensor.unbind(0)]
        out = torch.empty_like(chunks[0])
        dist.scatter(out, chunks, src=src)
    else:
        out = torch.empty_like(tensor)
        dist.scatter(out, None, src=src)
    return out


def cost(case, world_size):
    size = message_bytes(case)
    return Cost(link_bytes=(world_size - 1) * size, hbm_bytes=(1 + world_size) * size, pattern="scatter")


PROBLEM = Problem(
    name="scatter", version=3, upstream_id=5, category="collectives", source="NCCL scatter",
    world_sizes=(2, 4, 8), upstream=upstream_cases(src="omitted"),
    tests=rooted_cases("src"), benchmarks=BENCHMARK_CASES, tolerance=Tolerance.exact(),
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
