"""Ulysses head-gather / sequence-scatter (VeOmni / verl ``gather_heads_scatter_seq``).

After attention, every rank holds the whole sequence for H/W heads and goes back to a sequence
shard with all heads. If the sequence length S is not a multiple of W it is zero-padded at the end
to W*ceil(S/W) first. The padded sequence is split into W chunks on ``seq_dim``, chunk d goes to
rank d, and the W received head groups are concatenated on ``head_dim`` in rank order.

Per rank: x [B, S, H/W, D] (seq_dim=1, head_dim=2)  ->  [B, ceil(S/W), H, D] (bit-exact; padding
positions are exact zeros).

Cost (all-to-all of the padded tensor): with X the padded local bytes, link bytes (W-1)/W * X;
HBM: read the unpadded input, write X.

The upstream case fixes the local head count instead (``local_heads``): upstream's x [16, 16, 8, 64]
bf16 per rank (B, S, H/W, D), seq_dim 1, head_dim 2  ->  [16, 16/W, 8*W, 64].

Benchmarks: the attention-output re-shard of Ulysses attention for Llama-3-8B (32 heads x 128) at
128k tokens and Llama-3-70B (64 heads x 128) at 64k tokens, B=1.
"""

import math

import torch.nn.functional as F

from pkb.problem import Case, Cost, Problem, Tolerance
from pkb.problems.context_parallel._common import (ULYSSES_RESHARD_BENCHMARKS, all_to_all, ceil_div, dtype_of,
                                                   group_size, rand_normal, upstream_randn)


def local_shape(case, world_size):
    local_heads = case["local_heads"] if "local_heads" in case.params else case["heads"] // world_size
    return [case["batch"], case["seq"], local_heads, case["head_dim"]]


def make_inputs(case, rank, world_size, gen):
    return rand_normal(gen, *local_shape(case, world_size), dtype=dtype_of(case)), 1, 2, None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: x [16, 16, 8, 64] N(0, 1) in the run's dtype; seq dim 1, head dim 2."""
    return upstream_randn(case, *local_shape(case, world_size), device=device), 1, 2, None


def reference(x, seq_dim, head_dim, group=None):
    world = group_size(group)
    seq_dim = seq_dim % x.dim()
    padding = -x.shape[seq_dim] % world
    if padding:
        pad = [0, 0] * (x.dim() - 1 - seq_dim) + [0, padding]
        x = F.pad(x, pad)
    return all_to_all(x, seq_dim, head_dim, group)


def cost(case, world_size):
    shape = local_shape(case, world_size)
    itemsize = dtype_of(case).itemsize
    padded = math.prod(shape) // case["seq"] * ceil_div(case["seq"], world_size) * world_size * itemsize
    return Cost(link_bytes=(world_size - 1) / world_size * padded,
                hbm_bytes=math.prod(shape) * itemsize + padded, pattern="all_to_all")


UPSTREAM = (
    Case("upstream", {"batch": 16, "seq": 16, "local_heads": 8, "head_dim": 64},
         note="upstream create_input_tensor at M = N = 1024: x [16, 16, 8, 64] per rank"),
)

TESTS = (
    Case("padded_seq", {"batch": 2, "seq": 29, "heads": 8, "head_dim": 5}, tags=("odd_sizes",)),
    Case("exact_seq", {"batch": 1, "seq": 24, "heads": 16, "head_dim": 3}, tags=("shape_regime", "odd_sizes")),
    Case("shorter_than_world", {"batch": 3, "seq": 3, "heads": 8, "head_dim": 16},
         tags=("shape_regime", "odd_sizes")),
)

PROBLEM = Problem(
    name="ulysses_gather_heads_scatter_seq", version=3, upstream_id=37, category="context_parallel",
    source="VeOmni / verl Ulysses gather_heads_scatter_seq", world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS,
    benchmarks=ULYSSES_RESHARD_BENCHMARKS, tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs,
    upstream_inputs=upstream_inputs, cost=cost,
)
