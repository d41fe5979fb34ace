"""All-gather of K-sharded activations through their transpose, then a GEMM (async-TP recipe).

Per rank: A_local [M, K/W] (this rank's column block of A: columns r*K/W ... (r+1)*K/W - 1),
B [K, N/W] (this rank's weight shard, different per rank)  ->  [M, N/W] = A @ B, where
A = [A_0 | A_1 | ... | A_{W-1}] (concatenated along K).

The gather runs on the transposed shard: A_local^T [K/W, M] is contiguous along the gathered
dimension, so one all_gather_into_tensor yields A^T [K, M] with no concatenation copy (the layout
of PyTorch's symmetric-memory all-gather + matmul recipes); then C = (A^T)^T @ B with fp32
accumulation, rounded once to the input dtype. Upstream 12 (allgather_gemm) is the same product
gathered with the list all-gather and a concatenation.

Cost per rank: the all-gather brings (W-1)/W of A (M*K*itemsize) in; the GEMM is 2*M*(N/W)*K flops;
HBM reads A (gathered) and B, writes C: (M*K + K*N/W + M*N/W) * itemsize.

Cases: ``upstream`` is the upstream factory: A_local [1024, 512/W], B [512, 1024] bf16 (N/W = 1024
at every W).

Benchmarks: Llama-3 70B / 8B column-parallel projections at TP W: QKV (N = 8192 + 2*1024 for 70B,
4096 + 2*1024 for 8B) and the MLP up projection (N = 28672), K = hidden; prefill = one 8192-token
sequence, decode = 64 sequences of one token.

The catalog's slug is ``allgather_gemm_AT``; pkb's slugs are lowercase, so this one is
``allgather_gemm_at`` (upstream number 11 selects it too).
"""

import torch
import torch.distributed as dist

from pkb.problem import Problem
from pkb.problems.tensor_parallel._gemm import (
    K_GATHERED_UPSTREAM, K_SHARDED_TESTS, column_parallel_cases, k_gathered_cost, k_gathered_inputs,
    k_gathered_upstream_inputs)


def make_inputs(case, rank, world_size, gen):
    return k_gathered_inputs(case, world_size, gen)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): A_local [1024, 512/W], then B [512, 1024], both N(0, 1)."""
    return k_gathered_upstream_inputs(case, world_size, device)


def reference(A_local, B):
    world_size = dist.get_world_size()
    shard_t = A_local.t().contiguous()  # [K/W, M]
    gathered_t = torch.empty(world_size * shard_t.numel(), dtype=A_local.dtype, device=A_local.device)
    dist.all_gather_into_tensor(gathered_t, shard_t.view(-1))
    a = gathered_t.view(world_size * shard_t.shape[0], shard_t.shape[1]).t()  # [M, K]
    return a @ B  # in the input dtype: the GEMM library accumulates in fp32


def cost(case, world_size):
    return k_gathered_cost(case, world_size)


PROBLEM = Problem(
    name="allgather_gemm_at", version=2, upstream_id=11, category="tensor_parallel",
    source="PyTorch async-TP all-gather + matmul (torch.distributed._symmetric_memory recipes)",
    world_sizes=(2, 4, 8), upstream=K_GATHERED_UPSTREAM, tests=K_SHARDED_TESTS, benchmarks=column_parallel_cases(),
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
