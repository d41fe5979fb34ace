"""All-gather of K-sharded activations (list all-gather + concatenation), then a GEMM.

Per rank: A_local [M, K/W] (this rank's column block of A), B [K, N/W] (this rank's weight shard,
different per rank)  ->  [M, N/W] = [A_0 | A_1 | ... | A_{W-1}] @ B, fp32 accumulation, rounded once
to the input dtype. The same product as upstream 11 (allgather_gemm_at); here the shards are
gathered as a list and concatenated along dim 1, as the upstream reference does.

Cost per rank: the all-gather brings (W-1)/W of A (M*K*itemsize) in; the GEMM is 2*M*(N/W)*K flops;
HBM reads A and B and writes C: (M*K + K*N/W + M*N/W) * itemsize.

Cases: ``upstream`` is the upstream factory: A_local [1024, 512/W], B [512, 1024] bf16 (N/W = 1024
at every W).

Benchmarks: Llama-3 70B / 8B column-parallel projections (QKV, MLP up; K = hidden) at prefill
(8192 tokens) and decode (64 tokens), as in allgather_gemm_at.
"""


from pkb.problem import Problem
from pkb.problems.tensor_parallel._common import all_gather_list_cat
from pkb.problems.tensor_parallel._gemm import (
    K_GATHERED_UPSTREAM, K_SHARDED_TESTS, column_parallel_cases, k_gathered_cost, k_gathered_inputs,
    k_gathered_upstream_inputs)


def make_inputs(case, rank, world_size, gen):
    return k_gathered_inputs(case, world_size, gen)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): A_local [1024, 512/W], then B [512, 1024], both N(0, 1)."""
    return k_gathered_upstream_inputs(case, world_size, device)


def reference(A_local, B):
    a = all_gather_list_cat(A_local, dim=1)  # [M, K]
    return a @ B  # in the input dtype: the GEMM library accumulates in fp32


def cost(case, world_size):
    return k_gathered_cost(case, world_size)


PROBLEM = Problem(
    name="allgather_gemm", version=2, upstream_id=12, category="tensor_parallel",
    source="PyTorch async-TP style all-gather + GEMM (K-sharded activations)",
    world_sizes=(2, 4, 8), upstream=K_GATHERED_UPSTREAM, tests=K_SHARDED_TESTS, benchmarks=column_parallel_cases(),
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
