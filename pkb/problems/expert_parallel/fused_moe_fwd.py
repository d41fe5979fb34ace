"""Expert-parallel MoE forward: router, dispatch all-to-all, SwiGLU MLP, combine all-to-all (VeOmni MoE layer).

Per rank r (EP over all W ranks; E experts, E % W == 0, rank r holds experts [r*E/W, (r+1)*E/W)):
  hidden_states [T_r, H] (distinct per rank); gate_weight [E, H], gate_bias [E] (router,
  replicated); gate_proj, up_proj nn.Linear(H -> I) and down_proj nn.Linear(I -> H) with bias
  (r's MLP, shared by its local experts, distinct per rank), all in the run's precision (bf16 by
  default); num_experts E; top_k k; group None
->  [T_r, H] in the tokens' dtype: each token's top-k softmax router weights (not renormalised) times the MLP
outputs of the ranks holding those experts, summed. The math, the fp32 policy, the tie rule and
the skew construction are in _moe.py. Tokens of one rank need the MLPs of the others, so no rank can
answer alone.

The upstream case: 1024 tokens of hidden 1024, 8 experts, top-2, intermediate 128.

Cost (moe_cost in _moe.py): dispatch + combine move 2 * T * H * bytes * R with
R = (W-1)(1 - C(E-E/W, k)/C(E, k)) the expected other ranks per token, plus the count all-gather;
flops 2*T*H*E (router) + T*k*(6*H*I + 2*H) (MLP on the dispatched rows, combine); HBM the rank's MLP.

Benchmarks (config.json of each model; per-rank tokens T: 4096 for prefill, 128 for decode): the
routing and shapes of DeepSeek-V3 (256 routed experts, top-8, hidden 7168, expert intermediate 2048;
its sigmoid router and shared expert are left out) at EP 8, prefill and decode; Qwen3-235B-A22B (128,
top-8, 4096, 1536) at EP 8; Qwen3-30B-A3B (128, top-8, 2048, 768) at EP 4; Mixtral 8x7B (8, top-2,
4096, 14336) at EP 4 and EP 8. As in the upstream, one MLP per rank serves all its local experts.
"""

from pkb.problem import Case, Problem
from pkb.problems.expert_parallel._moe import layer_inputs, moe_cost, moe_forward, upstream_layer_inputs


def make_inputs(case, rank, world_size, gen):
    return layer_inputs(case, rank, world_size, gen, case["experts"], case["top_k"], world_size)


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: N(0, 1) tokens and router, default-initialised nn.Linear MLP (_moe.upstream_layer_inputs)."""
    return upstream_layer_inputs(case, device, case["experts"], case["top_k"])


def reference(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k, group=None):
    return moe_forward(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k,
                       group)


def cost(case, world_size):
    return moe_cost(case, case["experts"], case["top_k"], world_size)


UPSTREAM = (
    Case("upstream", {"tokens": 1024, "experts": 8, "top_k": 2, "hidden": 1024, "intermediate": 128},
         note="the upstream factory's defaults: [1024, 1024] tokens, 8 experts, top-2, nn.Linear 1024 <-> 128"),
)

TESTS = (
    Case("uneven_tokens_top3", {"tokens": 7, "tokens_step": 3, "experts": 8, "top_k": 3, "hidden": 24,
                                "intermediate": 10}, note="a different token count on every rank",
         tags=("uneven_sizes", "odd_sizes", "argument_value")),
    Case("skewed_with_empty_rank", {"tokens": 9, "empty_rank": 1, "experts": 16, "top_k": 2, "hidden": 20,
                                    "intermediate": 6, "skew": True},
         note="rank 1 holds no tokens; the last rank's experts get nearly every token, rank 0's none",
         tags=("skewed", "empty_rank", "argument_value")),
)

_DEEPSEEK_V3 = {"experts": 256, "top_k": 8, "hidden": 7168, "intermediate": 2048}
_QWEN3_235B = {"experts": 128, "top_k": 8, "hidden": 4096, "intermediate": 1536}
_QWEN3_30B = {"experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768}
_MIXTRAL = {"experts": 8, "top_k": 2, "hidden": 4096, "intermediate": 14336}

BENCHMARKS = (
    Case("deepseek_v3_ep8_prefill", {**_DEEPSEEK_V3, "tokens": 4096}, world_sizes=(8,)),
    Case("deepseek_v3_ep8_decode", {**_DEEPSEEK_V3, "tokens": 128}, world_sizes=(8,)),
    Case("qwen3_235b_a22b_ep8_prefill", {**_QWEN3_235B, "tokens": 4096}, world_sizes=(8,)),
    Case("qwen3_30b_a3b_ep4_prefill", {**_QWEN3_30B, "tokens": 4096}, world_sizes=(4,)),
    Case("mixtral_8x7b_ep4_prefill", {**_MIXTRAL, "tokens": 4096}, world_sizes=(4,)),
    Case("mixtral_8x7b_ep8_prefill", {**_MIXTRAL, "tokens": 4096}, world_sizes=(8,)),
)

PROBLEM = Problem(
    name="fused_moe_fwd", version=3, upstream_id=31, category="expert_parallel",
    source="VeOmni MoE layer forward (router -> preprocess -> token_pre_all2all -> SwiGLU MLP -> "
           "tokens_post_all2all)",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
