"""Ulysses all-gather primitive (VeOmni / verl ``all_gather_tensor``): gather equal shards on dim 0.

Per rank: x [N, *rest]  ->  [W*N, *rest], rows [r*N, (r+1)*N) = rank r's x (bit-exact).

Cost (nccl-tests all-gather): with S the local bytes, each rank receives the (W-1) shards it does
not hold: link bytes (W-1) * S; HBM: read S, write W*S.

Benchmarks: gathering sequence-parallel activations [S/W, hidden] before an attention projection:
Llama-3-8B (hidden 4096) at 128k tokens and Llama-3-70B (hidden 8192) at 64k tokens; ``rows`` is the
global row count, split evenly over the ranks. The upstream case is upstream's x [1024, 1024] bf16 per rank.
"""

import math

from pkb.problem import Case, Cost, Problem, Tolerance
from pkb.problems.context_parallel._common import all_gather, dtype_of, rand_normal, upstream_randn


def local_shape(case, world_size):
    rows = case["rows"] // world_size if case.get("rows_are_global", False) else case["rows"]
    return [rows, *case["rest"]]


def make_inputs(case, rank, world_size, gen):
    return rand_normal(gen, *local_shape(case, world_size), dtype=dtype_of(case)), None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: x [1024, 1024] N(0, 1) in the run's dtype."""
    return upstream_randn(case, *local_shape(case, world_size), device=device), None


def reference(x, group=None):
    return all_gather(x, 0, group)


def cost(case, world_size):
    size = math.prod(local_shape(case, world_size)) * dtype_of(case).itemsize
    return Cost(link_bytes=(world_size - 1) * size, hbm_bytes=(1 + world_size) * size, pattern="all_gather")


UPSTREAM = (
    Case("upstream", {"rows": 1024, "rest": (1024,)},
         note="upstream create_input_tensor at M = N = 1024: x [1024, 1024] per rank"),
)

TESTS = (
    Case("odd_rows", {"rows": 5, "rest": (33,)}, tags=("odd_sizes",)),
    Case("one_row_3d", {"rows": 1, "rest": (3, 7)}, tags=("layout", "tiny", "odd_sizes")),
    Case("vector", {"rows": 13, "rest": ()}, tags=("layout", "odd_sizes")),
)

BENCHMARKS = (
    Case("llama3_8b_hidden_128k", {"rows": 131072, "rows_are_global": True, "rest": (4096,)},
         note="Llama-3-8B hidden states, 128k tokens split over the ranks"),
    Case("llama3_70b_hidden_64k", {"rows": 65536, "rows_are_global": True, "rest": (8192,)},
         note="Llama-3-70B hidden states, 64k tokens split over the ranks"),
)

PROBLEM = Problem(
    name="ulysses_all_gather_into_tensor_primitive", version=3, upstream_id=34, category="context_parallel",
    source="VeOmni / verl Ulysses all_gather_tensor", world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS,
    benchmarks=BENCHMARKS,
    tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs,
    cost=cost,
)
