"""Clip the global gradient norm of an FSDP2 + expert-parallel MoE model (VeOmni EP ``clip_grad_norm``).

Mesh: W = ep_fsdp x ep ranks, rank = f * ep + e (expert-parallel ranks consecutive). Dense
("non-EP") parameters are FSDP2-sharded over all W ranks; the experts are split over the ``ep``
ranks of a row (E/ep experts each) and FSDP2-sharded over the ``ep_fsdp`` ranks of a column.

Per rank (gradients in the run's precision, bf16 by default): non_ep_grad_tensors (``Shard(0)`` pieces
of the dense gradients, torch.chunk split, may be empty), ep_grad_tensors ([experts of this rank's
ep_fsdp shard, *rest]; in the upstream case one [1024, 1024] tensor of each kind per rank), max_norm,
norm_type (float p), ep_size, fsdp_group (the world group), ep_fsdp_group and ep_group (the rank's
column and row of the mesh; None where that dimension has one rank, and then nothing is reduced over
it; None for fsdp_group reduces nothing).
Reference: if ep_size > 1, expert gradients are first multiplied in place by 1/ep_size (FSDP averaged
them over the ep_fsdp ranks only; VeOmni rescales them to the world mean). The norm's p-th power sums
the dense term over fsdp_group and the expert term over ep_fsdp_group then ep_group, each tensor's
norm in fp32; total_norm = (dense + expert)^(1/p); if total_norm > max_norm, both lists are
multiplied in place by max_norm / total_norm (fp32 0-dim).
Output: total_norm, fp32 0-dim. The rescaled and clipped gradients are checked as inputs after the call.

Cost per rank, n dense + m expert local elements of b bytes: the three scalar all-reduces fit in one
world all-reduce of two fp32 values (ep_fsdp x ep is the world), link bytes 2(W-1)/W * 8;
flops 3(n + m), plus m for the 1/ep_size rescale when ep_size > 1 (it folds into the norm read and
the clip multiply); HBM 3(n + m)b.

Benchmarks: one MoE decoder layer of Qwen3-30B-A3B (hidden 2048, 32 query / 4 KV heads of 128, 128
experts with FFN 768) and of Qwen3-235B-A22B (hidden 4096, 64 / 4 heads, 128 experts with FFN 1536;
W = 8 only, 2.4B expert parameters), with ep = W/2 as in the upstream setting.
"""

import math

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem
from pkb.problems.data_parallel._clip import (clip_, finish_norm, local_norm_term, local_shapes, norm_cost_terms,
                                              sharded_grads, upstream_grads)
from pkb.problems.data_parallel._common import chunk_rows, dtype_of, mesh_partitions, subgroup


def mesh(case, world_size: int) -> tuple[int, int]:
    """(ep_size, ep_fsdp_size) of the case: ep = W/2 ("half", the upstream setting) or W ("world")."""
    ep_size = max(world_size // 2, 1) if case["ep"] == "half" else world_size
    return ep_size, world_size // ep_size


def expert_shapes(case, rank: int, world_size: int) -> list[list[int]]:
    """This rank's expert gradient shapes: [experts of its ep_fsdp shard, *rest] per expert weight, or
    the case's ``expert_local_shapes`` (the upstream case: one tensor per rank)."""
    if "expert_local_shapes" in case.params:
        return [list(shape) for shape in case["expert_local_shapes"]]
    ep_size, ep_fsdp_size = mesh(case, world_size)
    rows = chunk_rows(case["num_experts"] // ep_size, rank // ep_size, ep_fsdp_size)[1]
    return [[rows, *shape] for shape in case["expert_shapes"]]


def make_inputs(case, rank, world_size, gen):
    dtype = dtype_of(case)
    ep_size, ep_fsdp_size = mesh(case, world_size)
    ep_group = ep_fsdp_group = None
    if dist.is_initialized():  # the groups exist in rank processes; a parent inspecting inputs gets None
        ep_groups, ep_fsdp_groups = mesh_partitions(ep_fsdp_size, ep_size)
        ep_group, ep_fsdp_group = subgroup(ep_groups), subgroup(ep_fsdp_groups)
        if ep_fsdp_size == world_size:
            ep_fsdp_group = dist.group.WORLD
    non_ep = sharded_grads(case["dense_shapes"], rank, world_size, gen, dtype, case.get("sharded", True))
    ep = sharded_grads(expert_shapes(case, rank, world_size), rank, world_size, gen, dtype, sharded=False)
    return (non_ep, ep, case["max_norm"], float(case["norm_type"]), ep_size, dist.group.WORLD, ep_fsdp_group,
            ep_group)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's values: N(0, 1) dense then expert gradients; ep = W/2 with the groups of that mesh, built after
    the draws (at W = 2, ep = 1: no ep group, no new group, the world as the ep_fsdp group)."""
    dtype = dtype_of(case)
    non_ep = upstream_grads(case["dense_shapes"], dtype, device)
    ep = upstream_grads(case["expert_local_shapes"], dtype, device)
    ep_size, ep_fsdp_size = mesh(case, world_size)
    ep_group, ep_fsdp_group = None, dist.group.WORLD
    if ep_size > 1:  # the same groups, in the same order, as upstream's _build_ep_fsdp_groups
        ep_groups, ep_fsdp_groups = mesh_partitions(ep_fsdp_size, ep_size)
        ep_group, ep_fsdp_group = subgroup(ep_groups), subgroup(ep_fsdp_groups)
    return (non_ep, ep, case["max_norm"], float(case["norm_type"]), ep_size, dist.group.WORLD, ep_fsdp_group,
            ep_group)


def reference(non_ep_grad_tensors, ep_grad_tensors, max_norm, norm_type=2.0, ep_size=1, fsdp_group=None,
              ep_fsdp_group=None, ep_group=None):
    norm_type = float(norm_type)
    if ep_size > 1:
        for grad in ep_grad_tensors:
            grad.mul_(1.0 / ep_size)
    device = (non_ep_grad_tensors + ep_grad_tensors)[0].device
    non_ep_term = local_norm_term(non_ep_grad_tensors, norm_type, device)
    if fsdp_group is not None:
        dist.all_reduce(non_ep_term, group=fsdp_group)
    ep_term = local_norm_term(ep_grad_tensors, norm_type, device)
    for group in (ep_fsdp_group, ep_group):
        if group is not None:
            dist.all_reduce(ep_term, group=group)
    total_norm = finish_norm(non_ep_term + ep_term, norm_type)
    clip_(non_ep_grad_tensors + ep_grad_tensors, max_norm, total_norm)
    return total_norm


def cost(case, world_size):
    dense = sum(math.prod(s) for s in local_shapes(case["dense_shapes"], 0, world_size, case.get("sharded", True)))
    experts = sum(math.prod(shape) for shape in expert_shapes(case, 0, world_size))
    flops, hbm = norm_cost_terms(dense + experts, dtype_of(case).itemsize)
    rescale = experts if mesh(case, world_size)[0] > 1 else 0
    return Cost(link_bytes=2 * (world_size - 1) / world_size * 8, flops=flops + rescale, hbm_bytes=hbm,
                pattern="all_reduce")


def _moe_layer(hidden: int, q_dim: int, kv_dim: int, num_experts: int, ffn: int, ep: str) -> dict:
    dense = [[q_dim, hidden], [kv_dim, hidden], [kv_dim, hidden], [hidden, q_dim], [num_experts, hidden],
             [hidden], [hidden], [128], [128]]  # q k v o, router, two RMSNorms, q/k norms
    experts = [[ffn, hidden], [ffn, hidden], [hidden, ffn]]  # gate, up, down of one expert
    return {"dense_shapes": dense, "expert_shapes": experts, "num_experts": num_experts, "ep": ep,
            "max_norm": 1.0, "norm_type": 2.0}


# Norms of the tests (std 0.01 gradients): L2 ~0.3, L1 ~0.2; max_norm 0.1 / 0.01 clip by 3x or more,
# 1e4 never does (upstream's inputs are always clipped): no case sits near the clipping threshold.
# Dense shards run out of rows on the last ranks at W = 4 and 8; 1-D and 3-D gradients are "layout"
# (upstream passes [1024, 1024] ones).
PROBLEM = Problem(
    name="clip_grad_norm_ep", version=3, upstream_id=22, category="data_parallel",
    source="VeOmni veomni/distributed/fsdp2 clip_grad_norm with expert parallelism (ep_fsdp + ep mesh)",
    world_sizes=(2, 4, 8),
    upstream=[
        Case("upstream", {"dense_shapes": [[1024, 1024]], "sharded": False, "expert_local_shapes": [[1024, 1024]],
                          "ep": "half", "max_norm": 1.0, "norm_type": 2.0},
             note="one dense and one expert [1024, 1024] gradient per rank, ep = W/2, clipped"),
    ],
    tests=[
        Case("half_ep_l2_uneven", {"dense_shapes": [[37, 19], [5], [3, 7, 11]], "expert_shapes": [[5, 3], [3, 5]],
                                   "num_experts": 12, "ep": "half", "max_norm": 0.1, "norm_type": 2.0},
             tags=("uneven_sizes", "empty_rank", "odd_sizes", "layout")),
        Case("world_ep_l1", {"dense_shapes": [[6, 4]], "expert_shapes": [[2, 7]], "num_experts": 24, "ep": "world",
                             "max_norm": 0.01, "norm_type": 1.0},
             tags=("uneven_sizes", "empty_rank", "argument_value")),  # ep = W: no ep_fsdp group
        Case("half_ep_l2_unclipped", {"dense_shapes": [[9], [2, 3]], "expert_shapes": [[4]], "num_experts": 8,
                                      "ep": "half", "max_norm": 1e4, "norm_type": 2.0},
             tags=("uneven_sizes", "empty_rank", "odd_sizes", "layout", "argument_value")),
    ],
    benchmarks=[
        Case("qwen3_30b_a3b_moe_layer", _moe_layer(2048, 4096, 512, 128, 768, "half")),
        Case("qwen3_235b_a22b_moe_layer", _moe_layer(4096, 8192, 512, 128, 1536, "half"), world_sizes=(8,)),
    ],
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
