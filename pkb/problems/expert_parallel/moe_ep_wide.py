"""Expert-parallel MoE forward with two experts per rank (VeOmni MoE layer, E = 2W).

Per rank r: as fused_moe_fwd with num_experts = 2W, rank r holding experts 2r and 2r+1:
  hidden_states [T_r, H]; gate_weight [2W, H], gate_bias [2W] (router, replicated); gate_proj,
  up_proj nn.Linear(H -> I), down_proj nn.Linear(I -> H) (the MLP r's two experts share, with bias),
  all in the run's precision (bf16 by default); num_experts 2W; top_k k; group None
->  [T_r, H] in the tokens' dtype. Math, fp32 policy, tie rule and skew: _moe.py.

The upstream case: 1024 tokens of hidden 1024, 2W experts, top-2, intermediate 128.

Cost (moe_cost in _moe.py): R = (W-1)(1 - C(2W-2, k)/C(2W, k)) other ranks per token on average;
dispatch + combine move 2 * T * H * bytes * R.

Benchmarks: Mixtral 8x7B's routing at EP 4 has this layout (8 experts, top-2, hidden 4096,
intermediate 14336, config.json; as in the upstream, a rank's two experts share one MLP), 4096 tokens
per rank for prefill and 128 for decode; Mixtral's shapes with 16 experts at W = 8.
"""

from pkb.problem import Case, Problem
from pkb.problems.expert_parallel._moe import layer_inputs, moe_cost, moe_forward, upstream_layer_inputs


def make_inputs(case, rank, world_size, gen):
    return layer_inputs(case, rank, world_size, gen, 2 * world_size, case["top_k"], world_size)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: N(0, 1) tokens and router, default-initialised nn.Linear MLP, 2W experts
    (_moe.upstream_layer_inputs)."""
    return upstream_layer_inputs(case, device, 2 * world_size, case["top_k"])


def reference(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k, group=None):
    return moe_forward(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k,
                       group)


def cost(case, world_size):
    return moe_cost(case, 2 * world_size, case["top_k"], world_size)


UPSTREAM = (
    Case("upstream", {"tokens": 1024, "top_k": 2, "hidden": 1024, "intermediate": 128},
         note="the upstream factory's defaults: [1024, 1024] tokens, 2W experts, top-2, nn.Linear 1024 <-> 128"),
)

TESTS = (
    Case("uneven_tokens_top3", {"tokens": 5, "tokens_step": 4, "top_k": 3, "hidden": 16, "intermediate": 9},
         note="a different token count on every rank", tags=("uneven_sizes", "odd_sizes", "argument_value")),
    Case("skewed_with_empty_rank", {"tokens": 10, "empty_rank": 1, "top_k": 2, "hidden": 12, "intermediate": 5,
                                    "skew": True},
         note="both of the last rank's experts win nearly every token; rank 1 holds none, rank 0's experts none",
         tags=("skewed", "empty_rank", "odd_sizes")),
)

_MIXTRAL = {"top_k": 2, "hidden": 4096, "intermediate": 14336}

BENCHMARKS = (
    Case("mixtral_8x7b_ep4_prefill", {**_MIXTRAL, "tokens": 4096}, world_sizes=(4,)),
    Case("mixtral_8x7b_ep4_decode", {**_MIXTRAL, "tokens": 128}, world_sizes=(4,)),
    Case("mixtral_8x7b_shape_16experts_ep8_prefill", {**_MIXTRAL, "tokens": 4096}, world_sizes=(8,)),
)

PROBLEM = Problem(
    name="moe_ep_wide", version=3, upstream_id=50, category="expert_parallel",
    source="VeOmni MoE layer forward, two experts per EP rank", world_sizes=(2, 4, 8),
    upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS, reference=reference, make_inputs=make_inputs,
    upstream_inputs=upstream_inputs, cost=cost,
)
