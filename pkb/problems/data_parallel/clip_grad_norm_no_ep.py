"""Clip the global gradient norm of an FSDP-sharded model (VeOmni FSDP2 ``clip_grad_norm``).

Per rank: grad_tensors, a list of this rank's gradients (the run's precision, bf16 by default; in the
tests and benchmarks the FSDP2 ``Shard(0)`` pieces of the model's gradients, full shape [R, *rest] ->
[chunk of R, *rest] split like ``torch.chunk``, so trailing ranks may hold fewer rows or none; in the
upstream case three [1024, 1024] tensors per rank), max_norm (float), norm_type (float p), fsdp_group
(the world group; None: nothing is reduced).
Reference: total_norm = (sum over fsdp_group of sum_t ||g_t||_p^p)^(1/p), each norm in fp32; if
total_norm > max_norm, every gradient is multiplied in place by max_norm / total_norm (fp32 0-dim).
Output: total_norm, fp32 0-dim. The clipped gradients are checked as inputs after the call.

Tolerance: the run's default, and the coefficient torch itself uses (``clip_grads_with_norm_``, which VeOmni calls):
max_norm / (total_norm + 1e-6), smaller by 1e-6 / total_norm than the function's. It is declared as a bias of the
clipped gradients (``Tolerance.bias``, from 0 to -1e-6 over half the norm the case's draws give), so that torch's
own clipping passes in fp32, where 3e-6 of a gradient is 50 unit roundoffs; in bf16 it is far below a rounding.

Cost per rank, with n local gradient elements of b bytes: one fp32 all-reduce of a scalar,
link bytes 2(W-1)/W * 4; flops 3n (square and add for the norm, a multiply for the clip); HBM 3n*b
(the gradients read once for the norm, then read and written by the clip).

Benchmarks: one decoder layer of Llama-3-70B (hidden 8192, 8 KV heads x 128, FFN 28672; 856M
parameters) and of Llama-3-8B (hidden 4096, FFN 14336; 218M), sharded across W like FSDP2 does,
as in VeOmni's per-step ``clip_grad_norm_``.
"""

import dataclasses
import math

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, default_tolerance
from pkb.problems.data_parallel._clip import (GRAD_SCALE, clip_, finish_norm, llama_layer_shapes, local_norm_term,
                                              local_shapes, norm_cost_terms, sharded_grads, upstream_grads)
from pkb.problems.data_parallel._common import dtype_of


def make_inputs(case, rank, world_size, gen):
    grads = sharded_grads(case["shapes"], rank, world_size, gen, dtype_of(case), case.get("sharded", True))
    return grads, case["max_norm"], float(case["norm_type"]), dist.group.WORLD


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: three N(0, 1) [1024, 1024] gradients per rank (unscaled, so always clipped)."""
    grads = upstream_grads(case["shapes"], dtype_of(case), device)
    return grads, case["max_norm"], float(case["norm_type"]), dist.group.WORLD


def reference(grad_tensors, max_norm, norm_type=2.0, fsdp_group=None):
    norm_type = float(norm_type)
    device = grad_tensors[0].device if grad_tensors else torch.device("cpu")
    term = local_norm_term(grad_tensors, norm_type, device)
    if fsdp_group is not None:
        dist.all_reduce(term, group=fsdp_group)
    total_norm = finish_norm(term, norm_type)
    clip_(grad_tensors, max_norm, total_norm)
    return total_norm


def cost(case, world_size):
    shapes = local_shapes(case["shapes"], 0, world_size, case.get("sharded", True))
    flops, hbm = norm_cost_terms(sum(math.prod(shape) for shape in shapes), dtype_of(case).itemsize)
    return Cost(link_bytes=2 * (world_size - 1) / world_size * 4, flops=flops, hbm_bytes=hbm, pattern="all_reduce")


TORCH_CLIP_EPS = 1e-6  # torch's clip_grads_with_norm_: max_norm / (total_norm + 1e-6)


def tolerance(case, world_size, dtype):
    """The run's default, with torch's clip coefficient declared as a bias of the clipped gradients (the module's
    docstring): -1e-6 over half the norm the case's draws give (N(0, 1) gradients on every rank upstream, N(0,
    GRAD_SCALE^2) shards of the global shapes otherwise; the L1 norm of n such values is about 0.8 n scale, the L2
    sqrt(n) scale); none where the case never clips."""
    sharded = case.get("sharded", True)
    numel = sum(math.prod(shape) for shape in case["shapes"]) * (1 if sharded else world_size)
    scale = GRAD_SCALE if sharded else 1.0
    norm = scale * (0.8 * numel if float(case["norm_type"]) == 1.0 else math.sqrt(numel))
    clipped = case["max_norm"] < norm  # an unclipped case's gradients come back as they were: no coefficient at all
    return dataclasses.replace(default_tolerance(dtype), bias=-TORCH_CLIP_EPS / (norm / 2) if clipped else 0.0,
                               bias_on=("input[0]",))


# 5 and 3 rows: empty shards on the last ranks at W = 4 and 8; 1-D and 3-D gradients ("layout": upstream
# passes [1024, 1024] ones). Norm ~0.3 (939 elements of std 0.01), so max_norm 0.1 clips by ~3x and 1e4
# never does (upstream's inputs are always clipped): no case sits near the clipping threshold.
_ODD = [[37, 19], [5], [3, 7, 11]]

PROBLEM = Problem(
    name="clip_grad_norm_no_ep", version=4, upstream_id=21, category="data_parallel",
    source="VeOmni veomni/distributed/fsdp2 clip_grad_norm (FSDP2 DTensor grad-norm all-reduce + clip)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"shapes": [[1024, 1024]] * 3, "sharded": False, "max_norm": 1.0, "norm_type": 2.0},
             note="three [1024, 1024] gradients per rank, clipped"),
    ],
    tests=[
        Case("odd_shards_l2_clipped", {"shapes": _ODD, "max_norm": 0.1, "norm_type": 2.0},
             tags=("uneven_sizes", "empty_rank", "odd_sizes", "layout")),
        Case("odd_shards_l2_unclipped", {"shapes": _ODD, "max_norm": 1e4, "norm_type": 2.0},
             tags=("uneven_sizes", "empty_rank", "odd_sizes", "layout", "argument_value")),
        Case("odd_shards_l1", {"shapes": [[9, 4], [2, 3]], "max_norm": 0.01, "norm_type": 1.0},  # L1 norm ~0.34
             tags=("uneven_sizes", "odd_sizes", "argument_value")),
    ],
    benchmarks=[
        Case("llama3_70b_layer_fsdp", {"shapes": llama_layer_shapes(8192, 1024, 28672), "max_norm": 1.0,
                                       "norm_type": 2.0}),
        Case("llama3_8b_layer_fsdp", {"shapes": llama_layer_shapes(4096, 1024, 14336), "max_norm": 1.0,
                                      "norm_type": 2.0}),
    ],
    tolerance=tolerance, reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs,
    cost=cost,
)
