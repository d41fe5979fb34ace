"""Ulysses sequence-gather / head-scatter (VeOmni / verl ``gather_seq_scatter_heads``).

Before attention, every rank holds a sequence shard with all heads and needs the whole sequence
for H/W heads. The global sequence of ``seq`` tokens is padded to a multiple of W and split evenly,
so each rank holds S_local = ceil(seq / W) positions (the last rank's tail is padding). The call
splits x into W chunks on ``head_dim``, sends chunk d to rank d, concatenates what arrives on
``seq_dim`` in rank order, and, when ``unpadded_dim_size`` is given and not a multiple of W, cuts the
sequence back to ``unpadded_dim_size`` (dropping the padding at the end).

Per rank: x [B, S_local, H, D] (seq_dim=1, head_dim=2)  ->  [B, S, H/W, D] with S = W*S_local, or
``unpadded_dim_size`` when that is non-zero and not a multiple of W (bit-exact). H must divide by W.

Cost (all-to-all): with X the local bytes, link bytes (W-1)/W * X; HBM: read X, write X.

The upstream case fixes S_local instead (``local_seq``): upstream's x [16, 16, 8, 64] bf16 per rank
(B, S_local, H, D), seq_dim 1, head_dim 2, unpadded_dim_size 0.

Benchmarks: the query/key re-shard of Ulysses attention for Llama-3-8B (32 query heads x 128) at
128k tokens and Llama-3-70B (64 heads x 128) at 64k tokens, B=1.
"""

from pkb.problem import Case, Problem, Tolerance
from pkb.problems.context_parallel._common import (ULYSSES_RESHARD_BENCHMARKS, all_to_all, all_to_all_cost, ceil_div,
                                                   cut_padding, dtype_of, rand_normal, upstream_randn)


def local_shape(case, world_size):
    s_local = case["local_seq"] if "local_seq" in case.params else ceil_div(case["seq"], world_size)
    return [case["batch"], s_local, case["heads"], case["head_dim"]]


def make_inputs(case, rank, world_size, gen):
    x = rand_normal(gen, *local_shape(case, world_size), dtype=dtype_of(case))
    unpadded = case["seq"] if case.get("pass_unpadded", True) else 0
    return x, 1, 2, None, unpadded


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: x [16, 16, 8, 64] N(0, 1) in the run's dtype; seq dim 1, head dim 2, unpadded size 0."""
    return upstream_randn(case, *local_shape(case, world_size), device=device), 1, 2, None, 0


def reference(x, seq_dim, head_dim, group=None, unpadded_dim_size=0):
    return cut_padding(all_to_all(x, head_dim, seq_dim, group), seq_dim, x.shape[seq_dim], unpadded_dim_size)


def cost(case, world_size):
    return all_to_all_cost(local_shape(case, world_size), dtype_of(case), world_size)


UPSTREAM = (
    Case("upstream", {"batch": 16, "local_seq": 16, "heads": 8, "head_dim": 64, "pass_unpadded": False},
         note="upstream create_input_tensor at M = N = 1024: x [16, 16, 8, 64]"),
)

TESTS = (
    Case("padded_seq", {"batch": 2, "seq": 29, "heads": 8, "head_dim": 5}, tags=("argument_value", "odd_sizes")),
    Case("exact_seq_no_unpad", {"batch": 1, "seq": 24, "heads": 16, "head_dim": 3, "pass_unpadded": False},
         tags=("shape_regime", "odd_sizes")),
    Case("one_token_per_rank", {"batch": 3, "seq": 7, "heads": 8, "head_dim": 16},
         tags=("argument_value", "shape_regime", "odd_sizes")),
)

PROBLEM = Problem(
    name="ulysses_gather_seq_scatter_heads", version=3, upstream_id=36, category="context_parallel",
    source="VeOmni / verl Ulysses gather_seq_scatter_heads", world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS,
    benchmarks=ULYSSES_RESHARD_BENCHMARKS, tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs,
    upstream_inputs=upstream_inputs, cost=cost,
)
