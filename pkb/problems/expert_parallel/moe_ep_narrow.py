"""Expert-parallel MoE forward on EP groups smaller than the world, data-parallel over the groups
(VeOmni MoE layer with an EP size below the world size).

With E experts and E < W (W % E == 0), ``group=None`` means this rank's EP group: ranks
[g*E, (g+1)*E) form group g, one expert per rank (EP rank p = r mod E holds expert p), and the W/E
groups are data-parallel replicas of the layer. The groups are created with dist.new_group on the
first call, in the same order on every rank, and cached per (W, E). With E >= W the EP group is the
whole world (E % W == 0, E/W experts per rank), as in fused_moe_fwd.

Per rank r: hidden_states [T_r, H] (distinct per rank); gate_weight [E, H], gate_bias [E] (router,
replicated); gate_proj, up_proj nn.Linear(H -> I), down_proj nn.Linear(I -> H) (r's MLP, with bias,
distinct per rank), all in the run's precision (bf16 by default); num_experts E; top_k k; group None
->  [T_r, H] in the tokens' dtype. Tokens are exchanged only inside the EP group. Math, fp32 policy,
tie rule and skew (hot and cold EP ranks inside each group): _moe.py.

The upstream case: E = the largest divisor of W in [2, W/2], else 1 (W = 8: 4, W = 4: 2, W = 2: 1,
so at W = 2 every rank is its own EP group and nothing is communicated), top-k = min(2, E), 1024
tokens of hidden 1024, intermediate 128. Tests add groups of two at W = 4 and 8 and the whole-world
group (E = 2W) at every W.

Cost (moe_cost in _moe.py with EP size P = min(E, W)): dispatch + combine move 2 * T * H * bytes * R,
R = (P-1)(1 - C(E-E/P, k)/C(E, k)), plus the count all-gather inside the group.

Benchmarks (config.json): Mixtral 8x7B's expert shapes (hidden 4096, intermediate 14336, top-2) on
8 GPUs as EP 4 x DP 2 (4 experts) for prefill (4096 tokens per rank) and decode (128), and on 4 GPUs
as EP 2 x DP 2 (2 experts, top-1, Switch-style routing, so that routing still chooses).
"""

import torch.distributed as dist

from pkb.problem import Case, Problem
from pkb.problems.expert_parallel._moe import layer_inputs, moe_cost, moe_forward, upstream_layer_inputs

_EP_GROUPS: dict[tuple[int, int], list] = {}


def narrow_num_experts(world_size: int) -> int:
    """The upstream's expert count: the largest divisor of W in [2, W/2], else 1."""
    return next((e for e in range(world_size // 2, 1, -1) if world_size % e == 0), 1)


def num_experts_of(case, world_size: int) -> int:
    experts = case["experts"]
    return {"narrow": narrow_num_experts(world_size), "twice_world": 2 * world_size}.get(experts, experts)


def ep_size(num_experts: int, world_size: int) -> int:
    return min(num_experts, world_size)


def ep_group(num_experts: int):
    """This rank's EP group for ``num_experts`` experts (see the module docstring)."""
    world_size = dist.get_world_size()
    if num_experts >= world_size:
        return dist.group.WORLD
    key = (world_size, num_experts)
    if key not in _EP_GROUPS:
        if world_size % num_experts:
            raise ValueError(f"EP groups of {num_experts} ranks do not tile a world of {world_size}")
        _EP_GROUPS[key] = [dist.new_group(list(range(start, start + num_experts)))
                           for start in range(0, world_size, num_experts)]
    return _EP_GROUPS[key][dist.get_rank() // num_experts]


def make_inputs(case, rank, world_size, gen):
    num_experts = num_experts_of(case, world_size)
    return layer_inputs(case, rank, world_size, gen, num_experts, min(case["top_k"], num_experts),
                        ep_size(num_experts, world_size))


def upstream_inputs(case, rank, world_size, trial, device):
    """Upstream's: N(0, 1) tokens and router, default-initialised nn.Linear MLP, E = the narrow expert count
    (_moe.upstream_layer_inputs); group None as upstream passes it (the reference builds the EP groups)."""
    num_experts = num_experts_of(case, world_size)
    return upstream_layer_inputs(case, device, num_experts, min(case["top_k"], num_experts))


def reference(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k, group=None):
    if group is None:
        group = ep_group(num_experts)
    return moe_forward(hidden_states, gate_weight, gate_bias, gate_proj, up_proj, down_proj, num_experts, top_k,
                       group)


def cost(case, world_size):
    num_experts = num_experts_of(case, world_size)
    return moe_cost(case, num_experts, min(case["top_k"], num_experts), ep_size(num_experts, world_size))


UPSTREAM = (
    Case("upstream", {"tokens": 1024, "experts": "narrow", "top_k": 2, "hidden": 1024, "intermediate": 128},
         note="the upstream factory's defaults: [1024, 1024] tokens, E = largest divisor of W in [2, W/2] "
              "(1 at W = 2), top-min(2, E), nn.Linear 1024 <-> 128"),
)

TESTS = (
    Case("narrow_uneven", {"tokens": 6, "tokens_step": 4, "experts": "narrow", "top_k": 2, "hidden": 16,
                           "intermediate": 8}, world_sizes=(4, 8),
         note="the upstream layout (W/2 experts, two EP groups), a different token count on every rank",
         tags=("uneven_sizes",)),
    Case("pairs_skewed_with_empty_rank", {"tokens": 10, "empty_rank": 1, "experts": 2, "top_k": 1, "hidden": 12,
                                          "intermediate": 6, "skew": True}, world_sizes=(4, 8),
         note="EP groups of two (W/2 of them); in each, the second rank's expert wins nearly every token; "
              "rank 1 holds none", tags=("skewed", "empty_rank", "argument_value")),
    Case("whole_world_uneven", {"tokens": 5, "tokens_step": 3, "experts": "twice_world", "top_k": 2, "hidden": 12,
                                "intermediate": 7},
         note="E = 2W >= W: the EP group is the whole world (group=WORLD), two experts per rank",
         tags=("argument_value", "uneven_sizes", "odd_sizes")),
)

_MIXTRAL = {"hidden": 4096, "intermediate": 14336}

BENCHMARKS = (
    Case("mixtral_shape_ep4_dp2_prefill", {**_MIXTRAL, "experts": 4, "top_k": 2, "tokens": 4096}, world_sizes=(8,)),
    Case("mixtral_shape_ep4_dp2_decode", {**_MIXTRAL, "experts": 4, "top_k": 2, "tokens": 128}, world_sizes=(8,)),
    Case("mixtral_shape_ep2_dp2_top1_prefill", {**_MIXTRAL, "experts": 2, "top_k": 1, "tokens": 4096},
         world_sizes=(4,)),
)

PROBLEM = Problem(
    name="moe_ep_narrow", version=3, upstream_id=51, category="expert_parallel",
    source="VeOmni MoE layer forward on EP sub-groups (one expert per rank, DP over the EP groups)",
    world_sizes=(2, 4, 8), upstream=UPSTREAM, tests=TESTS, benchmarks=BENCHMARKS,
    reference=reference, make_inputs=make_inputs, upstream_inputs=upstream_inputs, cost=cost,
)
