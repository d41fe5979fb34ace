"""Expert-parallel MoE forward on EP groups of half the world, data-parallel over the two groups
(VeOmni MoE layer with an EP size smaller than the world size).

Ranks [0, P) and [P, W) form two EP groups of size P = W/2 (P = 2, one group, at W = 2: see below); each group holds all E experts
(E % P == 0), EP rank p = r mod P holding experts [p*E/P, (p+1)*E/P), and rank r and r + P hold the
same experts with the same weights (the DP replicas). ``group=None`` means this rank's EP group; both
groups are created with dist.new_group once per process, in the same order on every rank, and cached.

Per rank r: hidden_states [T_r, H] bf16 (distinct per rank); gate_weight [E, H], gate_bias [E]
(router, replicated); gate_proj, up_proj [E/P, I, H], down_proj [E/P, H, I] (EP rank p's experts);
num_experts E; top_k k  ->  [T_r, H] bf16. Tokens are exchanged only inside the EP group. Math, fp32
policy, tie rule and skew (hot and cold EP ranks inside each group): _moe.py.

The upstream used E = largest divisor of W not above W/2 with one expert per rank, which is E = W/2
at W = 2, 4, 8; here E may be any multiple of P. At W = 2 a half-world EP group would be a single rank
that communicates nothing (the upstream's W = 2 case could be answered locally), so there the EP
group is the whole world: P = max(2, W/2).

Cost (moe_cost in _moe.py with EP size P): dispatch + combine move 2 * T * H * bytes * R,
R = (P-1)(1 - C(E-E/P, k)/C(E, k)), plus the count all-gather inside the group.

Benchmarks (config.json): Mixtral 8x7B on 8 GPUs as EP 4 x DP 2 (8 experts, top-2, 4096 / 14336),
DeepSeek-V3 on 8 GPUs as EP 4 x DP 2 (256 experts, 64 per rank, top-8, 7168 / 2048), 4096 tokens per
rank; Mixtral 8x7B on 4 GPUs as EP 2 x DP 2.
"""

import torch.distributed as dist

from pkb.problem import Case, Problem
from pkb.problems.expert_parallel._moe import layer_inputs, moe_cost, moe_forward

_EP_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def ep_size(world_size: int) -> int:
    return max(2, world_size // 2)


def ep_group(world_size: int) -> dist.ProcessGroup:
    """This rank's EP group; all EP groups are created on first use, by every rank in the same order."""
    size = ep_size(world_size)
    spans = [tuple(range(start, start + size)) for start in range(0, world_size, size)]
    for ranks in spans:
        if ranks not in _EP_GROUPS:
            _EP_GROUPS[ranks] = dist.new_group(list(ranks))
    return _EP_GROUPS[spans[dist.get_rank() // size]]


def _num_experts(case, world_size):
    return case["experts"] if "experts" in case.params else case["experts_per_rank"] * ep_size(world_size)


def make_inputs(case, rank, world_size, gen):
    num_experts = _num_experts(case, world_size)
    return layer_inputs(case, rank, world_size, gen, num_experts, min(case["top_k"], num_experts), ep_size(world_size))


def reference(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k, group=None):
    if group is None:
        group = ep_group(dist.get_world_size())
    return moe_forward(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k,
                       group)


def cost(case, world_size):
    num_experts = _num_experts(case, world_size)
    return moe_cost(case, num_experts, min(case["top_k"], num_experts), ep_size(world_size))


TESTS = (
    Case("one_expert_per_rank_uneven", {"tokens": 6, "tokens_step": 4, "experts_per_rank": 1, "top_k": 2,
                                        "hidden": 16, "intermediate": 8},
         note="the upstream layout (E = W/2), a different token count on every rank"),
    Case("skewed_with_empty_rank", {"tokens": 10, "empty_rank": 1, "experts_per_rank": 2, "top_k": 2,
                                    "hidden": 12, "intermediate": 6, "skew": True},
         note="in each EP group the last EP rank's experts win nearly every token; rank 1 holds none"),
)

BENCHMARKS = (
    Case("mixtral_8x7b_ep4_dp2_prefill", {"experts": 8, "top_k": 2, "hidden": 4096, "intermediate": 14336,
                                          "tokens": 4096}, world_sizes=(8,)),
    Case("deepseek_v3_ep4_dp2_prefill", {"experts": 256, "top_k": 8, "hidden": 7168, "intermediate": 2048,
                                         "tokens": 4096}, world_sizes=(8,)),
    Case("mixtral_8x7b_ep2_dp2_prefill", {"experts": 8, "top_k": 2, "hidden": 4096, "intermediate": 14336,
                                          "tokens": 4096}, world_sizes=(4,)),
)

PROBLEM = Problem(
    name="moe_ep_narrow", version=1, upstream_id=51, category="expert_parallel",
    source="VeOmni MoE layer forward on EP sub-groups (EP = W/2, DP over the two EP groups)",
    world_sizes=(2, 4, 8), tests=TESTS, benchmarks=BENCHMARKS,
    reference=reference, make_inputs=make_inputs, cost=cost,
)
