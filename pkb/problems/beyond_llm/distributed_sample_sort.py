"""Distributed sample sort with exact rebalancing (the classic HPC parallel sort, as in HykSort /
sample-sort codes): sort every rank's keys globally and leave rank r holding the r-th contiguous
range of the sorted sequence, of an exact size.

Per rank: local_shard [n_r] (the run's precision, bf16 by default; n_r differs per rank and may be 0; many
duplicate keys; ranks' key ranges overlap but are shifted, so no rank's keys are globally in place),
group=None (the default group)
  ->  [c_r]: the sorted keys of all ranks, positions [s_r, s_r + c_r) of the global sorted order, where
      the total T = sum n_r is split like ``torch.tensor_split``: c_r = T // W + (1 if r < T % W else 0).
      Keys are compared by value (bit-exact output; equal keys are indistinguishable, so no tie rule is
      needed). Keys are finite.

The reference is the textbook algorithm: local sort, W-1 regular samples per rank, all-gather of the
samples, W-1 splitters, bucket exchange (all-to-all), local merge, then a second all-to-all that moves
keys to their exact final range.

Cost: every key may have to leave its rank once: an all-to-all of the n keys per rank, (W-1)/W of them
off-rank: link = (W-1)/W * n*b (the rebalancing exchange moves few keys when the buckets are even,
and the samples are negligible). flops: none counted (comparisons). HBM: a radix sort reads and writes
the keys a few times; counted as 4*n*b (read, write, exchange in, exchange out).

Benchmarks: a sort of 2^26 keys per rank (256 MiB in fp32, the per-GPU share of a 2 GiB sort in the
style of the sort benchmarks) and 2^24 integer keys (many duplicates, at GPU scale). The ``upstream``
case is the upstream factory's at trial 0: n = max(4W, min(1024 // W, 4096)) keys per rank, integers in
[-50, 50) shifted down by rank * n (rounded to the precision: in bf16 duplicates, and ranges that barely
overlap); the factory's every-4th-trial layout with empty odd ranks is the ``odd_ranks_empty`` test.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.beyond_llm._common import (all_gather_rows, all_gather_sizes, all_to_all_rows, dtype_of,
                                             exchange_counts, skewed_counts)


def keys_per_rank(case, world_size):
    """The mean keys per rank; the upstream factory's max(4W, min(m // W, 4096)) where the case gives m."""
    if "m" in case.params:
        return max(4 * world_size, min(case["m"] // world_size, 4096))
    return case["keys_per_rank"]


def make_inputs(case, rank, world_size, gen):
    if "m" in case.params:  # the upstream factory's keys: integers in [-50, 50), shifted down by rank * n
        num_keys = 0 if case.get("odd_ranks_empty", False) and rank % 2 else keys_per_rank(case, world_size)
        values = torch.randint(-50, 50, (num_keys,), generator=gen, device=gen.device).float() - rank * num_keys
        return values.to(dtype_of(case)), None
    sizes = skewed_counts(gen.shared, world_size, case["keys_per_rank"] * world_size, case.get("num_empty", 0))
    values = randn(gen, sizes[rank], scale=case["spread"]) + case["shift"] * rank
    if case.get("integer_keys", False):
        values = torch.round(values)
    return (values + 0.0).to(dtype_of(case)), None  # + 0.0 turns -0.0 into 0.0


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's (after its seed): n integers in [-50, 50), cast to the run's dtype, minus rank * n; when
    trial % 4 == 3 the odd ranks bring no keys."""
    num_keys = 0 if trial % 4 == 3 and rank % 2 == 1 else keys_per_rank(case, world_size)
    values = torch.randint(-50, 50, (num_keys,), dtype=torch.int64, device=device)
    return values.to(dtype_of(case)) - rank * max(1, num_keys), None


def reference(local_shard, group=None):
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = local_shard.device
    local = torch.sort(local_shard).values
    # Splitters from regular samples of every rank.
    picks = (torch.arange(1, world_size, device=device) * local.numel()) // world_size
    samples, _ = all_gather_rows(local[picks] if local.numel() else local[:0], group)
    samples = torch.sort(samples).values
    splitters = samples[(torch.arange(1, world_size, device=device) * samples.numel()) // world_size] \
        if samples.numel() else samples
    bucket = torch.searchsorted(splitters, local, right=True)
    send_counts = torch.bincount(bucket, minlength=world_size).tolist()
    recv_counts = exchange_counts(send_counts, device, group)
    merged = torch.sort(all_to_all_rows(local, send_counts, recv_counts, group)).values
    # Exact rebalancing: key at global position g goes to the rank whose range holds g.
    bucket_sizes = all_gather_sizes(merged.numel(), device, group)
    total = sum(bucket_sizes)
    final_counts = [total // world_size + (1 if r < total % world_size else 0) for r in range(world_size)]
    final_starts = torch.tensor([0] + final_counts, device=device).cumsum(0)[:-1]
    positions = sum(bucket_sizes[:rank]) + torch.arange(merged.numel(), device=device)
    owner = torch.searchsorted(final_starts, positions, right=True) - 1
    send_counts = torch.bincount(owner, minlength=world_size).tolist()
    recv_counts = exchange_counts(send_counts, device, group)
    return all_to_all_rows(merged, send_counts, recv_counts, group)


def cost(case, world_size):
    moved = keys_per_rank(case, world_size) * dtype_of(case).itemsize
    return Cost(link_bytes=(world_size - 1) / world_size * moved, hbm_bytes=4 * moved, pattern="all_to_all")


PROBLEM = Problem(
    name="distributed_sample_sort", version=3, upstream_id=85, category="beyond_llm",
    source="parallel sample sort (regular sampling, splitter exchange, all-to-all, exact rebalancing)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"m": 1024}, note="1024 // W integer keys per rank"),
    ],
    tests=[
        Case("integer_duplicates", {"keys_per_rank": 37, "spread": 20.0, "shift": -7.0, "integer_keys": True},
             tags=("uneven_sizes", "odd_sizes")),
        Case("skewed_one_empty", {"keys_per_rank": 25, "spread": 1.0, "shift": 0.5, "num_empty": 1},
             tags=("empty_rank", "uneven_sizes", "skewed")),
        Case("int_keys_two_empty", {"keys_per_rank": 16, "spread": 3.0, "shift": 2.0, "integer_keys": True,
                                    "num_empty": 2},
             note="two ranks bring no keys; integer keys repeat a lot", tags=("empty_rank", "uneven_sizes")),
        Case("odd_ranks_empty", {"m": 256, "odd_ranks_empty": True},
             note="the upstream factory's every-4th-trial layout, smaller: odd ranks bring no keys",
             tags=("empty_rank", "uneven_sizes")),
    ],
    benchmarks=[
        Case("keys_64Mi", {"keys_per_rank": 1 << 26, "spread": 1.0, "shift": 0.25}),
        Case("integer_keys_16Mi", {"keys_per_rank": 1 << 24, "spread": 50.0, "shift": -3.0, "integer_keys": True}),
    ],
    tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs,
    cost=cost,
)
