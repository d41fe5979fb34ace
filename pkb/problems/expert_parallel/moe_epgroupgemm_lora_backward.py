"""LoRA weight-gradient sync of an EP group GEMM (VeOmni EPGroupGemm with LoRA, backward).

The LoRA factors that touch the hidden dimension are shared by every expert and replicated on every
EP rank (fc1 gate/up A [r, H], fc2 B [H, r]); each rank's backward only sees the tokens its own
experts processed, so the three gradients are summed over the group.

Per rank: grad_fc1_1_lora_A [*, r, H], grad_fc1_2_lora_A [*, r, H], grad_fc2_lora_B [*, H, r] in the
run's precision (bf16 by default; random, distinct per rank; a leading dimension stacks several layers'
adapters), group None  ->  the same three
tensors, all-reduced in place in their own dtype (each becomes the sum over ranks, rounded to that
dtype at each step of the reduction, as upstream's reference sums them) and returned, as the upstream
does: the inputs after the call are checked like the outputs.
The upstream case: r = 8, H = 1024 ([8, 1024], [8, 1024], [1024, 8] bf16).

Cost: three all-reduces; with S the bytes of the three gradients together, link bytes 2(W-1)/W * S.
HBM: read S, write S.

Benchmarks: rank-16 adapters for every MoE layer at once, hidden sizes from config.json:
DeepSeek-V3 (58 MoE layers, hidden 7168), Qwen3-235B-A22B (94 layers, 4096), Mixtral 8x7B (32 layers,
4096); plus the upstream's single rank-8 adapter of hidden 1024, where latency dominates.
"""

import torch
import torch.distributed as dist

from pkb.problem import Case, Cost, Problem, randn, reduction_tolerance
from pkb.problems.expert_parallel._common import dtype_of


def _shapes(case):
    layers, rank, hidden = case["layers"], case["lora_rank"], case["hidden"]
    lead = (layers,) if layers > 1 else ()
    return (*lead, rank, hidden), (*lead, rank, hidden), (*lead, hidden, rank)


def make_inputs(case, rank, world_size, gen):
    return (*(randn(gen, *shape, dtype=dtype_of(case)) for shape in _shapes(case)), None)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: the three gradients ~ N(0, 1) in the run's dtype, drawn in argument order."""
    return (*(torch.randn(shape, dtype=dtype_of(case), device=device) for shape in _shapes(case)), None)


def reference(grad_fc1_1_lora_A, grad_fc1_2_lora_A, grad_fc2_lora_B, group=None):
    grads = (grad_fc1_1_lora_A, grad_fc1_2_lora_A, grad_fc2_lora_B)
    for grad in grads:  # in place, in the gradients' dtype, as upstream
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
    return grads


def cost(case, world_size):
    size = sum(torch.Size(shape).numel() for shape in _shapes(case)) * dtype_of(case).itemsize
    return Cost(link_bytes=2 * (world_size - 1) / world_size * size, hbm_bytes=2 * size, pattern="all_reduce x3")


def tolerance(case, world_size):
    return reduction_tolerance(dtype_of(case), world_size)


UPSTREAM = (
    Case("upstream", {"layers": 1, "lora_rank": 8, "hidden": 1024},
         note="the upstream factory's defaults: [8, 1024], [8, 1024], [1024, 8] bf16"),
)

TESTS = (
    Case("odd_rank3_hidden37", {"layers": 1, "lora_rank": 3, "hidden": 37}, tags=("odd_sizes",)),
    Case("stacked_5_layers", {"layers": 5, "lora_rank": 2, "hidden": 11}, tags=("layout", "odd_sizes")),
)

BENCHMARKS = (
    Case("upstream_r8_h1024", {"layers": 1, "lora_rank": 8, "hidden": 1024}),
    Case("deepseek_v3_r16_all_layers", {"layers": 58, "lora_rank": 16, "hidden": 7168}),
    Case("qwen3_235b_a22b_r16_all_layers", {"layers": 94, "lora_rank": 16, "hidden": 4096}),
    Case("mixtral_8x7b_r16_all_layers", {"layers": 32, "lora_rank": 16, "hidden": 4096}),
)

PROBLEM = Problem(
    name="moe_epgroupgemm_lora_backward", version=4, upstream_id=30, category="expert_parallel",
    source="VeOmni EPGroupGemm LoRA backward (all-reduce of the shared LoRA gradients)",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS, tolerance=tolerance,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
