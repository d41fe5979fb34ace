"""Token all-to-all with explicit, uneven split sizes (VeOmni MoE ``all_to_all``).

Per rank r: local_tensor [sum(input_split_sizes), H] (the run's precision, bf16 by default);
input_split_sizes[d] rows go to rank d (in order); output_split_sizes[s] rows arrive from rank s;
group None  ->  [sum(output_split_sizes), H], the rows from rank 0 first, then rank 1, ... (bit-exact).
With both split lists None (a value upstream never passes; a test and the benchmarks do) every rank
sends rows/W rows to every rank. The split lists of all ranks agree: output_split_sizes[s] on rank r
== input_split_sizes[r] on rank s.

Inputs: the W x W split matrix is drawn from ``gen.shared`` (rank r sends row r and receives column r);
tests include an empty split, a rank that sends nothing and a rank that receives everything. The
upstream case: 1024 x 1024 bf16 rows per rank with explicit equal split lists [1024/W] * W.

Cost (nccl-tests all-to-all): each rank must send the rows it does not keep and receive the rows it
did not have. Equal splits: (W-1)/W * rows * H * bytes per rank. Zipf splits: the busiest rank's
remote rows (sent or received, whichever is larger) times H * bytes, since it finishes last.
HBM: read the input, write the output (2 * rows * H * bytes).

Benchmarks: a DeepSeek-V3 dispatch at EP 8 (4096 tokens x top-8 = 32768 rows of hidden 7168 bf16
per rank), Mixtral 8x7B at EP 8 (4096 x 2 rows of 4096) and Qwen3-235B-A22B at EP 4 (4096 x 8 rows
of 4096), with uniform splits (the upstream's case) and, for DeepSeek-V3, Zipf-skewed splits.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, Tolerance, randn
from pkb.problems.expert_parallel._common import dtype_of, upstream_split_sizes


def split_matrix(case, world_size, gen_shared) -> list[list[int]] | None:
    """[W][W] rows rank s sends to rank d, or None for the equal split (``splits="equal"``)."""
    rows, kind = case["rows"], case["splits"]
    if kind == "equal":
        return None
    if kind == "equal_lists":  # the upstream's explicit lists: rows/W to every rank
        return [[rows // world_size] * world_size for _ in range(world_size)]
    if kind == "random":  # random sizes, about 30% of them zero
        sizes = torch.randint(0, 2 * rows // world_size + 2, (world_size, world_size), generator=gen_shared,
                              device=gen_shared.device)
        sizes[torch.rand(world_size, world_size, generator=gen_shared, device=gen_shared.device) < 0.3] = 0
        return sizes.tolist()
    if kind == "skewed":  # rank 1 sends nothing; everyone else sends everything to the last rank but a row or two
        matrix = [[0] * world_size for _ in range(world_size)]
        for src in range(world_size):
            if src == 1:
                continue
            matrix[src][world_size - 1] = rows
            matrix[src][src % (world_size - 1)] += src % 3  # a few rows stay on the other ranks
        return matrix
    if kind == "zipf":  # rank d receives in proportion to 1/(d+1) from everybody
        weights = [1.0 / (d + 1) for d in range(world_size)]
        sizes = [int(rows * w / sum(weights)) for w in weights]
        sizes[0] += rows - sum(sizes)
        return [sizes[:] for _ in range(world_size)]
    raise ValueError(f"unknown splits kind {kind!r}")


def make_inputs(case, rank, world_size, gen):
    matrix = split_matrix(case, world_size, gen.shared)
    if matrix is None:
        rows = case["rows"] // world_size * world_size
        return randn(gen, rows, case["hidden"], dtype=dtype_of(case)), None, None, None
    input_splits = matrix[rank]
    output_splits = [matrix[src][rank] for src in range(world_size)]
    local_tensor = randn(gen, sum(input_splits), case["hidden"], dtype=dtype_of(case))
    return local_tensor, input_splits, output_splits, None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: local_tensor [rows, H] ~ N(0, 1), and the same equal split list out and in."""
    local_tensor = torch.randn(case["rows"], case["hidden"], dtype=dtype_of(case), device=device)
    splits = upstream_split_sizes(case["rows"], world_size)
    return local_tensor, splits, list(splits), None


def reference(local_tensor, input_split_sizes=None, output_split_sizes=None, group=None):
    if output_split_sizes is None:
        output = torch.empty_like(local_tensor)
    else:
        output = local_tensor.new_empty((sum(output_split_sizes), *local_tensor.shape[1:]))
    dist.all_to_all_single(output, local_tensor.contiguous(), output_split_sizes=output_split_sizes,
                           input_split_sizes=input_split_sizes, group=group)
    return output


def cost(case, world_size):
    row_bytes = case["hidden"] * dtype_of(case).itemsize
    matrix = None if case["splits"] in ("equal", "equal_lists", "random") else split_matrix(case, world_size, None)
    if matrix is None:  # equal splits (random test splits are costed as their equal-split estimate)
        return Cost(link_bytes=(world_size - 1) / world_size * case["rows"] * row_bytes,
                    hbm_bytes=2 * case["rows"] * row_bytes, pattern="all_to_all")
    # Uneven: the busiest rank sets the time; it must send its remote rows and receive the others'.
    sent = [sum(matrix[r]) - matrix[r][r] for r in range(world_size)]
    received = [sum(matrix[s][r] for s in range(world_size)) - matrix[r][r] for r in range(world_size)]
    busiest = max(max(sent), max(received))
    return Cost(link_bytes=busiest * row_bytes, hbm_bytes=2 * case["rows"] * row_bytes, pattern="all_to_all (uneven)")


UPSTREAM = (
    Case("upstream", {"rows": 1024, "hidden": 1024, "splits": "equal_lists"},
         note="the upstream factory's defaults: [1024, 1024] bf16, split lists [1024/W] * W"),
)

TESTS = (
    Case("random_splits_with_zeros", {"rows": 11, "hidden": 33, "splits": "random"},
         tags=("uneven_sizes", "odd_sizes")),
    Case("skewed_one_sends_nothing_last_gets_all", {"rows": 9, "hidden": 17, "splits": "skewed"},
         tags=("uneven_sizes", "empty_rank", "skewed", "odd_sizes")),
    Case("equal_splits_none", {"rows": 24, "hidden": 5, "splits": "equal"},
         note="split lists None: rows/W to every rank", tags=("argument_value", "odd_sizes")),
)

BENCHMARKS = (
    Case("deepseek_v3_dispatch_ep8", {"rows": 32768, "hidden": 7168, "splits": "equal"}, world_sizes=(8,)),
    Case("deepseek_v3_dispatch_ep8_zipf", {"rows": 32768, "hidden": 7168, "splits": "zipf"}, world_sizes=(8,)),
    Case("mixtral_8x7b_dispatch_ep8", {"rows": 8192, "hidden": 4096, "splits": "equal"}, world_sizes=(8,)),
    Case("qwen3_235b_a22b_dispatch_ep4", {"rows": 32768, "hidden": 4096, "splits": "equal"}, world_sizes=(4,)),
)

PROBLEM = Problem(
    name="moe_all2all_primitive", version=3, upstream_id=27, category="expert_parallel",
    source="VeOmni MoE all_to_all (all_to_all_single with split sizes)", world_sizes=(2, 4, 8),
    upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS, tolerance=Tolerance.exact(),
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
