"""LayerNorm weight and bias gradients under sequence parallelism (Megatron-LM).

With sequence parallelism each rank holds its own slice of the tokens, so the LayerNorm's gamma and
beta gradients are partial sums that Megatron all-reduces across the tensor-parallel group
(``finalize_model_grads`` / ``_allreduce_layernorm_grads``).

Per rank: X_hat [rows_r, H] (this rank's normalised inputs, each row zero-mean unit-variance),
dY [rows_r, H] (the upstream gradient)  ->  (d_gamma [H], d_beta [H]), identical on every rank:
    d_gamma = sum over ranks and rows of dY * X_hat,   d_beta = sum over ranks and rows of dY.
rows_r is ``tokens // W`` plus one for the first ``tokens % W`` ranks (uneven splits allowed).
Computed in fp32 (both sums all-reduced in one fp32 buffer), cast to the input dtype at the end.

Cost per rank (S = the two fp32 gradients, 2*H*4 bytes): the all-reduce moves 2(W-1)/W * S;
flops 3 per element (multiply, two adds): 3 * rows * H with rows = tokens / W; HBM reads both
inputs once, 2 * rows * H * itemsize, and writes the 2*H outputs.

Tolerance: an honest kernel may all-reduce the bf16 partials in any order; each rank's partial sums
``rows`` N(0,1) terms, so the sum over W ranks is ``reduction_tolerance(dtype, W, sqrt(rows))``.

Benchmarks (models that use LayerNorm, micro-batch 1): GPT-3 175B (hidden 12288, sequence 2048,
Megatron's reference configuration) and Nemotron-4 340B (hidden 18432, sequence 4096).
"""

import math

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn, reduction_tolerance
from pkb.problems.tensor_parallel._common import dtype_of, itemsize


def rows_of(case, rank, world_size):
    tokens = case["tokens"]
    return tokens // world_size + (1 if rank < tokens % world_size else 0)


def make_inputs(case, rank, world_size, gen):
    rows, hidden = rows_of(case, rank, world_size), case["hidden"]
    x = randn(gen, rows, hidden)
    centered = x - x.mean(-1, keepdim=True)
    x_hat = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-5)
    return x_hat.to(dtype_of(case)), randn(gen, rows, hidden, dtype=dtype_of(case))


def reference(X_hat, dY):
    dy = dY.float()
    grads = torch.stack([(dy * X_hat.float()).sum(0), dy.sum(0)])  # [2, H]: d_gamma, d_beta
    dist.all_reduce(grads, op=dist.ReduceOp.SUM)
    return grads[0].to(dY.dtype), grads[1].to(dY.dtype)


def cost(case, world_size):
    rows, hidden = case["tokens"] / world_size, case["hidden"]
    grads_bytes = 2 * hidden * 4
    return Cost(link_bytes=2 * (world_size - 1) / world_size * grads_bytes, flops=3 * rows * hidden,
                hbm_bytes=2 * rows * hidden * itemsize(case) + 2 * hidden * itemsize(case), pattern="all_reduce")


def tolerance(case, world_size):
    return reduction_tolerance(dtype_of(case), world_size, scale=math.sqrt(max(case["tokens"] // world_size, 1)))


PROBLEM = Problem(
    name="layernorm_backward", version=1, upstream_id=9, category="tensor_parallel",
    source="Megatron-LM sequence-parallel LayerNorm weight/bias gradient all-reduce",
    world_sizes=(2, 4, 8),
    tests=[
        Case("odd_rows_uneven", {"tokens": 37, "hidden": 129}),
        Case("fewer_tokens_than_ranks", {"tokens": 5, "hidden": 48}, note="some ranks hold no token at W=8"),
        Case("wide", {"tokens": 16, "hidden": 1000}),
    ],
    benchmarks=[
        Case("gpt3_175b_seq2048", {"tokens": 2048, "hidden": 12288}),
        Case("nemotron4_340b_seq4096", {"tokens": 4096, "hidden": 18432}),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, cost=cost,
)
