"""Reduce-scatter (mean over ranks) fused with RMSNorm (TensorRT-LLM / vLLM sequence-parallel
all-reduce fusion: the row-parallel output is reduce-scattered over tokens and normalised at once).

Per rank: rs_input_1d [W*rows*H] (flat; block r = rows r*rows ... of this rank's partial output
[W*rows, H]), gamma [H] (the norm weight, replicated), eps (float)  ->  [rows, H]:
    y = (sum over ranks of block r) / W        (the mean, as upstream)
    out = y * rsqrt(mean(y^2, -1) + eps) * gamma
Rounded as upstream's reference rounds: the reduce-scatter and the division by W in the input dtype,
the norm in fp32 from that y, rounded once to the input dtype. H = gamma.numel(); rows = numel / (W*H).
gloo has no AVG reduction, so the reference sums and divides; a kernel may do either.

Cost per rank: the reduce-scatter moves (W-1)/W of the W*rows*H input (input dtype); flops about
5 per output element (divide, square, add, scale, weight) plus W-1 adds; HBM reads the input and
gamma and writes the output: (W*rows*H + H + rows*H) * itemsize.

Tolerance: RMSNorm rescales the mean of W N(0,1) partials to unit size, so an honest bf16
reduce-scatter's error shrinks by sqrt(W) on the way out; ``reduction_tolerance(dtype, W)`` at
scale 1 (gamma is about 1) is a safe bound, and a missing rank moves the output by O(1/sqrt(W)). Each row's
sum of H squares is a long local sum in fp32 (``Tolerance.accumulation``): a kernel that adds the squares one by
one errs by about u sqrt(H) / 6 of the row, some 5 unit roundoffs at H = 1,024, where torch's blocked sum errs by
about one.

Cases: ``upstream_*`` are the upstream factory: hidden 128, rs_input [W*rows*128] with 256 rows per
rank at W = 2 and 4 and 128 at W = 8, eps 1e-5.

Benchmarks: Llama-3 70B (hidden 8192) on an 8192-token prefill and a 64-token decode step;
Llama-3 8B (hidden 4096) prefill. rows = tokens / W.
"""

import dataclasses
import math

import torch
import torch.distributed as dist

from pkb.problem import ACCUMULATION_SIGMAS, Case, Cost, Problem, randn, reduction_tolerance, upstream_seed
from pkb.problems.tensor_parallel._common import dtype_of, global_size, itemsize


def make_inputs(case, rank, world_size, gen):
    tokens, hidden, dtype = global_size(case, "tokens", world_size), case["hidden"], dtype_of(case)
    gamma = (1.0 + randn(gen.shared, hidden, scale=0.2)).to(dtype)
    return randn(gen, tokens * hidden, dtype=dtype), gamma, case.get("eps", 1e-5)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws: gamma [128] N(0, 1) under rank 0's seed (the same on every rank), then, under this
    rank's seed, rs_input [W*rows*128] N(0, 1); eps 1e-5."""
    tokens, hidden, dtype = global_size(case, "tokens", world_size), case["hidden"], dtype_of(case)
    upstream_seed(PROBLEM.upstream_id, 0, trial)
    gamma = torch.randn((hidden,), dtype=dtype, device=device)
    upstream_seed(PROBLEM.upstream_id, rank, trial)
    return torch.randn((tokens * hidden,), dtype=dtype, device=device), gamma, case.get("eps", 1e-5)


def reference(rs_input_1d, gamma, eps):
    world_size = dist.get_world_size()
    hidden = gamma.numel()
    summed = torch.empty(rs_input_1d.numel() // world_size, dtype=rs_input_1d.dtype, device=rs_input_1d.device)
    dist.reduce_scatter_tensor(summed, rs_input_1d, op=dist.ReduceOp.SUM)  # in the input dtype, as upstream
    y = (summed / world_size).view(-1, hidden).float()
    out = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()
    return out.to(rs_input_1d.dtype)


def cost(case, world_size):
    tokens, hidden, size = global_size(case, "tokens", world_size), case["hidden"], itemsize(case)
    rows = tokens / world_size
    return Cost(link_bytes=(world_size - 1) / world_size * tokens * hidden * size,
                flops=(world_size - 1 + 5) * rows * hidden,
                hbm_bytes=(tokens * hidden + hidden + rows * hidden) * size, pattern="reduce_scatter")


NORMALISED_MOST = 4.0  # |out| of a normalised row times gamma (1 +- 0.2) stays under this


def tolerance(case, world_size):
    """``reduction_tolerance`` of the W partials, and the norm's own long local sum declared (the module's docstring):
    each row's sum of H squares, in fp32 in any order (a kernel's own loop over the row), errs by an RMS of
    ``u sqrt(H) / 3`` of itself (a running sum of positive terms, rounded at each of its H steps), ``u sqrt(H) / 6`` of
    the row after the rsqrt, on values up to ``NORMALISED_MOST``."""
    dtype = dtype_of(case)
    base = reduction_tolerance(dtype, world_size, scale=1.0)
    u = min(torch.finfo(dtype).eps, torch.finfo(torch.float32).eps) / 2
    accumulation = u * math.sqrt(case["hidden"]) / 6 * NORMALISED_MOST
    return dataclasses.replace(base, atol=base.atol + ACCUMULATION_SIGMAS * accumulation, accumulation=accumulation)


PROBLEM = Problem(
    name="reducescatter_fused_rmsnorm", version=4, upstream_id=45, category="tensor_parallel",
    source="TensorRT-LLM / vLLM fused reduce-scatter + RMSNorm (sequence-parallel all-reduce fusion)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream_w2_w4", {"tokens_per_rank": 256, "hidden": 128}, world_sizes=(2, 4),
             note="the upstream factory at W <= 4: 256 rows of 128 per rank"),
        Case("upstream_w8", {"tokens_per_rank": 128, "hidden": 128}, world_sizes=(8,),
             note="the upstream factory at W = 8: 128 rows of 128 per rank"),
    ],
    tests=[
        Case("odd_hidden", {"tokens": 24, "hidden": 37}, note="3 rows per rank at W=8", tags=("odd_sizes",)),
        Case("one_row_per_rank_big_eps", {"tokens": 8, "hidden": 130, "eps": 0.5},
             tags=("tiny", "odd_sizes", "argument_value")),
        Case("llama_row", {"tokens": 16, "hidden": 1024}, tags=("shape_regime",)),
    ],
    benchmarks=[
        Case("llama3_70b_prefill", {"tokens": 8192, "hidden": 8192}),
        Case("llama3_70b_decode", {"tokens": 64, "hidden": 8192}),
        Case("llama3_8b_prefill", {"tokens": 8192, "hidden": 4096}),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
