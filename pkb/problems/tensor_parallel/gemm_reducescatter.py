"""Row-parallel linear with sequence parallelism: local GEMM, then a reduce-scatter over tokens.

Megatron-LM's RowParallelLinear with ``sequence_parallel=True`` ends in a reduce-scatter instead
of an all-reduce: rank r keeps the summed rows r*M/W ... (r+1)*M/W - 1.

Per rank: A_local [M, K/W], B_local [K/W, N] (this rank's shards)  ->  [M/W, N], rows block r of
sum over ranks s of A_s @ B_s. Each partial is a GEMM in the input dtype (fp32 accumulation inside
the GEMM library) and the partials are reduce-scattered in that dtype, as Megatron and upstream do.
M must be a multiple of W.

Cost per rank: the reduce-scatter moves (W-1)/W of the [M, N] partial (input dtype, as NCCL would);
the GEMM is 2*M*N*K/W flops; HBM reads A_local and B_local, writes the [M/W, N] block:
(M*K/W + K/W*N + M*N/W) * itemsize.

Tolerance: as gemm_allreduce, a sum over W ranks of partials of magnitude at most N(0, 1).

Cases: ``upstream`` is the upstream factory: A_local [1024, 512/W], B_local [512/W, 1024] bf16.
Benchmarks: Llama-3 70B o_proj / down_proj at prefill (8192 tokens), Llama-3 8B down_proj at
decode (64 tokens), as gemm_allreduce.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem
from pkb.problems.tensor_parallel._common import itemsize, upstream_randn
from pkb.problems.tensor_parallel._gemm import (
    UPSTREAM_K, UPSTREAM_M, UPSTREAM_N, k_sharded_inputs, partial_sum_tolerance, row_parallel_cases)


def make_inputs(case, rank, world_size, gen):
    return k_sharded_inputs(case, world_size, gen)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): A_local [1024, 512/W], then B_local [512/W, 1024], both N(0, 1)."""
    m, k_local, n = case["m"], case["k"] // world_size, case["n"]
    return upstream_randn(case, device, (m, k_local), (k_local, n))


def reference(A_local, B_local):
    world_size = dist.get_world_size()
    partial = A_local @ B_local  # [M, N], fp32 accumulation inside the GEMM library
    out = torch.empty(partial.shape[0] // world_size, partial.shape[1], dtype=partial.dtype, device=partial.device)
    dist.reduce_scatter_tensor(out, partial, op=dist.ReduceOp.SUM)  # in the input dtype, as Megatron does
    return out


def cost(case, world_size):
    m, k, n = case["m"], case["k"] / world_size, case["n"]
    size = itemsize(case)
    return Cost(link_bytes=(world_size - 1) / world_size * m * n * size, flops=2 * m * n * k,
                hbm_bytes=(m * k + k * n + m * n / world_size) * size, pattern="gemm + reduce_scatter")


PROBLEM = Problem(
    name="gemm_reducescatter", version=3, upstream_id=16, category="tensor_parallel",
    source="Megatron-LM RowParallelLinear (sequence_parallel=True)",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"m": UPSTREAM_M, "k": UPSTREAM_K, "n": UPSTREAM_N},
                   note="the upstream factory: A_local [1024, 512/W], B_local [512/W, 1024] per rank")],
    tests=[
        Case("odd", {"m": 24, "k": 40, "n": 29}, note="3 rows per rank at W=8", tags=("odd_sizes",)),
        Case("one_row_per_rank", {"m": 8, "k": 8, "n": 131}, tags=("tiny", "odd_sizes")),
        Case("taller", {"m": 40, "k": 24, "n": 17}, tags=("odd_sizes",)),
    ],
    benchmarks=row_parallel_cases(), tolerance=partial_sum_tolerance,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
