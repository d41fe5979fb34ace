"""Expert-parallel MoE forward whose MLP carries LoRA adapters (VeOmni MoE layer with LoRA experts).

Per rank r (EP over all W ranks; E experts, E % W == 0, rank r holds experts [r*E/W, (r+1)*E/W)), as
fused_moe_fwd plus six LoRA factors of rank R (in the run's precision, r's own, shared by its local experts like its
nn.Linear MLP):
  lora_gate_A [R, H], lora_gate_B [I, R], lora_up_A [R, H], lora_up_B [I, R],
  lora_down_A [R, I], lora_down_B [H, R]
->  [T_r, H] in the tokens' dtype, where the MLP of rank r computes
    gate = gate_proj(x) + (x A_g.T) B_g.T,  up likewise,  h = silu(gate) * up,
    y = down_proj(h) + (h A_d.T) B_d.T
(the LoRA scale is folded into B). The LoRA path is sized to change the output by about half the
base path, so dropping it fails. Routing, fp32 policy, tie rule and skew: _moe.py.

The upstream case: 1024 tokens of hidden 1024, 8 experts, top-2, intermediate 128, LoRA rank 8.

Cost (moe_cost in _moe.py): as fused_moe_fwd, plus 2*R*(3H + 3I) flops per dispatched row and the
adapter weights in HBM.

Benchmarks: rank-16 adapters on the routing and shapes of DeepSeek-V3 (256 experts, top-8, 7168 /
2048) at EP 8, Qwen3-30B-A3B (128, top-8, 2048 / 768) at EP 4 and Mixtral 8x7B (8, top-2, 4096 /
14336) at EP 8 (config.json), 4096 tokens per rank.
"""

from pkb.problem import Case, Problem
from pkb.problems.expert_parallel._moe import layer_inputs, moe_cost, moe_forward, upstream_layer_inputs


def make_inputs(case, rank, world_size, gen):
    return layer_inputs(case, rank, world_size, gen, case["experts"], case["top_k"], world_size, case["lora_rank"])


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: as fused_moe_fwd's, then six N(0, 1) adapters (_moe.upstream_layer_inputs)."""
    return upstream_layer_inputs(case, device, case["experts"], case["top_k"], case["lora_rank"])


def reference(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, lora_gate_A, lora_gate_B,
              lora_up_A, lora_up_B, lora_down_A, lora_down_B, num_experts, top_k, group=None):
    lora = (lora_gate_A, lora_gate_B, lora_up_A, lora_up_B, lora_down_A, lora_down_B)
    return moe_forward(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k,
                       group, lora=lora)


def cost(case, world_size):
    return moe_cost(case, case["experts"], case["top_k"], world_size, lora_rank=case["lora_rank"])


UPSTREAM = (
    Case("upstream", {"tokens": 1024, "experts": 8, "top_k": 2, "hidden": 1024, "intermediate": 128,
                      "lora_rank": 8},
         note="the upstream factory's defaults: [1024, 1024] tokens, 8 experts, top-2, nn.Linear 1024 <-> 128, "
              "LoRA rank 8"),
)

TESTS = (
    Case("uneven_tokens_rank3", {"tokens": 8, "tokens_step": 3, "experts": 8, "top_k": 3, "hidden": 24,
                                 "intermediate": 10, "lora_rank": 3}, note="a different token count on every rank",
         tags=("uneven_sizes", "odd_sizes", "argument_value")),
    Case("skewed_with_empty_rank", {"tokens": 9, "empty_rank": 1, "experts": 16, "top_k": 2, "hidden": 20,
                                    "intermediate": 6, "lora_rank": 2, "skew": True},
         note="rank 1 holds no tokens; the last rank's experts get nearly every token, rank 0's none",
         tags=("skewed", "empty_rank", "argument_value")),
)

BENCHMARKS = (
    Case("deepseek_v3_ep8_lora16", {"experts": 256, "top_k": 8, "hidden": 7168, "intermediate": 2048,
                                    "lora_rank": 16, "tokens": 4096}, world_sizes=(8,)),
    Case("qwen3_30b_a3b_ep4_lora16", {"experts": 128, "top_k": 8, "hidden": 2048, "intermediate": 768,
                                      "lora_rank": 16, "tokens": 4096}, world_sizes=(4,)),
    Case("mixtral_8x7b_ep8_lora16", {"experts": 8, "top_k": 2, "hidden": 4096, "intermediate": 14336,
                                     "lora_rank": 16, "tokens": 4096}, world_sizes=(8,)),
)

PROBLEM = Problem(
    name="fused_moe_fwd_lora", version=3, upstream_id=32, category="expert_parallel",
    source="VeOmni MoE layer forward with LoRA experts (EPGroupGemm with LoRA)",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
