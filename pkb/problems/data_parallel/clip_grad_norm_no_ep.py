"""Clip the global gradient norm of an FSDP-sharded model (VeOmni FSDP2 ``clip_grad_norm``).

Per rank: grad_tensors, a list of this rank's FSDP2 ``Shard(0)`` pieces of the model's gradients
(bf16; full shape [R, *rest] -> [chunk of R, *rest] split like ``torch.chunk``, so trailing ranks
may hold fewer rows or none), max_norm (float), norm_type (2.0 or inf), fsdp_group (None: the world).
Output: (total_norm, grad_tensors): the fp32 0-dim norm over all ranks' gradients, and the
gradients clipped in place (g <- bf16(g * min(1, max_norm / (total_norm + 1e-6))), the coefficient
in fp32) and returned. Upstream returned only the norm and never checked the clipped gradients; here
both are outputs, and the in-place update is checked as well. No host sync (the clamp replaces the
upstream's `if total_norm > max_norm`).

Cost per rank, with n local gradient elements of b bytes: one fp32 all-reduce of a scalar,
link bytes 2(W-1)/W * 4; flops 3n (square and add for the norm, a multiply for the clip); HBM 3n*b
(the gradients read once for the norm, then read and written by the clip).

Benchmarks: one decoder layer of Llama-3-70B (hidden 8192, 8 KV heads x 128, FFN 28672; 856M
parameters) and of Llama-3-8B (hidden 4096, FFN 14336; 218M), sharded across W like FSDP2 does,
as in VeOmni's per-step ``clip_grad_norm_``.
"""

import math

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem
from pkb.problems.data_parallel._clip import (clip_, finish_norm, llama_layer_shapes, local_norm_term,
                                              norm_cost_terms, reduce_op, sharded_grads)
from pkb.problems.data_parallel._common import chunk_rows, dtype_of


def make_inputs(case, rank, world_size, gen):
    grads = sharded_grads(case["shapes"], rank, world_size, gen, dtype_of(case))
    return grads, case["max_norm"], float(case["norm_type"]), None


def reference(grad_tensors, max_norm, norm_type=2.0, fsdp_group=None):
    norm_type = float(norm_type)
    device = grad_tensors[0].device if grad_tensors else torch.device("cpu")
    term = local_norm_term(grad_tensors, norm_type, device)
    dist.all_reduce(term, op=reduce_op(norm_type), group=fsdp_group)
    total_norm = finish_norm(term, norm_type)
    clip_(grad_tensors, max_norm, total_norm)
    return total_norm, grad_tensors


def cost(case, world_size):
    numel = sum(chunk_rows(shape[0], 0, world_size)[1] * math.prod(shape[1:]) for shape in case["shapes"])
    flops, hbm = norm_cost_terms(numel, dtype_of(case).itemsize)
    return Cost(link_bytes=2 * (world_size - 1) / world_size * 4, flops=flops, hbm_bytes=hbm, pattern="all_reduce")


_ODD = [[37, 19], [5], [3, 7, 11]]  # 5 and 3 rows: empty shards on the last ranks at W = 4 and 8

PROBLEM = Problem(
    name="clip_grad_norm_no_ep", version=1, upstream_id=21, category="data_parallel",
    source="VeOmni veomni/distributed/fsdp2 clip_grad_norm (FSDP2 DTensor grad-norm all-reduce + clip)",
    world_sizes=(2, 4, 8),
    tests=[
        Case("odd_shards_l2_clipped", {"shapes": _ODD, "max_norm": 0.1, "norm_type": 2.0, "dtype": "bfloat16"}),
        Case("odd_shards_l2_unclipped", {"shapes": _ODD, "max_norm": 1e4, "norm_type": 2.0, "dtype": "bfloat16"}),
        Case("odd_shards_inf_fp32", {"shapes": [[9, 4], [2, 3]], "max_norm": 0.01, "norm_type": "inf",
                                     "dtype": "float32"}),
    ],
    benchmarks=[
        Case("llama3_70b_layer_fsdp", {"shapes": llama_layer_shapes(8192, 1024, 28672), "max_norm": 1.0,
                                       "norm_type": 2.0, "dtype": "bfloat16"}),
        Case("llama3_8b_layer_fsdp", {"shapes": llama_layer_shapes(4096, 1024, 14336), "max_norm": 1.0,
                                      "norm_type": 2.0, "dtype": "bfloat16"}),
    ],
    reference=reference, make_inputs=make_inputs, cost=cost,
)
