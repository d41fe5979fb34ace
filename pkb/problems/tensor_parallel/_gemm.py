"""Cases and inputs shared by the GEMM + collective problems (upstream 11-16).

Sizes are global: ``m`` tokens, ``k`` the reduction dimension, ``n`` output features. Inputs are
N(0, 1) activations and weights scaled by 1/sqrt(fan-in), so every output element is O(1).
Tests use sizes that 8 divides into odd shares (24 -> 12, 6, 3; 40 -> 20, 10, 5) and odd other
dimensions. A ``<key>_per_rank`` parameter fixes a rank's share instead (``_common.local_size``): the
upstream factory's shapes at M = N = 1024 are per rank (K = 512, B [512, 1024] on every rank).
"""

from __future__ import annotations

import math

from pkb.problem import Case, Cost, randn
from pkb.problems.tensor_parallel._common import dtype_of, global_size, local_size, upstream_randn


def activations(case, gen, rows, cols):
    return randn(gen, rows, cols, dtype=dtype_of(case))


def weight(case, gen, rows, cols, fan_in):
    return randn(gen, rows, cols, dtype=dtype_of(case), scale=1.0 / math.sqrt(fan_in))


# Llama-3 projections under TP (hidden, intermediate, q/kv heads of 128): a column-parallel
# QKV (n = q + 2 kv), the MLP up/gate, the row-parallel o_proj and down_proj.
LLAMA3_8B = {"hidden": 4096, "ffn": 14336, "qkv": 4096 + 2 * 1024}
LLAMA3_70B = {"hidden": 8192, "ffn": 28672, "qkv": 8192 + 2 * 1024}
PREFILL_TOKENS = 8192  # one 8K-token sequence
DECODE_TOKENS = 64  # a decode batch of 64 sequences, one token each


def column_parallel_cases():
    """Llama-3 column-parallel projections (QKV n = q + 2 kv, MLP up n = ffn; K = hidden)."""
    return [
        Case("llama3_70b_qkv_prefill", {"m": PREFILL_TOKENS, "k": LLAMA3_70B["hidden"], "n": LLAMA3_70B["qkv"]}),
        Case("llama3_70b_mlp_up_prefill", {"m": PREFILL_TOKENS, "k": LLAMA3_70B["hidden"], "n": LLAMA3_70B["ffn"]}),
        Case("llama3_8b_qkv_decode", {"m": DECODE_TOKENS, "k": LLAMA3_8B["hidden"], "n": LLAMA3_8B["qkv"]}),
    ]


def row_parallel_cases():
    """Llama-3 row-parallel projections (o_proj K = hidden, down_proj K = ffn; N = hidden)."""
    return [
        Case("llama3_70b_o_proj_prefill", {"m": PREFILL_TOKENS, "k": LLAMA3_70B["hidden"], "n": LLAMA3_70B["hidden"]}),
        Case("llama3_70b_down_proj_prefill", {"m": PREFILL_TOKENS, "k": LLAMA3_70B["ffn"], "n": LLAMA3_70B["hidden"]}),
        Case("llama3_8b_down_proj_decode", {"m": DECODE_TOKENS, "k": LLAMA3_8B["ffn"], "n": LLAMA3_8B["hidden"]}),
    ]


# Sizes that 8 divides into odd shares at some world size; m, and n where it is not sharded, odd.
K_SHARDED_TESTS = [
    Case("odd", {"m": 37, "k": 24, "n": 8 * 5}, tags=("odd_sizes",)),
    Case("thin_shards", {"m": 3, "k": 8, "n": 8 * 3}, note="one column of A per rank at W=8", tags=("odd_sizes", "tiny")),
    Case("taller", {"m": 129, "k": 40, "n": 8 * 7}, tags=("odd_sizes",)),
]


# The upstream factory at M = N = 1024 (K = 512): every rank holds A_local [1024, 512/W] and its own
# B [512, 1024], so B's columns are a fixed 1024 per rank (N = 1024 * W).
UPSTREAM_M, UPSTREAM_K, UPSTREAM_N = 1024, 512, 1024
K_GATHERED_UPSTREAM = [Case("upstream", {"m": UPSTREAM_M, "k": UPSTREAM_K, "n_per_rank": UPSTREAM_N},
                            note="the upstream factory: A_local [1024, 512/W], B [512, 1024] per rank")]


def k_gathered_inputs(case, world_size, gen):
    """A_local [M, K/W] and this rank's weight shard B [K, N/W] (the all-gather + GEMM problems)."""
    m, k, n_local = case["m"], case["k"], local_size(case, "n", world_size)
    return activations(case, gen, m, k // world_size), weight(case, gen, k, n_local, fan_in=k)


def k_gathered_upstream_inputs(case, world_size, device):
    """Upstream's draws for 11 and 12 (after its seed): A_local [M, K/W], then B [K, N/W], both N(0, 1)."""
    m, k = case["m"], case["k"]
    return upstream_randn(case, device, (m, k // world_size), (k, local_size(case, "n", world_size)))


def k_gathered_cost(case, world_size):
    """All-gather of A's K shards ((W-1)/W of M*K) then an [M, K] x [K, N/W] GEMM."""
    m, k, n = case["m"], case["k"], global_size(case, "n", world_size) / world_size
    size = dtype_of(case).itemsize
    return Cost(link_bytes=(world_size - 1) / world_size * m * k * size, flops=2 * m * n * k,
                hbm_bytes=(m * k + k * n + m * n) * size, pattern="all_gather + gemm")


def k_sharded_inputs(case, world_size, gen):
    """Row-parallel inputs: A_local [M, K/W] and B_local [K/W, N], both this rank's own shards."""
    m, n = case["m"], case["n"]
    k_local, k = local_size(case, "k", world_size), global_size(case, "k", world_size)
    return activations(case, gen, m, k_local), weight(case, gen, k_local, n, fan_in=k)


def partial_sum_tolerance(case, world_size):
    """The sum over W ranks of partial products, each a local sum of the rank's K shard (which an honest fp32 kernel may
    accumulate in any order: a K loop): at most N(0, 1) on pkb's inputs (weights scaled 1/sqrt(K)), about
    N(0, k_local) on the upstream factory's (A and B unscaled N(0, 1): ``upstream_randn``)."""
    from pkb.problem import reduction_tolerance

    k_local = local_size(case, "k", world_size)
    scale = math.sqrt(k_local) if case.kind == "upstream" else 1.0
    return reduction_tolerance(dtype_of(case), world_size, scale=scale, local_terms=k_local)
