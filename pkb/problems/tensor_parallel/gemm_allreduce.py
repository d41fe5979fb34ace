"""Row-parallel linear: local GEMM on K shards, then an all-reduce (Megatron-LM RowParallelLinear).

Per rank: A_local [M, K/W] (this rank's slice of the input features, as a column-parallel layer
leaves them), B_local [K/W, N] (this rank's rows of the weight)  ->  [M, N] on every rank,
= sum over ranks r of A_r @ B_r. As in Megatron, each partial product is a GEMM in the input dtype
(fp32 accumulation inside the GEMM library) and the partials are all-reduced in that dtype; the
tolerance allows any reduction order and an fp32 reduction.

Cost per rank: the all-reduce moves 2(W-1)/W of the [M, N] output (in the input dtype, as NCCL
would); the GEMM is 2*M*N*K/W flops; HBM reads A_local and B_local and writes C:
(M*K/W + K/W*N + M*N) * itemsize.

Tolerance: a sum over W ranks of partials of magnitude at most N(0, 1):
``reduction_tolerance(dtype, W)``; a result missing any rank's partial is off by O(1/sqrt(W)).

Cases: ``upstream`` is the upstream factory: A_local [1024, 512], B_local [512, 1024] bf16 on every
rank (K/W = 512 at every W).

Benchmarks: Llama-3 70B o_proj (K = N = 8192) and down_proj (K = 28672) at prefill (8192 tokens),
Llama-3 8B down_proj (K = 14336, N = 4096) at decode (64 tokens).
"""

import torch.distributed as dist

from pkb.problem import Case, Cost, Problem
from pkb.problems.tensor_parallel._common import global_size, itemsize, local_size, upstream_randn
from pkb.problems.tensor_parallel._gemm import (
    UPSTREAM_K, UPSTREAM_M, UPSTREAM_N, k_sharded_inputs, partial_sum_tolerance, row_parallel_cases)


def make_inputs(case, rank, world_size, gen):
    return k_sharded_inputs(case, world_size, gen)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): A_local [1024, 512], then B_local [512, 1024], both N(0, 1)."""
    m, k_local, n = case["m"], local_size(case, "k", world_size), case["n"]
    return upstream_randn(case, device, (m, k_local), (k_local, n))


def reference(A_local, B_local):
    partial = A_local @ B_local  # fp32 accumulation inside the GEMM library, rounded once
    dist.all_reduce(partial, op=dist.ReduceOp.SUM)  # in the input dtype, as Megatron does
    return partial


def cost(case, world_size):
    m, k, n = case["m"], global_size(case, "k", world_size) / world_size, case["n"]
    size = itemsize(case)
    return Cost(link_bytes=2 * (world_size - 1) / world_size * m * n * size, flops=2 * m * n * k,
                hbm_bytes=(m * k + k * n + m * n) * size, pattern="gemm + all_reduce")


PROBLEM = Problem(
    name="gemm_allreduce", version=3, upstream_id=13, category="tensor_parallel",
    source="Megatron-LM RowParallelLinear (input_is_parallel=True, no sequence parallelism)",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"m": UPSTREAM_M, "k_per_rank": UPSTREAM_K, "n": UPSTREAM_N},
                   note="the upstream factory: A_local [1024, 512], B_local [512, 1024] per rank")],
    tests=[
        Case("odd", {"m": 37, "k": 24, "n": 29}, tags=("odd_sizes",)),
        Case("one_row", {"m": 1, "k": 8, "n": 131}, note="a single decode token; one K column per rank at W=8",
             tags=("tiny", "odd_sizes")),
        Case("taller", {"m": 129, "k": 40, "n": 17}, tags=("odd_sizes",)),
    ],
    benchmarks=row_parallel_cases(), tolerance=partial_sum_tolerance,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
