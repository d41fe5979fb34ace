"""LayerNorm weight and bias gradients under sequence parallelism (Megatron-LM).

With sequence parallelism each rank holds its own slice of the tokens, so the LayerNorm's gamma and
beta gradients are partial sums that Megatron all-reduces across the tensor-parallel group
(``finalize_model_grads`` / ``_allreduce_layernorm_grads``).

Per rank: X_hat [rows_r, H] (this rank's normalised inputs, each row zero-mean unit-variance),
dY [rows_r, H] (the upstream gradient)  ->  (d_gamma [H], d_beta [H]), identical on every rank:
    d_gamma = sum over ranks and rows of dY * X_hat,   d_beta = sum over ranks and rows of dY.
rows_r is ``tokens // W`` plus one for the first ``tokens % W`` ranks (uneven splits allowed), or
``tokens_per_rank`` on every rank. Rounded as upstream's reference rounds: the products dY * X_hat
are rounded to the input dtype, each rank's column sums accumulate inside torch's sum (fp32 for bf16
and fp16) and are rounded once to the input dtype, and the two partials are all-reduced in the input
dtype (d_beta, then d_gamma).

Cost per rank (S = the two gradients, 2*H*itemsize bytes): the all-reduce moves 2(W-1)/W * S;
flops 3 per element (multiply, two adds): 3 * rows * H with rows = tokens / W; HBM reads both
inputs once, 2 * rows * H * itemsize, and writes the 2*H outputs.

Tolerance: an honest kernel may all-reduce the bf16 partials in any order, and may keep the products
in fp32; each rank's partial sums ``rows`` N(0,1) terms, so the sum over W ranks is
``reduction_tolerance(dtype, W, sqrt(rows), local_terms=rows)`` (the products' roundings add about 2^-9 *
sqrt(rows)); the column sums may run in any order, in fp32 a sequential loop over the rows.

Cases: ``upstream`` is the upstream factory's X_hat and dY [1024, 1024] bf16 on every rank.
Benchmarks (models that use LayerNorm, micro-batch 1): GPT-3 175B (hidden 12288, sequence 2048,
Megatron's reference configuration) and Nemotron-4 340B (hidden 18432, sequence 4096).
"""

import math

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn, reduction_tolerance
from pkb.problems.tensor_parallel._common import dtype_of, global_size, itemsize


def rows_of(case, rank, world_size):
    if case.get("tokens_per_rank") is not None:
        return case["tokens_per_rank"]
    tokens = case["tokens"]
    return tokens // world_size + (1 if rank < tokens % world_size else 0)


def make_inputs(case, rank, world_size, gen):
    rows, hidden = rows_of(case, rank, world_size), case["hidden"]
    x = randn(gen, rows, hidden)
    centered = x - x.mean(-1, keepdim=True)
    x_hat = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-5)
    return x_hat.to(dtype_of(case)), randn(gen, rows, hidden, dtype=dtype_of(case))


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): X_hat as rows scaled to unit norm (not to unit variance), then dY."""
    rows, hidden = case["tokens_per_rank"], case["hidden"]
    x_hat = torch.randn(rows, hidden, dtype=dtype_of(case), device=device)
    x_hat = x_hat / (x_hat.norm(dim=-1, keepdim=True) + 1e-5)
    return x_hat, torch.randn(rows, hidden, dtype=dtype_of(case), device=device)


def reference(X_hat, dY):
    d_beta = dY.sum(0)
    d_gamma = (dY * X_hat).sum(0)  # products rounded to the input dtype, as upstream's
    dist.all_reduce(d_beta, op=dist.ReduceOp.SUM)  # in the input dtype, as upstream
    dist.all_reduce(d_gamma, op=dist.ReduceOp.SUM)
    return d_gamma, d_beta


def cost(case, world_size):
    rows, hidden = global_size(case, "tokens", world_size) / world_size, case["hidden"]
    grads_bytes = 2 * hidden * itemsize(case)
    return Cost(link_bytes=2 * (world_size - 1) / world_size * grads_bytes, flops=3 * rows * hidden,
                hbm_bytes=2 * rows * hidden * itemsize(case) + grads_bytes, pattern="all_reduce")


def tolerance(case, world_size):
    rows = global_size(case, "tokens", world_size) // world_size
    return reduction_tolerance(dtype_of(case), world_size, scale=math.sqrt(max(rows, 1)), local_terms=rows)


PROBLEM = Problem(
    name="layernorm_backward", version=4, upstream_id=9, category="tensor_parallel",
    source="Megatron-LM sequence-parallel LayerNorm weight/bias gradient all-reduce",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"tokens_per_rank": 1024, "hidden": 1024},
                   note="the upstream factory: X_hat, dY [1024, 1024] per rank")],
    tests=[
        Case("odd_rows_uneven", {"tokens": 37, "hidden": 129}, tags=("uneven_sizes", "odd_sizes")),
        Case("fewer_tokens_than_ranks", {"tokens": 5, "hidden": 48}, note="some ranks hold no token at W=8",
             tags=("uneven_sizes", "empty_rank", "tiny")),
        Case("wide", {"tokens": 16, "hidden": 1000}, tags=("odd_sizes",)),
    ],
    benchmarks=[
        Case("gpt3_175b_seq2048", {"tokens": 2048, "hidden": 12288}),
        Case("nemotron4_340b_seq4096", {"tokens": 4096, "hidden": 18432}),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
