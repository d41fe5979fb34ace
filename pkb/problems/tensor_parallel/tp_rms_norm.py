"""RMSNorm over a hidden dimension sharded across tensor-parallel ranks (e.g. QK-norm of a
column-parallel projection, as OLMo-2 applies it under TP).

Per rank: local_hidden_states [N, H/W] (this rank's columns), local_weight [H/W] (its slice of the
norm weight), variance_epsilon (float)  ->  [N, H/W]:
    variance = (sum over ranks of sum over local columns of x^2) / H     (fp32; all-reduced [N, 1])
    out = local_weight * (x * rsqrt(variance + eps)).to(input dtype)
The statistics and the normalisation are fp32; the normalised x is rounded to the input dtype and
then scaled by the weight in that dtype (rounded again), as HF LlamaRMSNorm and upstream do.
H is H/W * W (equal shards); ``hidden_per_rank`` fixes H/W instead of ``hidden``.

Cost per rank: the all-reduce moves 2(W-1)/W of N*4 bytes (one fp32 sum per row); flops 4 per
local element (square, add, scale, weight); HBM reads x and the weight and writes the output:
(2*N*H/W + H/W) * itemsize.

Cases: ``upstream`` is the upstream factory: x [1024, 1024] and weight [1024] bf16 per rank, eps 1e-5.
Benchmarks: hidden 8192 (Llama-3 70B width) and 5120 (OLMo-2 13B) sharded over W, for an
8192-token prefill and a 64-token decode step.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn
from pkb.problems.tensor_parallel._common import dtype_of, global_size, itemsize, local_size, upstream_randn


def make_inputs(case, rank, world_size, gen):
    n, h_local, dtype = case["tokens"], local_size(case, "hidden", world_size), dtype_of(case)
    weight = (1.0 + randn(gen, h_local, scale=0.2)).to(dtype)
    return randn(gen, n, h_local, dtype=dtype), weight, case.get("eps", 1e-5)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's draws (after its seed): x [1024, 1024], then the weight [1024], both N(0, 1); eps 1e-5."""
    n, h_local = case["tokens"], local_size(case, "hidden", world_size)
    return (*upstream_randn(case, device, (n, h_local), (h_local,)), case.get("eps", 1e-5))


def reference(local_hidden_states, local_weight, variance_epsilon):
    world_size = dist.get_world_size()
    x = local_hidden_states.float()
    sum_squares = x.pow(2).sum(-1, keepdim=True)  # [N, 1]
    dist.all_reduce(sum_squares, op=dist.ReduceOp.SUM)
    variance = sum_squares / (x.shape[-1] * world_size)
    normed = (x * torch.rsqrt(variance + variance_epsilon)).to(local_hidden_states.dtype)
    return local_weight * normed


def cost(case, world_size):
    n, h_local, size = case["tokens"], global_size(case, "hidden", world_size) / world_size, itemsize(case)
    return Cost(link_bytes=2 * (world_size - 1) / world_size * n * 4, flops=4 * n * h_local,
                hbm_bytes=(2 * n * h_local + h_local) * size, pattern="all_reduce")


PROBLEM = Problem(
    name="tp_rms_norm", version=2, upstream_id=18, category="tensor_parallel",
    source="RMSNorm with the hidden dimension sharded across TP (HF LlamaRMSNorm math, all-reduced statistics)",
    world_sizes=(2, 4, 8),
    upstream=[Case("upstream", {"tokens": 1024, "hidden_per_rank": 1024},
                   note="the upstream factory: x [1024, 1024], weight [1024] per rank, eps 1e-5")],
    tests=[
        Case("odd", {"tokens": 37, "hidden": 24}, note="3 columns per rank at W=8", tags=("odd_sizes",)),
        Case("one_token_big_eps", {"tokens": 1, "hidden": 40, "eps": 0.5}, note="eps large enough to matter",
             tags=("tiny", "argument_value")),
        Case("one_column_per_rank", {"tokens": 129, "hidden": 8}, tags=("odd_sizes", "shape_regime")),
    ],
    benchmarks=[
        Case("hidden8192_prefill", {"tokens": 8192, "hidden": 8192}),
        Case("hidden8192_decode", {"tokens": 64, "hidden": 8192}),
        Case("olmo2_13b_hidden5120_prefill", {"tokens": 8192, "hidden": 5120}),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
