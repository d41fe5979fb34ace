"""Expert-parallel MoE forward with one expert per rank (VeOmni MoE layer, E = W).

Per rank r: as fused_moe_fwd with num_experts = W, so rank r holds expert r alone:
  hidden_states [T_r, H]; gate_weight [W, H], gate_bias [W] (router, replicated); gate_proj, up_proj
  nn.Linear(H -> I), down_proj nn.Linear(I -> H) (expert r's MLP, with bias), all in the run's
  precision (bf16 by default); num_experts W; top_k k (<= W); group None
->  [T_r, H] in the tokens' dtype. Every token needs k - 1 or k experts on other ranks. Math, fp32
policy, tie rule and skew: _moe.py.

The upstream case: 1024 tokens of hidden 1024, W experts, top-2, intermediate 128.

Cost (moe_cost in _moe.py): with one expert per rank a token reaches R = (W-1)(1 - C(W-1, k)/C(W, k))
= (W-1) * k/W other ranks on average; dispatch + combine move 2 * T * H * bytes * R.

Benchmarks: Mixtral 8x7B at EP 8 is exactly this layout (8 experts, top-2, hidden 4096, intermediate
14336, config.json), 4096 tokens per rank for prefill and 128 for decode; Mixtral's expert shape at
W = 4 (4 experts, top-2) for the 4-GPU roofline.
"""

from pkb.problem import Case, Problem
from pkb.problems.expert_parallel._moe import layer_inputs, moe_cost, moe_forward, upstream_layer_inputs


def make_inputs(case, rank, world_size, gen):
    return layer_inputs(case, rank, world_size, gen, world_size, min(case["top_k"], world_size), world_size)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: N(0, 1) tokens and router, default-initialised nn.Linear MLP, W experts
    (_moe.upstream_layer_inputs)."""
    return upstream_layer_inputs(case, device, world_size, case["top_k"])


def reference(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k, group=None):
    return moe_forward(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k,
                       group)


def cost(case, world_size):
    return moe_cost(case, world_size, min(case["top_k"], world_size), world_size)


UPSTREAM = (
    Case("upstream", {"tokens": 1024, "top_k": 2, "hidden": 1024, "intermediate": 128},
         note="the upstream factory's defaults: [1024, 1024] tokens, W experts, top-2, nn.Linear 1024 <-> 128"),
)

TESTS = (
    Case("uneven_tokens_top2", {"tokens": 6, "tokens_step": 5, "top_k": 2, "hidden": 16, "intermediate": 12},
         note="a different token count on every rank", tags=("uneven_sizes", "odd_sizes")),
    Case("skewed_with_empty_rank", {"tokens": 11, "empty_rank": 1, "top_k": 1, "hidden": 20, "intermediate": 7,
                                    "skew": True},
         note="top-1: nearly every token goes to the last rank's expert; rank 1 holds none, rank 0's expert none",
         tags=("skewed", "empty_rank", "argument_value", "odd_sizes")),
)

_MIXTRAL = {"top_k": 2, "hidden": 4096, "intermediate": 14336}

BENCHMARKS = (
    Case("mixtral_8x7b_ep8_prefill", {**_MIXTRAL, "tokens": 4096}, world_sizes=(8,)),
    Case("mixtral_8x7b_ep8_decode", {**_MIXTRAL, "tokens": 128}, world_sizes=(8,)),
    Case("mixtral_8x7b_shape_4experts_ep4_prefill", {**_MIXTRAL, "tokens": 4096}, world_sizes=(4,)),
)

PROBLEM = Problem(
    name="moe_ep_balanced", version=3, upstream_id=49, category="expert_parallel",
    source="VeOmni MoE layer forward, one expert per EP rank", world_sizes=(2, 4, 8),
    upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS, reference=reference, make_inputs=make_inputs,
    upstream_inputs=upstream_inputs, cost=cost,
)
