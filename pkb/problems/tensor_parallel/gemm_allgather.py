"""Column-parallel linear with gathered output (Megatron-LM ColumnParallelLinear, gather_output=True).

Per rank: A [M, K] (this rank's layer input), B [K, N/W] (this rank's column block of the weight)
->  [M, N] on every rank = [A_0 @ B_0 | A_1 @ B_1 | ... | A_{W-1} @ B_{W-1}]. Each block is computed
with fp32 accumulation and rounded once; the blocks are gathered along the columns. In Megatron A
is replicated; the upstream factory draws it per rank, so A differs per rank here too and a kernel
must gather the output blocks (or each rank's A and B), not assume one A.

Cost per rank: the all-gather brings (W-1)/W of the [M, N] output in; the GEMM is 2*M*(N/W)*K flops;
HBM reads A and B and writes the whole output: (M*K + K*N/W + M*N) * itemsize.

Cases: ``upstream`` is the upstream factory: A [1024, 512], B [512, 1024/W] bf16.
Benchmarks: the Llama-3 LM head (vocab 128256) gathered for sampling: 8B (K = 4096) at prefill
(8192 tokens) and decode (64 tokens), 70B (K = 8192) at decode.
"""


from pkb.problem import Case, Cost, Problem
from pkb.problems.tensor_parallel._common import all_gather_cat, divides_all, itemsize, upstream_randn
from pkb.problems.tensor_parallel._gemm import (
    DECODE_TOKENS, LLAMA3_70B, LLAMA3_8B, PREFILL_TOKENS, UPSTREAM_K, UPSTREAM_M, UPSTREAM_N, activations, weight)

VOCAB = 128256


def make_inputs(case, rank, world_size, gen):
    m, k, n = case["m"], case["k"], case["n"]
    return activations(case, gen, m, k), weight(case, gen, k, n // world_size, fan_in=k)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): A [1024, 512], then B [512, 1024/W], both N(0, 1)."""
    m, k, n = case["m"], case["k"], case["n"]
    return upstream_randn(case, device, (m, k), (k, n // world_size))


def reference(A, B):
    block = A @ B  # [M, N/W], fp32 accumulation inside the GEMM library
    return all_gather_cat(block, dim=1)


def cost(case, world_size):
    m, k, n = case["m"], case["k"], case["n"]
    size = itemsize(case)
    return Cost(link_bytes=(world_size - 1) / world_size * m * n * size, flops=2 * m * (n / world_size) * k,
                hbm_bytes=(m * k + k * n / world_size + m * n) * size, pattern="gemm + all_gather")


PROBLEM = Problem(
    name="gemm_allgather", version=2, upstream_id=14, category="tensor_parallel",
    source="Megatron-LM ColumnParallelLinear (gather_output=True)",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"m": UPSTREAM_M, "k": UPSTREAM_K, "n": UPSTREAM_N},
                   note="the upstream factory: A [1024, 512], B [512, 1024/W] per rank")],
    tests=[
        Case("odd", {"m": 37, "k": 29, "n": 24}, note="3 output columns per rank at W=8", tags=("odd_sizes",)),
        Case("one_row", {"m": 1, "k": 131, "n": 40}, tags=("tiny", "odd_sizes")),
        Case("thin", {"m": 17, "k": 3, "n": 8}, note="one output column per rank at W=8", tags=("odd_sizes", "tiny")),
    ],
    benchmarks=[
        Case("llama3_8b_lm_head_prefill", {"m": PREFILL_TOKENS, "k": LLAMA3_8B["hidden"], "n": VOCAB},
             world_sizes=divides_all(VOCAB)),
        Case("llama3_8b_lm_head_decode", {"m": DECODE_TOKENS, "k": LLAMA3_8B["hidden"], "n": VOCAB},
             world_sizes=divides_all(VOCAB)),
        Case("llama3_70b_lm_head_decode", {"m": DECODE_TOKENS, "k": LLAMA3_70B["hidden"], "n": VOCAB},
             world_sizes=divides_all(VOCAB)),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
