"""Ulysses all-to-all primitive (VeOmni / verl ``all_to_all_tensor``): scatter one dim, gather another.

A case names a global tensor ``shape`` and the two dims. Each rank holds the slice of the global
tensor that is split W ways on ``gather_dim`` (its shard of that dim), or a fixed ``local_shape``
whatever W (the upstream case: x [1024, 1024] bf16, scatter 0, gather 1). The call splits the local
tensor into W equal chunks on ``scatter_dim`` (``torch.tensor_split``), sends chunk d to rank d, and
concatenates the W received chunks on ``gather_dim`` in rank order. Both dims must divide by W.

Per rank: x [shape with shape[gather_dim] / W]  ->  [shape with shape[scatter_dim] / W]
(bit-exact; with scatter_dim == gather_dim the size is unchanged and the chunks are reshuffled).
Example (W=2, scatter 0, gather 1): rank r gets rows [r*N/2, (r+1)*N/2) of rank 0's x, then of rank 1's.

Cost (nccl-tests all-to-all): with S the local bytes, each rank sends and receives the (W-1)/W of S
that is not its own chunk: link bytes (W-1)/W * S; HBM: read S, write S.

Benchmarks: the q/k/v re-shard of Ulysses attention, [B=1, S, H, D=128] split by heads (dim 2) and
gathered on sequence (dim 1): Llama-3-8B (32 query heads) at 128k tokens, Llama-3-70B (64 query
heads) at 64k tokens, sequences as in Llama 3's long-context stage (config.json num_attention_heads).
"""

from pkb.problem import Case, Problem, Tolerance
from pkb.problems.context_parallel._common import all_to_all, all_to_all_cost, dtype_of, rand_normal, upstream_randn


def local_shape(case, world_size):
    if "local_shape" in case.params:
        return list(case["local_shape"])
    shape = list(case["shape"])
    shape[case["gather_dim"]] //= world_size
    return shape


def make_inputs(case, rank, world_size, gen):
    x = rand_normal(gen, *local_shape(case, world_size), dtype=dtype_of(case))
    return x, case["scatter_dim"], case["gather_dim"], None


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: x [1024, 1024] N(0, 1) in the run's dtype; scatter dim 0, gather dim 1."""
    x = upstream_randn(case, *local_shape(case, world_size), device=device)
    return x, case["scatter_dim"], case["gather_dim"], None


def reference(x, scatter_dim, gather_dim, group=None):
    return all_to_all(x, scatter_dim, gather_dim, group)


def cost(case, world_size):
    return all_to_all_cost(local_shape(case, world_size), dtype_of(case), world_size)


UPSTREAM = (
    Case("upstream", {"local_shape": (1024, 1024), "scatter_dim": 0, "gather_dim": 1},
         note="upstream create_input_tensor at M = N = 1024: x [1024, 1024] per rank"),
)

TESTS = (
    Case("rows_to_cols", {"shape": (24, 40), "scatter_dim": 0, "gather_dim": 1}, tags=("odd_sizes",)),
    Case("heads_to_seq_4d", {"shape": (3, 40, 8, 5), "scatter_dim": 2, "gather_dim": 1},
         tags=("layout", "argument_value", "odd_sizes")),
    Case("same_dim", {"shape": (2, 64, 3), "scatter_dim": 1, "gather_dim": 1},
         tags=("argument_value", "layout", "odd_sizes")),
    Case("last_to_first", {"shape": (8, 7, 24), "scatter_dim": -1, "gather_dim": 0},
         tags=("argument_value", "layout", "odd_sizes")),
)

BENCHMARKS = (
    Case("llama3_8b_q_128k", {"shape": (1, 131072, 32, 128), "scatter_dim": 2, "gather_dim": 1},
         note="Llama-3-8B query, 32 heads x 128, 128k tokens"),
    Case("llama3_70b_q_64k", {"shape": (1, 65536, 64, 128), "scatter_dim": 2, "gather_dim": 1},
         note="Llama-3-70B query, 64 heads x 128, 64k tokens"),
)

PROBLEM = Problem(
    name="ulysses_all_to_all_tensor_primitive", version=3, upstream_id=33, category="context_parallel",
    source="VeOmni / verl Ulysses all_to_all_tensor", world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS,
    benchmarks=BENCHMARKS, tolerance=Tolerance.exact(), reference=reference, make_inputs=make_inputs,
    upstream_inputs=upstream_inputs, cost=cost,
)
