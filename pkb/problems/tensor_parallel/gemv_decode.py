"""Decode-time logits from a vocab-parallel LM head (Megatron / vLLM ParallelLMHead + gather).

Per rank: hidden_states [T, H] (the decode batch's last hidden states, the same on every rank),
weight_shard [V/W, H] (this rank's vocab rows of the LM head, nn.Linear layout), bias_shard [V/W]
->  [T, V] logits on every rank, vocab blocks in rank order:
    logits_r = hidden_states @ weight_shard^T + bias_shard
(as upstream: the GEMM accumulates in fp32 and is rounded to the input dtype, then the bias is added
and the sum rounded again)
The weight is stored [out, in] as in Megatron and vLLM; upstream's square [1024, 1024] shard did
not say which way round it is.

Cost per rank: the all-gather brings (W-1)/W of the [T, V] logits in; flops 2*T*H*V/W (+ T*V/W for
the bias); HBM is dominated by reading the weight shard: (V/W*H + V/W + T*H + T*V) * itemsize.

Cases: ``upstream`` is the upstream factory: one token, H 1024, 1024 vocab rows per rank (V = 1024*W).

Benchmarks: Llama-3 8B (H 4096, vocab 128256) decoding one sequence and a batch of 64, Llama-3
70B (H 8192) with a batch of 64, Qwen2.5-72B (H 8192, vocab 152064) with a batch of 8.
"""

import math

import torch

from pkb.problem import Case, Cost, Problem, randn, upstream_seed
from pkb.problems.tensor_parallel._common import (
    all_gather_cat, divides_all, dtype_of, itemsize, local_size, upstream_randn)


def make_inputs(case, rank, world_size, gen):
    tokens, hidden, dtype = case["tokens"], case["hidden"], dtype_of(case)
    vocab_local = local_size(case, "vocab", world_size)
    return (randn(gen.shared, tokens, hidden, dtype=dtype),
            randn(gen, vocab_local, hidden, dtype=dtype, scale=1.0 / math.sqrt(hidden)),
            randn(gen, vocab_local, dtype=dtype, scale=0.5))


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws, all under rank 0's seed: hidden [1, 1024], the whole weight [1024*W, 1024] and bias
    [1024*W], N(0, 1) (unscaled); each rank keeps its block of vocab rows (copies)."""
    tokens, hidden, vocab_local = case["tokens"], case["hidden"], local_size(case, "vocab", world_size)
    upstream_seed(PROBLEM.upstream_id, 0, trial)
    hidden_states, weight, bias = upstream_randn(case, device, (tokens, hidden), (vocab_local * world_size, hidden),
                                                 (vocab_local * world_size,))
    rows = slice(rank * vocab_local, (rank + 1) * vocab_local)
    return hidden_states, weight[rows].contiguous(), bias[rows].contiguous()


def reference(hidden_states, weight_shard, bias_shard):
    logits = hidden_states @ weight_shard.t() + bias_shard  # [T, V/W]
    return all_gather_cat(logits, dim=1)


def cost(case, world_size):
    tokens, hidden, size = case["tokens"], case["hidden"], itemsize(case)
    vocab_local = local_size(case, "vocab", world_size)
    vocab = vocab_local * world_size
    return Cost(link_bytes=(world_size - 1) / world_size * tokens * vocab * size,
                flops=2 * tokens * hidden * vocab_local + tokens * vocab_local,
                hbm_bytes=(vocab_local * hidden + vocab_local + tokens * hidden + tokens * vocab) * size,
                pattern="gemv + all_gather")


LLAMA3_VOCAB, QWEN25_VOCAB = 128256, 152064

PROBLEM = Problem(
    name="gemv_decode", version=2, upstream_id=46, category="tensor_parallel",
    source="Megatron-LM / vLLM vocab-parallel LM head at decode (ParallelLMHead, gathered logits)",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"tokens": 1, "hidden": 1024, "vocab_per_rank": 1024},
                   note="the upstream factory: hidden [1, 1024], weight_shard [1024, 1024], bias_shard [1024]")],
    tests=[
        Case("one_token_odd", {"tokens": 1, "hidden": 37, "vocab": 40}, note="5 vocab rows per rank at W=8",
             tags=("odd_sizes",)),
        Case("batch3", {"tokens": 3, "hidden": 130, "vocab": 24}, tags=("odd_sizes", "shape_regime")),
        Case("batch8_thin", {"tokens": 8, "hidden": 9, "vocab": 8}, note="one vocab row per rank at W=8",
             tags=("odd_sizes", "tiny", "shape_regime")),
    ],
    benchmarks=[
        Case("llama3_8b_decode_b1", {"tokens": 1, "hidden": 4096, "vocab": LLAMA3_VOCAB},
             world_sizes=divides_all(LLAMA3_VOCAB)),
        Case("llama3_8b_decode_b64", {"tokens": 64, "hidden": 4096, "vocab": LLAMA3_VOCAB},
             world_sizes=divides_all(LLAMA3_VOCAB)),
        Case("llama3_70b_decode_b64", {"tokens": 64, "hidden": 8192, "vocab": LLAMA3_VOCAB},
             world_sizes=divides_all(LLAMA3_VOCAB)),
        Case("qwen25_72b_decode_b8", {"tokens": 8, "hidden": 8192, "vocab": QWEN25_VOCAB},
             world_sizes=divides_all(QWEN25_VOCAB)),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
