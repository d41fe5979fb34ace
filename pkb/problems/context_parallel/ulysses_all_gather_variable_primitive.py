"""Variable-size all-gather (VeOmni / verl Ulysses helpers): shards of different lengths on ``gather_dim``.

Each rank holds x whose size on ``gather_dim`` is its own (possibly 0); all other dims agree. The
sizes are exchanged first (an all-gather of one integer per rank), every shard is padded to the
largest, the padded shards are all-gathered, and the result is the concatenation on ``gather_dim``
of every rank's unpadded shard in rank order.

Per rank: x [..., n_r, ...]  ->  [..., sum_r n_r, ...] (bit-exact), the same on every rank.
Lengths: n_r is drawn per trial from ``gen.shared`` uniformly in [min_len, max_len]; test cases with
``empty_rank`` force one (random) rank to 0 and another to max_len, so empty shards are exercised
and the gathered tensor is never empty.

Cost: each rank must receive the shards it does not hold. With uniform lengths the expected row
count per rank is m = (min_len + max_len) / 2 and a row is R bytes: link bytes (W-1) * m * R
(the size exchange adds (W-1) * 8 bytes); HBM: read m*R, write W*m*R.

Benchmarks: gathering packed variable-length sequences of hidden states (Llama-3-8B hidden 4096,
Llama-3-70B hidden 8192) whose per-rank token counts vary by up to 2x around 16k. The upstream case is
upstream's x [1024, 1024] bf16 per rank (every length 1024), gathered on dim 0.
"""

import math

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance
from pkb.problems.context_parallel._common import dtype_of, group_size, rand_normal, upstream_randn


def lengths_for(case, world_size, gen):
    """Every rank's length (drawn from ``gen.shared``, so all ranks agree)."""
    lengths = torch.randint(case["min_len"], case["max_len"] + 1, (world_size,), generator=gen.shared,
                            device=gen.device).tolist()
    if case.get("empty_rank", False):
        order = torch.randperm(world_size, generator=gen.shared, device=gen.device).tolist()
        lengths[order[0]], lengths[order[1]] = 0, case["max_len"]
    return lengths


def make_inputs(case, rank, world_size, gen):
    dim = case["gather_dim"]
    shape = list(case["shape"])
    shape[dim] = lengths_for(case, world_size, gen)[rank]
    return rand_normal(gen, *shape, dtype=dtype_of(case)), dim, None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: x [1024, 1024] N(0, 1) in the run's dtype on every rank (every length 1024), dim 0."""
    dim = case["gather_dim"]
    shape = list(case["shape"])
    shape[dim] = case["max_len"]  # min_len == max_len: upstream's shards are all one length
    return upstream_randn(case, *shape, device=device), dim, None


def reference(x, gather_dim, group=None):
    world = group_size(group)
    dim = gather_dim % x.dim()
    size = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
    sizes = torch.empty(world, dtype=torch.int64, device=x.device)
    dist.all_gather_into_tensor(sizes, size, group=group)
    sizes = sizes.tolist()
    longest = max(sizes)
    moved = x.movedim(dim, 0)  # [n, *rest]
    if longest == 0:  # every shard is empty: nothing to gather
        return x.clone()
    padded = torch.zeros(longest, *moved.shape[1:], dtype=x.dtype, device=x.device)
    padded[: moved.shape[0]] = moved
    flat = torch.empty(world * padded.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(flat, padded.view(-1), group=group)
    gathered = flat.view(world, *padded.shape)
    parts = [gathered[r, : sizes[r]] for r in range(world)]
    return torch.cat(parts, dim=0).movedim(0, dim).contiguous()


def cost(case, world_size):
    row_bytes = math.prod(s for i, s in enumerate(case["shape"]) if i != case["gather_dim"] % len(case["shape"]))
    row_bytes *= dtype_of(case).itemsize
    mean_rows = (case["min_len"] + case["max_len"]) / 2
    shard = mean_rows * row_bytes
    return Cost(link_bytes=(world_size - 1) * (shard + 8), hbm_bytes=(1 + world_size) * shard,
                pattern="all_gather (variable)")


UPSTREAM = (
    Case("upstream", {"shape": (0, 1024), "gather_dim": 0, "min_len": 1024, "max_len": 1024},
         note="upstream create_input_tensor at M = N = 1024: x [1024, 1024] per rank, gather_dim 0"),
)

TESTS = (
    Case("last_dim", {"shape": (4, 0), "gather_dim": -1, "min_len": 2, "max_len": 11},
         tags=("argument_value", "uneven_sizes", "odd_sizes")),
    Case("rows_with_empty", {"shape": (0, 37), "gather_dim": 0, "min_len": 0, "max_len": 9, "empty_rank": True},
         tags=("uneven_sizes", "empty_rank", "odd_sizes")),
    Case("middle_dim", {"shape": (3, 0, 5), "gather_dim": 1, "min_len": 1, "max_len": 6, "empty_rank": True},
         tags=("argument_value", "layout", "uneven_sizes", "empty_rank", "odd_sizes")),
)

BENCHMARKS = (
    Case("llama3_8b_packed_16k", {"shape": (0, 4096), "gather_dim": 0, "min_len": 10923, "max_len": 21845},
         note="packed sequences, 8k-22k tokens per rank"),
    Case("llama3_70b_packed_16k", {"shape": (0, 8192), "gather_dim": 0, "min_len": 10923, "max_len": 21845},
         note="packed sequences, 8k-22k tokens per rank"),
)

PROBLEM = Problem(
    name="ulysses_all_gather_variable_primitive", version=3, upstream_id=35, category="context_parallel",
    source="VeOmni / verl Ulysses all-gather of uneven shards (sizes first, then padded data)",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS, tolerance=Tolerance.exact(),
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
